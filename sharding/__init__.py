"""Sharding: one device mesh, one table from logical axes to mesh axes, and what is placed by it.

Model code never names mesh axes. Each param declares its logical axes where it is created (embed,
heads, kv_heads, mlp, vocab, expert, ...); `LOGICAL_AXIS_RULES` maps those to the mesh axes ("data",
"tensor"), `partition_spec` turns a description into a PartitionSpec, replicating any axis whose size
the mesh axis does not divide (GQA with fewer KV heads than tensor-parallel devices, say), and
`param_shardings` places a whole model's params. The parallel dispatches a model is built with live
here too: attention per shard (attention.py) and experts spread over devices (moe.py).
"""

from sharding.mesh import build_mesh
from sharding.placement import param_shardings
from sharding.rules import LOGICAL_AXIS_RULES, partition_spec

__all__ = ["LOGICAL_AXIS_RULES", "build_mesh", "param_shardings", "partition_spec"]
