"""The C++ CPU latent (MLA) attention kernel against the jax.numpy reference under XLA, in the same run, on
DeepSeek-V2-Lite's attention shape (16 heads, entries of 576 lanes: halves of 288) in bfloat16: decode steps of
1 and 8 sequences and a 64-token prefill chunk, over a context of --context tokens in 16-token pages.

    .venv/bin/python -m bench.latent_attention_cpu --context 1024

Prints one JSON line per case: median milliseconds per call of each and the reference / kernel ratio.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.paged_attention import cpu_latent, latent_reference


def case(rng, *, sequences, new_tokens, query_block, context, heads, half, page_size, dtype):
    pages_per_seq = -(-context // page_size)
    num_pages = 1 + sequences * pages_per_seq
    page_table = rng.permutation(np.arange(1, num_pages)).reshape(sequences, pages_per_seq).astype(np.int32)
    pools = [jnp.asarray(rng.standard_normal((num_pages, page_size, 1, half)), dtype) for _ in range(2)]
    positions = np.concatenate([np.arange(context - new_tokens, context) for _ in range(sequences)])
    seq_ids = np.repeat(np.arange(sequences), new_tokens)
    q = jnp.asarray(rng.standard_normal((len(positions), heads, 2 * half)), dtype)
    return (q, *pools, jnp.asarray(page_table), jnp.asarray(seq_ids, jnp.int32), jnp.asarray(positions, jnp.int32))


def median_ms(fn, args, repeats):
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    shapes = {"decode x1": (1, 1, 1), "decode x8": (8, 1, 1), "prefill chunk 64": (1, 64, 16)}
    for name, (sequences, new_tokens, query_block) in shapes.items():
        arrays = case(
            rng,
            sequences=sequences,
            new_tokens=new_tokens,
            query_block=query_block,
            context=args.context,
            heads=16,
            half=288,
            page_size=16,
            dtype=jnp.bfloat16,
        )
        timings = {}
        for label, module in (("reference", latent_reference), ("cpu", cpu_latent)):
            fn = jax.jit(module.ragged_paged_latent_attention, static_argnames=("query_block", "scale"))
            call = lambda *a, fn=fn, query_block=query_block: fn(*a, query_block=query_block, scale=0.07)  # noqa: E731
            timings[label] = median_ms(call, arrays, args.repeats)
        result = {"case": name, "context": args.context, "dtype": "bfloat16", "heads": 16, "entry_lanes": 576}
        result |= {f"{k}_ms": round(v, 3) for k, v in timings.items()}
        result["reference_over_cpu"] = round(timings["reference"] / timings["cpu"], 2)
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
