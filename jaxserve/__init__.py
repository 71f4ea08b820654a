"""jaxserve: an LLM inference engine on JAX.

A request flows: LLM.generate / Engine.add_request -> host/scheduler.py (which sequences run which
tokens, on which KV pages of host/page_allocator.py) -> device/step_inputs.py (padded to a compiled
bucket) -> device/runner.py runs the compiled step (the model over the paged KV cache, then
on-device sampling) -> host/output_processor.py (append tokens, detokenize, stop checks) -> pages
freed or kept cached as sequences finish. docs/architecture.md tells it file by file.

The public names below are imported on first use, not with the package: the router process and other
host-only tools import jaxserve's submodules without paying for (or needing) JAX.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# public name -> the module that defines it
_LAZY = {
    "LLM": "jaxserve.llm",
    "CompletionOutput": "jaxserve.host.request",
    "EngineConfig": "jaxserve.config",
    "GuidedDecodingParams": "jaxserve.host.request",
    "LoRARequest": "jaxserve.lora.request",
    "StructuredOutputsParams": "jaxserve.host.request",
    "ModelConfig": "jaxserve.models.config",
    "RequestOutput": "jaxserve.host.request",
    "SamplingParams": "jaxserve.host.request",
}

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "GuidedDecodingParams",
    "LoRARequest",
    "ModelConfig",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
]

if TYPE_CHECKING:  # for type checkers and editors; at run time __getattr__ imports them
    from jaxserve.config import EngineConfig
    from jaxserve.host.request import (
        CompletionOutput,
        GuidedDecodingParams,
        RequestOutput,
        SamplingParams,
        StructuredOutputsParams,
    )
    from jaxserve.llm import LLM
    from jaxserve.lora.request import LoRARequest
    from jaxserve.models.config import ModelConfig


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'jaxserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # later lookups find it directly
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
