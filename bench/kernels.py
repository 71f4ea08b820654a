"""Paged attention kernels against the reference and against the device's memory bandwidth.

For decode (one query per sequence) at several contexts and batch sizes, and for prefill chunks,
each implementation is timed on the same inputs; the bytes it must read (K and V of every context
plus the queries) divided by its time give a bandwidth, reported as a fraction of a measured
device-to-device copy. Prints JSON lines.

    .venv/bin/python bench/kernels.py            # CPU: reference, C++ kernel, Pallas in interpret mode (small grid)
    python bench/kernels.py --impls reference,pallas --full   # on a GPU: the whole grid
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np
from timing import best_time

from pallas_kernels import ragged_paged_attention
from pallas_kernels.paged_attention import pallas_gpu

DECODE_BANDWIDTH_TARGET = 0.7  # the kernel's goal on a GPU: decode at context >= 1k


def emit(**record) -> None:
    print(json.dumps(record), flush=True)


def copy_bandwidth(num_bytes: int, repeats: int) -> float:
    """Bytes moved per second (read + write) by a device-to-device copy."""
    x = jnp.ones((num_bytes // 4,), jnp.float32)
    copy = jax.jit(lambda a: a + 0.0)
    return 2 * x.nbytes / best_time(copy, x, repeats=repeats)


def make_inputs(rng, batch, context, new_tokens, query_block, page_size, num_heads, num_kv_heads, head_dim, dtype):
    pages_per_seq = -(-context // page_size)
    num_pages = batch * pages_per_seq + 1
    page_table = (1 + rng.permutation(num_pages - 1)).reshape(batch, pages_per_seq).astype(np.int32)
    padded = -(-new_tokens // query_block) * query_block
    token_seq_ids = np.repeat(np.arange(batch), padded).astype(np.int32)
    one = np.concatenate([np.arange(context - new_tokens, context), -np.ones(padded - new_tokens)])
    positions = np.tile(one, batch).astype(np.int32)
    q = jnp.asarray(rng.standard_normal((batch * padded, num_heads, head_dim)), dtype)
    k_pages = jnp.asarray(rng.standard_normal((num_pages, page_size, num_kv_heads, head_dim)), dtype)
    v_pages = jnp.asarray(rng.standard_normal((num_pages, page_size, num_kv_heads, head_dim)), dtype)
    return (q, k_pages, v_pages, jnp.asarray(page_table), jnp.asarray(token_seq_ids), jnp.asarray(positions))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--impls", default=None, help="comma-separated; default: all that run on this backend")
    parser.add_argument("--full", action="store_true", help="contexts 512-8k, batches 1-64 (slow in interpret mode)")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on accelerators, float32 on CPU")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    backend = jax.default_backend()
    impls = (
        args.impls.split(",")
        if args.impls
        else (["reference", "cpu", "pallas"] if backend == "cpu" else ["reference", "pallas"])
    )
    dtype = jnp.dtype(args.dtype or ("float32" if backend == "cpu" else "bfloat16"))
    num_heads, num_kv_heads, head_dim, page_size = 32, 8, 128, 16
    if args.full:
        decode_cases = [(b, c) for c in (512, 1024, 2048, 4096, 8192) for b in (1, 8, 32, 64)]
        prefill_cases = [(1, 512, 512), (4, 2048, 256), (1, 4096, 1024)]
    else:
        decode_cases = [(1, 512), (8, 1024)]
        prefill_cases = [(1, 512, 128)]
    bandwidth = copy_bandwidth(256 * 2**20, args.repeats)
    emit(
        bench="kernels",
        backend=backend,
        device=str(jax.devices()[0].device_kind),
        dtype=str(dtype),
        heads=num_heads,
        kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        copy_bandwidth_gb_s=round(bandwidth / 1e9, 1),
    )
    rng = np.random.default_rng(0)
    cases = [("decode", b, c, 1, 1) for b, c in decode_cases] + [("prefill", b, c, n, 16) for b, c, n in prefill_cases]
    decode_fractions: dict[str, list[float]] = {}
    for kind, batch, context, new_tokens, query_block in cases:
        inputs = make_inputs(
            rng, batch, context, new_tokens, query_block, page_size, num_heads, num_kv_heads, head_dim, dtype
        )
        bytes_read = 2 * batch * context * num_kv_heads * head_dim * dtype.itemsize + inputs[0].nbytes
        results, outputs = {}, {}
        for impl in impls:
            if impl == "cpu" and (backend != "cpu" or dtype != jnp.float32):
                continue
            fn = jax.jit(
                lambda *a, impl=impl, query_block=query_block: ragged_paged_attention(
                    *a, query_block=query_block, impl=impl
                )
            )
            seconds = best_time(fn, *inputs, repeats=args.repeats)
            results[impl], outputs[impl] = seconds, np.asarray(fn(*inputs), np.float32)
            extra = {}
            if "reference" in outputs:
                extra["max_error_vs_reference"] = float(np.abs(outputs[impl] - outputs["reference"]).max())
            if impl == "pallas" and backend != "tpu":
                pages = -(-context // page_size)
                spans = -(-pages // pallas_gpu.block_sizes(head_dim, page_size, dtype))
                extra["num_splits"] = pallas_gpu.default_num_splits(
                    batch * -(-new_tokens // query_block) * num_kv_heads, spans
                )
            emit(
                kind=kind,
                impl=impl,
                batch=batch,
                context=context,
                new_tokens=new_tokens,
                ms=round(seconds * 1e3, 3),
                gb_s=round(bytes_read / seconds / 1e9, 2),
                fraction_of_copy_bandwidth=round(bytes_read / seconds / bandwidth, 3),
                **extra,
            )
            if kind == "decode" and context >= 1024:
                decode_fractions.setdefault(impl, []).append(bytes_read / seconds / bandwidth)
        if "reference" in results:
            emit(
                kind=kind,
                batch=batch,
                context=context,
                speedup_vs_reference={
                    impl: round(results["reference"] / t, 2) for impl, t in results.items() if impl != "reference"
                },
            )
    for impl, fractions in decode_fractions.items():
        emit(
            summary="decode, context >= 1k",
            impl=impl,
            min_fraction_of_copy_bandwidth=round(min(fractions), 3),
            median_fraction_of_copy_bandwidth=round(float(np.median(fractions)), 3),
            target=DECODE_BANDWIDTH_TARGET,
            meets_target=min(fractions) >= DECODE_BANDWIDTH_TARGET,
            note=None if backend != "cpu" else "CPU: fractions of a single-threaded copy, not meaningful",
        )


if __name__ == "__main__":
    main()
