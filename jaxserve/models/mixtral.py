"""Hugging Face tensor names of Mixtral checkpoints: Llama's, except each MoE layer's router and experts.

Our experts are stacked: gate_proj / up_proj [X, E, F], down_proj [X, F, E]. Checkpoints store them
either per expert ([out, in] each, as on the Hub) or in transformers >= 5's fused layout
(mlp.experts.gate_up_proj [X, 2F, E], mlp.experts.down_proj [X, E, F]).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxserve.models import llama


@dataclass(frozen=True)
class MoENames:
    """Where a family keeps each MoE layer's router and per-expert tensors ({layer}, {expert} filled in)."""

    routers: tuple[str, ...]  # tried in order
    per_expert: str  # with {name}: the family's name for gate_proj, up_proj or down_proj
    expert_names: dict  # our expert param -> its per-expert name

    def read_param(self, reader, path: tuple[str, ...], shape: tuple[int, ...]):
        if len(path) == 5 and path[2:4] == ("mlp", "gate"):  # the router's kernel
            names = [name.format(layer=path[1]) for name in self.routers]
            return reader.read(next((name for name in names if name in reader), names[-1])).T
        if len(path) == 4 and path[2] == "mlp":  # stacked experts
            return self._read_experts(reader, path[1], path[3], num_experts=shape[0])
        return llama.read_param(reader, path, shape)

    def _read_experts(self, reader, layer: str, name: str, num_experts: int):
        per_expert = self.per_expert.format(layer=layer, expert="{expert}", name=self.expert_names[name])
        if per_expert.format(expert=0) in reader:
            # np.stack on the host: a GGUF reader's quantized blocks stack as blocks (loading/quantize_gguf.py)
            return np.stack([reader.read(per_expert.format(expert=e)).T for e in range(num_experts)])
        fused = f"model.layers.{layer}.mlp.experts."
        if name == "down_proj":
            return np.swapaxes(reader.read(fused + "down_proj"), 1, 2)
        gate_up = reader.read(fused + "gate_up_proj")
        half = gate_up.shape[1] // 2
        rows = slice(0, half) if name == "gate_proj" else slice(half, 2 * half)
        return np.swapaxes(gate_up[:, rows, :], 1, 2)


MIXTRAL = MoENames(
    routers=("model.layers.{layer}.block_sparse_moe.gate.weight", "model.layers.{layer}.mlp.gate.weight"),
    per_expert="model.layers.{layer}.block_sparse_moe.experts.{expert}.{name}.weight",
    expert_names={"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"},
)
read_param = MIXTRAL.read_param
