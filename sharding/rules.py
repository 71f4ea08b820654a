"""The logical-axis rules table and the partition specs derived from it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from jax.sharding import Mesh, PartitionSpec

if TYPE_CHECKING:  # sharding/ sits below jaxserve: no runtime import back into it
    from jaxserve.config import ModelConfig

# Logical axis -> mesh axis (None: replicated). Megatron-style tensor parallelism: attention heads and
# MLP columns split over "tensor"; their output projections are split on their input side.
LOGICAL_AXIS_RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": "data",
    "sequence": None,
    "pages": "data",  # each data-parallel rank owns its own range of KV pages
    "page_offset": None,
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "embed": None,
    "mlp": "tensor",
    "vocab": "tensor",
    "expert": None,
    "expert_mlp": "tensor",  # inside each expert, as "mlp"
}
# With expert parallelism the experts themselves are spread over every device instead.
EXPERT_PARALLEL_RULES = {**LOGICAL_AXIS_RULES, "expert": ("data", "tensor"), "expert_mlp": None}


def partition_spec(logical_axes: tuple[str | None, ...], mesh: Mesh, sizes: dict[str, int] | None = None,
                   rules: dict[str, str | None] = LOGICAL_AXIS_RULES) -> PartitionSpec:
    """Map logical axes to mesh axes. An axis whose count (sizes[name], e.g. the number of heads)
    the mesh axis does not divide is replicated. Two logical axes of one array may not share a mesh axis."""
    spec, used = [], {}
    for name in logical_axes:
        mesh_axis = rules.get(name) if name is not None else None
        if name is not None and name not in rules:
            raise ValueError(f"no sharding rule for logical axis {name!r}")
        if mesh_axis is not None:
            axes = mesh_axis if isinstance(mesh_axis, tuple) else (mesh_axis,)
            split = 1
            for axis in axes:
                split *= mesh.shape[axis]
            count = (sizes or {}).get(name)
            if split == 1 or (count is not None and count % split):
                mesh_axis = None
        if mesh_axis is not None:
            for axis in axes:
                if axis in used:
                    raise ValueError(f"logical axes {used[axis]!r} and {name!r} of one array both map to "
                                     f"mesh axis {axis!r}")
                used[axis] = name
        spec.append(mesh_axis)
    return PartitionSpec(*spec)


# The last path entries of each param -> its logical axes (nnx Linear kernels are [in, out]).
PARAM_AXES = {
    ("embed_tokens", "embedding"): ("vocab", "embed"),
    ("lm_head", "kernel"): ("embed", "vocab"),
    ("q_proj", "kernel"): ("embed", "heads"),
    ("k_proj", "kernel"): ("embed", "kv_heads"),
    ("v_proj", "kernel"): ("embed", "kv_heads"),
    ("o_proj", "kernel"): ("heads", "embed"),
    ("q_proj", "bias"): ("heads",),
    ("k_proj", "bias"): ("kv_heads",),
    ("v_proj", "bias"): ("kv_heads",),
    ("o_proj", "bias"): ("embed",),
    ("gate_proj", "kernel"): ("embed", "mlp"),
    ("up_proj", "kernel"): ("embed", "mlp"),
    ("down_proj", "kernel"): ("mlp", "embed"),
    ("gate_proj", "bias"): ("mlp",),
    ("up_proj", "bias"): ("mlp",),
    ("down_proj", "bias"): ("embed",),
    ("gate", "kernel"): ("embed", None),  # the MoE router: small, replicated
}
EXPERT_PARAM_AXES = {  # Mixtral experts, stacked [X, ...]
    "gate_proj": ("expert", "embed", "expert_mlp"),
    "up_proj": ("expert", "embed", "expert_mlp"),
    "down_proj": ("expert", "expert_mlp", "embed"),
}


def param_logical_axes(path: tuple, config: ModelConfig) -> tuple[str | None, ...]:
    names = tuple(str(p) for p in path)
    if names[-1] == "weight":  # RMSNorm scales
        return ("embed",)
    if config.is_moe and len(names) >= 2 and names[-2] == "mlp" and names[-1] in EXPERT_PARAM_AXES:
        return EXPERT_PARAM_AXES[names[-1]]
    axes = PARAM_AXES.get(names[-2:])
    if axes is None:
        raise ValueError(f"no logical axes for param {'.'.join(names)}")
    return axes


def logical_sizes(config: ModelConfig) -> dict[str, int]:
    """How many independent units each logical axis has: a split must not cut through a head."""
    return {"heads": config.num_heads, "kv_heads": config.num_kv_heads, "mlp": config.intermediate_size,
            "expert_mlp": config.intermediate_size, "vocab": config.vocab_size, "embed": config.hidden_size,
            "head_dim": config.head_dim, "expert": config.num_experts or 1}
