"""The logical-axis rules table and the partition specs derived from it."""

from __future__ import annotations

from collections.abc import Mapping

from jax.sharding import Mesh, PartitionSpec

# Logical axis -> mesh axis (None: replicated). Megatron-style tensor parallelism: attention heads and
# MLP columns split over "tensor"; their output projections are split on their input side.
LOGICAL_AXIS_RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": "data",
    "sequence": None,
    "pages": "data",  # each data-parallel rank owns its own range of KV pages
    "data_ranks": "data",  # an array with a part per data-parallel rank (the token buffer's entries)
    "page_offset": None,
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "embed": None,
    "mlp": "tensor",
    "vocab": "tensor",
    "expert": None,
    "expert_mlp": "tensor",  # inside each expert, as "mlp"
    "shared_expert_mlp": "tensor",  # Qwen2-MoE's shared expert, as "mlp"
    "latent": None,  # DeepSeek's low-rank bottlenecks (q_lora_rank, kv_lora_rank): small, replicated
    "lora_slots": None,  # LoRA adapter slots (jaxserve/lora): every device holds every slot
    "lora_rank": None,  # and the whole rank; A's in and B's out axes split as their base kernel's
}
# With expert parallelism the experts themselves are spread over every device instead.
EXPERT_PARALLEL_RULES = {**LOGICAL_AXIS_RULES, "expert": ("data", "tensor"), "expert_mlp": None}


def partition_spec(
    logical_axes: tuple[str | None, ...],
    mesh: Mesh,
    sizes: dict[str, int] | None = None,
    rules: Mapping[str, str | tuple[str, ...] | None] = LOGICAL_AXIS_RULES,
) -> PartitionSpec:
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
            count = (sizes or {}).get(name) if name is not None else None
            if split == 1 or (count is not None and count % split):
                mesh_axis = None
        if mesh_axis is not None:
            for axis in axes:
                if axis in used:
                    raise ValueError(
                        f"logical axes {used[axis]!r} and {name!r} of one array both map to mesh axis {axis!r}"
                    )
                used[axis] = name
        spec.append(mesh_axis)
    return PartitionSpec(*spec)
