"""Hugging Face tensor names of GPT-OSS checkpoints: Llama's attention (every projection with a bias) plus
each layer's sinks, and a mixture of experts whose router and experts have biases.

transformers keeps the experts fused and unlike Mixtral's: mlp.experts.gate_up_proj [X, E, 2F] holds the
gate's and the up projection's columns interleaved (gate at even columns, up at odd ones), with
gate_up_proj_bias [X, 2F] alike; mlp.experts.down_proj [X, F, E] and down_proj_bias [X, E] are already laid
out as ours; the router is mlp.router (weight [X, E], bias [X]). Our experts are stacked as gate_proj /
up_proj [X, E, F], down_proj [X, F, E] with biases [X, F], [X, F], [X, E]. A reader holding the split
names (a GGUF file serving them apart) is read the same way: it presents these fused names.
"""

from __future__ import annotations

from jaxserve.models import llama

# our param -> (its fused checkpoint tensor, which of the interleaved columns: 0 gate, 1 up; None: all)
EXPERT_TENSORS = {
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", None),
    "gate_proj_bias": ("gate_up_proj_bias", 0),
    "up_proj_bias": ("gate_up_proj_bias", 1),
    "down_proj_bias": ("down_proj_bias", None),
}


def read_param(reader, path: tuple[str, ...], shape: tuple[int, ...]):
    """The checkpoint tensor for our param at `path`, laid out as ours (the caller checks its shape)."""
    if len(path) == 4 and path[3] == "sinks":  # ("layers", i, "self_attn", "sinks")
        return reader.read(f"model.layers.{path[1]}.self_attn.sinks")
    if len(path) == 5 and path[2:4] == ("mlp", "gate"):  # the router: kernel [E, X] or bias [X]
        tensor = reader.read(f"model.layers.{path[1]}.mlp.router.{llama.LEAF_NAMES[path[4]]}")
        return tensor.T if path[4] == "kernel" else tensor
    if len(path) == 4 and path[2] == "mlp" and path[3] in EXPERT_TENSORS:
        name, column = EXPERT_TENSORS[path[3]]
        tensor = reader.read(f"model.layers.{path[1]}.mlp.experts.{name}")
        return tensor if column is None else tensor[..., column::2]
    return llama.read_param(reader, path, shape)
