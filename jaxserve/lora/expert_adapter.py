"""Reading LoRA weights of a mixture-of-experts layer's routed experts, in either layout PEFT writes.

Both become per-expert projections named `layers.{i}.mlp.experts.{e}.{gate_proj|up_proj|down_proj}`, A [in, r]
and B [r, out] (scaled) as adapter.py's Projection, which the registry writes into the expert slots (one row
per expert; sharding/moe.py's grouped matmul applies them):

- transformers < 5 kept one nn.Linear per expert, which PEFT adapts as any Linear:
  `layers.{i}.mlp.experts.{e}.{gate_proj,up_proj,down_proj}` (Qwen2/3-MoE) or
  `layers.{i}.block_sparse_moe.experts.{e}.{w1,w3,w2}` (Mixtral: gate, up, down).
- transformers >= 5 fuses them into 3-D params, mlp.experts.gate_up_proj [X, 2F, E] and down_proj [X, E, F]
  (out before in), which PEFT adapts through `target_parameters` (lora.ParamWrapper): lora_A [X * r, in] holds
  expert e's A in rows e * r ... e * r + r-1, and lora_B [out, r * X] expert e's B in columns j * X + e (PEFT's
  get_delta_weight reshapes them so). A second target on the same module nests: its tensors sit under
  `experts.base_layer`. Which is which follows from the shapes (gate_up maps E -> 2F, down F -> E), since
  PEFT's nesting order is an implementation detail; gate_up's B splits into gate's and up's (gate first, as
  transformers' chunk(2)), each keeping the shared A.
"""

from __future__ import annotations

import math
import re

import numpy as np

FUSED_EXPERTS = re.compile(r"^(layers\.\d+)\.mlp\.experts((?:\.base_layer)*)$")  # a ParamWrapper's module
PER_EXPERT = re.compile(r"^(layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)$")
PER_EXPERT_NAMES = {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}
PER_EXPERT_NAMES.update(w1="gate_proj", w3="up_proj", w2="down_proj")  # Mixtral's
FUSED_PARAMS = ("gate_up_proj", "down_proj")
EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def expert_path(layer: str, expert: int, projection: str) -> str:
    return f"{layer}.mlp.experts.{expert}.{projection}"


def per_expert_path(module: str) -> str | None:
    """Our per-expert path for a transformers < 5 expert Linear's module name; None for other modules."""
    match = PER_EXPERT.match(module)
    if match is None or match.group(3) not in PER_EXPERT_NAMES:
        return None
    layer, expert, name = match.groups()
    return expert_path(layer, int(expert), PER_EXPERT_NAMES[name])


def split_expert_path(path: str) -> tuple[str, int, str] | None:
    """The expert slots' path, the expert and the projection of a routed expert's path:
    "layers.0.mlp.experts.3.gate_proj" -> ("layers.0.mlp.gate_proj", 3, "gate_proj"); None for other paths."""
    match = re.match(r"^(layers\.\d+\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)$", path)
    if match is None:
        return None
    prefix, expert, projection = match.groups()
    return f"{prefix}.{projection}", int(expert), projection


def fused_expert_projections(
    wrappers: dict[str, tuple[np.ndarray, np.ndarray]], config: dict, path: str, scale, prefix: str = ""
):
    """ParamWrapper tensors {module: (lora_A [X * r, in], lora_B [out, r * X])} -> {our per-expert path:
    (A [in, r], B [r, out] scaled)}; scale(module path, rank) gives the scaling PEFT applies there. PEFT matches its
    patterns with a parameter's name in the model: prefix ("model.") + "layers.3.mlp.experts.gate_up_proj"."""
    targets = config.get("target_parameters") or []
    kinds = {name.rsplit(".", 1)[-1] for name in targets}
    unknown = sorted(kinds - set(FUSED_PARAMS))
    if unknown:
        raise ValueError(
            f"adapter {path!r} targets parameters {unknown}; LoRA on parameters is served for the routed "
            f"experts' fused {list(FUSED_PARAMS)} only"
        )
    by_layer: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
    for module, pair in sorted(wrappers.items()):
        match = FUSED_EXPERTS.match(module)
        assert match is not None  # the caller picked them so
        by_layer.setdefault(match.group(1), []).append(pair)
    projections = {}
    for layer, pairs in by_layer.items():
        for kind, (a, b) in _identify(pairs, kinds, layer, path).items():
            name = f"{layer}.mlp.experts.{kind}"
            rank = _pattern_value(config.get("rank_pattern") or {}, prefix + name, config.get("r", 8), path)
            if a.shape[0] % rank or b.shape[1] != a.shape[0]:
                raise ValueError(
                    f"adapter {path!r}: {layer}'s experts.{kind} lora_A {a.shape} and lora_B {b.shape} are not "
                    f"rank {rank} per expert"
                )
            num_experts = a.shape[0] // rank
            per_expert_a = a.reshape(num_experts, rank, a.shape[1])  # [X, r, in]
            per_expert_b = b.reshape(b.shape[0], rank, num_experts)  # [out, r, X]
            scaling = np.float32(scale(name, rank))
            for expert in range(num_experts):
                a_e = np.ascontiguousarray(per_expert_a[expert].T)  # [in, r]
                b_e = np.ascontiguousarray(per_expert_b[:, :, expert].T) * scaling  # [r, out]
                if kind == "down_proj":
                    projections[expert_path(layer, expert, "down_proj")] = (a_e, b_e)
                    continue
                if b_e.shape[1] % 2:
                    raise ValueError(f"adapter {path!r}: {layer}'s experts.gate_up_proj has an odd width {b.shape[0]}")
                gate, up = np.split(b_e, 2, axis=1)
                projections[expert_path(layer, expert, "gate_proj")] = (a_e, np.ascontiguousarray(gate))
                projections[expert_path(layer, expert, "up_proj")] = (a_e, np.ascontiguousarray(up))
    return projections


def _identify(pairs, kinds: set[str], layer: str, path: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Which fused param each of a layer's wrappers adapts: gate_up_proj maps E -> 2F, down_proj F -> E."""
    if len(pairs) == 1 and len(kinds) == 1:
        return {next(iter(kinds)): pairs[0]}
    if len(pairs) == 2:
        (a0, b0), (a1, b1) = pairs
        in0, out0, in1, out1 = a0.shape[1], b0.shape[0], a1.shape[1], b1.shape[0]
        if out0 == 2 * in1 and out1 == in0:
            return {"gate_up_proj": pairs[0], "down_proj": pairs[1]}
        if out1 == 2 * in0 and out0 == in1:
            return {"gate_up_proj": pairs[1], "down_proj": pairs[0]}
    raise ValueError(
        f"adapter {path!r}: {layer}'s experts hold {len(pairs)} LoRA wrappers whose shapes are not the fused "
        f"gate_up_proj and down_proj of one expert MLP (target_parameters: {sorted(kinds)})"
    )


def _pattern_value(pattern: dict, module: str, default, path: str):
    """PEFT's rank_pattern / alpha_pattern lookup (peft.utils.other.get_pattern_key): the first key that matches the
    end of the module's name in the model ("model.layers.1.mlp.down_proj"), the key a group of its own (so that
    "q_proj|v_proj" matches either whole)."""
    for key, value in pattern.items():
        try:
            if re.match(rf"(.*\.)?({key})$", module):
                return value
        except re.error as error:
            raise ValueError(f"adapter {path!r}: pattern key {key!r} is not a regular expression ({error})") from None
    return default


def scaling_for(config: dict, prefix: str = "", path: str = ""):
    """scale(module name, rank) -> PEFT's scaling there: alpha / r, or alpha / sqrt(r) with rsLoRA. The name is
    ours ("layers.1.mlp.down_proj") under the model's own prefix ("model.")."""

    def scale(module: str, rank: int) -> float:
        alpha = _pattern_value(config.get("alpha_pattern") or {}, prefix + module, config.get("lora_alpha", 8), path)
        return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank

    return scale
