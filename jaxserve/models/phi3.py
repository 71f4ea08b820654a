"""Hugging Face tensor names of Phi-3 / Phi-3.5 / Phi-4-mini checkpoints: Llama's, except that each layer
fuses its projections, split here as they are read: self_attn.qkv_proj [(H + 2K) * D, E] holds q, k and v
rows in that order; mlp.gate_up_proj [2F, E] the gate's rows, then the up projection's. A reader that
holds the split names (a GGUF file serving them apart) is read as Llama."""

from __future__ import annotations

from jaxserve.models import llama

FUSED = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
}


def read_param(reader, path: tuple[str, ...], shape: tuple[int, ...]):
    """Our q/k/v and gate/up kernels [E, out] from the fused tensors; everything else as Llama."""
    if len(path) < 2 or path[-1] != "kernel" or path[-2] not in FUSED or llama.hf_name(path) in reader:
        return llama.read_param(reader, path, shape)
    name = path[-2]
    fused = reader.read(llama.hf_name((*path[:-2], FUSED[name], "kernel")))  # [rows, E]
    rows, total = shape[1], fused.shape[0]
    # q's rows come first, k's and v's (as many each) last; gate's are the first half, up's the second
    start = {"q_proj": 0, "k_proj": total - 2 * rows, "v_proj": total - rows, "gate_proj": 0, "up_proj": total // 2}
    return fused[start[name] : start[name] + rows].T
