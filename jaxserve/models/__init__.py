"""Models: pure functions of (params, tokens, positions, kv pages, attention metadata) -> (hidden, kv pages).

`build_model` returns a flax nnx module for the configured architecture; the runner splits it into a
static graph and a params pytree, so nothing is stored on modules between steps. Each param carries
its logical axes (sharding/placement.py places it by them); how attention reaches the KV pages and
how routed tokens reach their experts are functions passed in (sharding/attention.py,
sharding/moe.py), so the model code is the same on one device and on a mesh; which kernel computes
each projection is the matmul plan passed in (pallas_kernels/matmul), so the model names no kernel.
Each family's Hugging Face tensor names sit in its own module (llama.py, mixtral.py, qwen3_moe.py,
phi3.py; Gemma's are Llama's, Qwen2-MoE's Qwen3-MoE's).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from jaxserve.models.config import ModelConfig

if TYPE_CHECKING:
    from jaxserve.models.decoder import CausalLM
    from jaxserve.models.kv_pages import AttentionMetadata, KVPages
    from jaxserve.models.layers import Matmul, WriteAndAttend
    from jaxserve.models.moe import Experts

    CHECKPOINT_NAMES: dict  # model_type -> read_param, built on first use (__getattr__)

# The rest is imported on first use, not with the package: ModelConfig is plain Python, and the router
# (which must not load JAX) reads a model's config through this package.
_LAZY = {
    "AttentionMetadata": "jaxserve.models.kv_pages",
    "CausalLM": "jaxserve.models.decoder",
    "Experts": "jaxserve.models.moe",
    "KVPages": "jaxserve.models.kv_pages",
    "Matmul": "jaxserve.models.layers",
    "WriteAndAttend": "jaxserve.models.layers",
}


def _checkpoint_names() -> dict:
    """model_type -> read_param(reader, our param path, its shape) -> the checkpoint tensor laid out as ours"""
    from jaxserve.models import deepseek, gpt_oss, llama, mixtral, phi3, qwen3_moe

    return {
        "gemma2": llama.read_param,
        "gemma3_text": llama.read_param,
        "gemma3": llama.read_param,  # multimodal: its text model loads as gemma3_text (loading/multimodal.py's names)
        "phi3": phi3.read_param,
        "llama": llama.read_param,
        "mistral": llama.read_param,
        "qwen2": llama.read_param,
        "qwen3": llama.read_param,
        "mixtral": mixtral.read_param,
        "qwen3_moe": qwen3_moe.read_param,
        "qwen2_moe": qwen3_moe.read_param,
        "deepseek_v2": deepseek.read_param,
        "deepseek_v3": deepseek.read_param,
        "kimi_k2": deepseek.read_param,
        "gpt_oss": gpt_oss.read_param,
    }


def __getattr__(name: str):
    if name == "CHECKPOINT_NAMES":
        value = _checkpoint_names()
    elif name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    else:
        raise AttributeError(f"module 'jaxserve.models' has no attribute {name!r}")
    globals()[name] = value  # later lookups find it directly
    return value


def build_model(
    config: ModelConfig,
    dtype,
    *,
    write_and_attend: WriteAndAttend,
    matmul: Matmul,
    experts: Experts | None = None,
    rngs=None,
) -> CausalLM:
    """write_and_attend: the attention kernels, on one device or per shard; matmul: the projections'
    kernels (pallas_kernels.matmul.choose_matmul); experts: how routed tokens reach their experts
    (mixture-of-experts models only)."""
    if config.is_moe and experts is None:
        raise ValueError(f"a {config.model_type} model with experts needs an experts function (sharding/moe.py)")
    from flax import nnx

    from jaxserve.models.decoder import CausalLM

    return CausalLM(
        config,
        dtype=dtype,
        write_and_attend=write_and_attend,
        matmul=matmul,
        experts=experts,
        rngs=rngs or nnx.Rngs(0),
    )


__all__ = [
    "AttentionMetadata",
    "CHECKPOINT_NAMES",
    "CausalLM",
    "Experts",
    "KVPages",
    "Matmul",
    "ModelConfig",
    "WriteAndAttend",
    "build_model",
]
