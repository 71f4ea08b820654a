"""The C++ sampler draw (cpu_sampler.cc): each row's token from its logits, temperature, top-k / top-p / min-p,
seed and token index (the reference's uniform, drawn in the kernel), by the reference's rules
(jaxserve/device/sampler.py, sampling_draws.py). Built at first use into the CPU kernels' one library
(pallas_kernels/cpu_library.py); `path=` builds and calls another instruction path's library beside it (tests,
benches).

On a mesh the rows' shards (over the data ranks, each row's vocabulary whole) are drawn by every device on its
own, under shard_map: the partitioner cannot split a custom call.
"""

from __future__ import annotations

from typing import Any, cast

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from pallas_kernels import cpu_library

SAMPLE = cpu_library.CustomCall("jaxserve_cpu_sample", "JaxserveSample")
target, available = SAMPLE.target, SAMPLE.available


def serves() -> bool:
    """Whether a step traced now samples with the kernel: on the CPU, where it builds, and where the reference's
    uniforms are the ones the kernel draws (JAX's default threefry keys, partitionable bits)."""
    config = cast(Any, jax.config)  # its options are attributes set at run time, which the type stubs do not declare
    same_uniforms = config.jax_threefry_partitionable and config.jax_default_prng_impl == "threefry2x32"
    return jax.default_backend() == "cpu" and bool(same_uniforms) and available()


def sample_tokens(
    logits,
    temperature,
    top_k,
    top_p,
    min_p,
    seeds,
    token_indices,
    *,
    rows_sharding: NamedSharding | None = None,
    path: str | None = None,
):
    """logits [S, V] float32 and per row: temperature [S] (0: the first argmax), top_k [S] (0: none), top_p [S],
    min_p [S], seeds [S, 2] uint32 (threefry key data) and token_indices [S] -> [S] int32 tokens. Each row's
    uniform is the reference's (sampler.row_uniforms), drawn in the kernel. rows_sharding: how the rows lie on a
    mesh (rows over the data ranks, the vocabulary whole); each device then draws its own rows."""
    num_rows = logits.shape[0]
    per_row = (temperature, top_k, top_p, min_p, token_indices)
    if logits.ndim != 2 or any(x.shape != (num_rows,) for x in per_row) or seeds.shape != (num_rows, 2):
        raise ValueError(
            f"the CPU sampler wants logits [S, V], seeds [S, 2] and one parameter a row, got logits {logits.shape}, "
            f"seeds {seeds.shape}, {[x.shape for x in per_row]}"
        )
    if not available(path):
        raise RuntimeError("the CPU sampler could not be built; use the jax.numpy sampler")
    own_helpers = jax.device_count() == 1  # else XLA's pool's threads (cpu_kernel.cc: several device programs)

    def draw(logits, temperature, top_k, top_p, min_p, seeds, token_indices):
        call = jax.ffi.ffi_call(target(path), jax.ShapeDtypeStruct((logits.shape[0],), jnp.int32))
        return call(
            logits.astype(jnp.float32),
            temperature.astype(jnp.float32),
            top_k.astype(jnp.int32),
            top_p.astype(jnp.float32),
            min_p.astype(jnp.float32),
            seeds.astype(jnp.uint32),
            token_indices.astype(jnp.int32),
            own_helpers=own_helpers,
        )

    operands = (logits, temperature, top_k, top_p, min_p, seeds, token_indices)
    if rows_sharding is None:
        return draw(*operands)
    rows = PartitionSpec(rows_sharding.spec[0] if len(rows_sharding.spec) else None)
    matrix = PartitionSpec(rows[0], None)
    in_specs = (matrix, rows, rows, rows, rows, matrix, rows)
    return jax.shard_map(draw, mesh=rows_sharding.mesh, in_specs=in_specs, out_specs=rows, check_vma=False)(*operands)
