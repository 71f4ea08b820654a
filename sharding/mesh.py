"""The device mesh, from the engine options named as vLLM users know them."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh

MESH_AXES = ("data", "tensor")


def build_mesh(data_parallel_size: int = 1, tensor_parallel_size: int = 1, devices=None) -> Mesh:
    devices = list(devices if devices is not None else jax.devices())
    needed = data_parallel_size * tensor_parallel_size
    if data_parallel_size < 1 or tensor_parallel_size < 1:
        raise ValueError("data_parallel_size and tensor_parallel_size must be >= 1")
    if needed > len(devices):
        raise ValueError(
            f"data_parallel_size x tensor_parallel_size = {needed} devices, but only {len(devices)} are available"
        )
    grid = np.asarray(devices[:needed]).reshape(data_parallel_size, tensor_parallel_size)
    return Mesh(grid, MESH_AXES)
