"""Arrays placed on a mesh without a whole copy on one device or a gather across processes.

`jax.device_put(value, sharding)` of a host or one-device value puts the whole value on a device first (an
uncommitted jnp array lives on the default device), and where the sharding spans several processes it first
checks that every process holds the same value with a collective over the whole of it
(multihost_utils.assert_equal): for every weight of a model larger than a host, its full size gathered from
each process. So:

- `zeros_on(shapes, shardings)`: zeros of the shapes (a pytree of anything with .shape and .dtype: what
  jax.eval_shape gives) made inside jit, each device writing only its own shard: the KV cache of 8
  accelerators never sits whole on the first one.
- `kv_pages_on(mesh, make_pages, heads)`: zeros_on for a KV cache, laid out by the sharding rules.
- `put_on(value, sharding, what)`: a host value (the same on every process: read from the same checkpoint)
  placed shard by shard from the host (jax.make_array_from_callback); across processes, a checksum of the
  value is compared instead of the value, so that a process reading other weights is still refused, naming
  `what`.
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np

from sharding.attention import kv_pages_shardings


def zeros_on(shapes, shardings):
    """Zeros of shapes' shapes and dtypes laid out as shardings (one, or a pytree as shapes), each device
    computing its own shard."""
    return jax.jit(lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes), out_shardings=shardings)()


def kv_pages_on(mesh, make_pages, num_cache_kv_heads: int):
    """make_pages() (a KVPages of zeros) laid out on the mesh, each data-parallel rank its own pages and each tensor
    shard its KV heads' slice of them, every device making only its own shard; without a mesh, make_pages()."""
    if mesh is None:
        return make_pages()
    shapes = jax.eval_shape(make_pages)
    return zeros_on(shapes, kv_pages_shardings(shapes, mesh, num_cache_kv_heads))


def put_on(value, sharding, what: str = "a value"):
    """value on sharding. One process: jax.device_put. Several: each process fills its own shards from its
    host copy, after the processes agree on a checksum of the value (a ValueError naming `what` otherwise)."""
    if sharding.is_fully_addressable:
        return jax.device_put(value, sharding)
    host = np.ascontiguousarray(np.asarray(value))
    _agree_on_checksum(host, what)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def _agree_on_checksum(host: np.ndarray, what: str) -> None:
    from jax.experimental import multihost_utils

    checksum = np.array([zlib.crc32(host.reshape(-1).view(np.uint8).data), host.size % 2**31], np.uint32)
    try:
        multihost_utils.assert_equal(checksum, fail_message="")
    except AssertionError:
        raise ValueError(f"{what} differs between the processes (each must read the same checkpoint)") from None
