"""Sharding: one device mesh, one table from logical axes to mesh axes, and partition specs from it.

Model code never names mesh axes. Each param is described by logical axes (embed, heads, kv_heads,
mlp, vocab, expert, ...); `LOGICAL_AXIS_RULES` maps those to the mesh axes ("data", "tensor"), and
`partition_spec` turns a description into a PartitionSpec, replicating any axis whose size the mesh
axis does not divide (GQA with fewer KV heads than tensor-parallel devices, say).
"""

from sharding.mesh import build_mesh
from sharding.rules import LOGICAL_AXIS_RULES, param_logical_axes, partition_spec

__all__ = ["LOGICAL_AXIS_RULES", "build_mesh", "param_logical_axes", "partition_spec"]
