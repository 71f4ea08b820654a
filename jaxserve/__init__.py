"""jaxserve: an LLM inference engine on JAX.

A request flows: LLM.generate / Engine.add_request -> host/scheduler.py (which sequences run which
tokens, on which KV pages of host/page_allocator.py) -> device/step_inputs.py (padded to a compiled
bucket) -> device/runner.py runs the compiled step (the model over the paged KV cache, then
on-device sampling) -> host/output_processor.py (append tokens, detokenize, stop checks) -> pages
freed or kept cached as sequences finish. docs/architecture.md tells it file by file.
"""

from jaxserve.config import EngineConfig
from jaxserve.host.request import CompletionOutput, RequestOutput, SamplingParams
from jaxserve.llm import LLM
from jaxserve.models.config import ModelConfig

__version__ = "0.1.0"

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "ModelConfig", "RequestOutput", "SamplingParams"]
