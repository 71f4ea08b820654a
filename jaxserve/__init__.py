"""jaxserve: an LLM inference engine on JAX.

A request flows: LLM.generate / Engine.add_request -> Scheduler.schedule (host: which sequences run
which tokens, on which KV pages) -> batch.build_step_inputs (padded to a compiled bucket) -> the
jit-compiled step (model forward over the paged KV cache, then on-device sampling) ->
output_processor (append tokens, detokenize, stop checks) -> pages freed as sequences finish.
"""

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.llm import LLM
from jaxserve.host.request import CompletionOutput, RequestOutput, SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "ModelConfig", "RequestOutput", "SamplingParams"]
