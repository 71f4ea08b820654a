"""Hugging Face tensor names of dense Llama-family checkpoints: Llama, Mistral, Qwen2 and Qwen3.

Our param paths are transformers' module paths without the leading `model.`; nnx Linear kernels are
[in, out] where torch stores weights [out, in]. A reader is anything with `name in reader` and
`reader.read(name) -> array` (safetensors files, or a GGUF file presenting these names).
"""

from __future__ import annotations

LEAF_NAMES = {"kernel": "weight", "embedding": "weight", "weight": "weight", "bias": "bias"}


def hf_name(path: tuple[str, ...]) -> str:
    """("layers", "0", "self_attn", "q_proj", "kernel") -> "model.layers.0.self_attn.q_proj.weight"."""
    *module, leaf = path
    prefix = "" if module == ["lm_head"] else "model."
    return prefix + ".".join(module) + "." + LEAF_NAMES[leaf]


def read_param(reader, path: tuple[str, ...], shape: tuple[int, ...]):
    """The checkpoint tensor for our param at `path`, laid out as ours. Every family's read_param takes
    the shape the model expects (stacked experts need their count); the caller checks it."""
    tensor = reader.read(hf_name(path))
    return tensor.T if path[-1] == "kernel" else tensor
