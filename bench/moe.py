"""The mixture-of-experts layer: expert parallelism across 8 fake CPU devices against one device.

For EP = 1, 2, 4, 8 it checks the all-to-all layer (sharding/moe.py) against dense math and times it, with 8
experts and with Qwen2-MoE's 60 (which do not divide 8 devices: padded to 64 rows, four devices holding 7),
then times the whole engine on small Mixtrals: 8 experts at EP = 1, 2, 4 and 6 experts at EP = 1, 4 (uneven:
2, 2, 1, 1 per device), with data-parallel attention. On a CPU the fake devices share two cores, so these
numbers show overhead, not speedup. Prints JSON lines.

    .venv/bin/python bench/moe.py
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # before JAX starts

import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from timing import best_time  # noqa: E402

from jaxserve.models.moe import route  # noqa: E402
from sharding import build_mesh  # noqa: E402
from sharding.moe import expert_parallel_moe, place_experts, store_experts  # noqa: E402

NOTE = "fake CPU devices share the machine's cores: these times show overhead, not speedup"


def emit(**record) -> None:
    print(json.dumps(record), flush=True)


def dense_moe(x, router, gate, up, down, top_k):
    weights, experts = jax.lax.top_k(jax.nn.softmax(x @ router, axis=-1), top_k)
    weights = weights / weights.sum(-1, keepdims=True)
    hidden = jax.nn.silu(jnp.einsum("te,xef->txf", x, gate)) * jnp.einsum("te,xef->txf", x, up)
    every = jnp.einsum("txf,xfe->txe", hidden, down)
    return (jnp.take_along_axis(every, experts[:, :, None], axis=1) * weights[:, :, None]).sum(1)


def layer_bench(rng, tokens=512, embed=256, mlp=512, num_experts=8, top_k=2) -> None:
    x = jnp.asarray(rng.standard_normal((tokens, embed)), jnp.float32)
    router = jnp.asarray(rng.standard_normal((embed, num_experts)), jnp.float32)
    gate, up = (jnp.asarray(rng.standard_normal((num_experts, embed, mlp)) * 0.05, jnp.float32) for _ in range(2))
    down = jnp.asarray(rng.standard_normal((num_experts, mlp, embed)) * 0.05, jnp.float32)
    reference = jax.jit(dense_moe, static_argnums=5)
    expected = reference(x, router, gate, up, down, top_k)
    emit(
        bench="moe_layer",
        ep=1,
        num_experts=num_experts,
        impl="every expert on every token, one device",
        note=NOTE,
        ms=round(best_time(reference, x, router, gate, up, down, top_k) * 1e3, 2),
    )
    for ep in (2, 4, 8):
        mesh = build_mesh(data_parallel_size=ep, devices=jax.devices()[:ep])
        device_of, slot_of, order = place_experts(None, num_experts, ep)
        layer = jax.jit(
            lambda x, router, *rest, mesh=mesh: expert_parallel_moe(
                x, *route(x @ router, top_k), *rest, mesh=mesh, axis="data"
            )
        )
        args = (x, router, *(store_experts(w, order) for w in (gate, up, down)), device_of, slot_of)
        error = float(jnp.abs(layer(*args) - expected).max())
        emit(
            bench="moe_layer",
            ep=ep,
            num_experts=num_experts,
            stored_rows=len(order),
            impl="all-to-all, grouped matmuls",
            ms=round(best_time(layer, *args) * 1e3, 2),
            max_error_vs_single_device=error,
        )


def engine_bench(fixture: str, eps: tuple[int, ...]) -> None:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from jaxserve import LLM, SamplingParams
    from tests.support.fixtures import SMALL_ENGINE, fixture_dir

    rng = np.random.default_rng(0)
    prompts = [[1] + rng.integers(3, 384, size=int(n)).tolist() for n in rng.integers(8, 60, size=16)]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    baseline = None
    for ep in eps:
        llm = LLM(
            fixture_dir(fixture),
            **{
                **SMALL_ENGINE,
                "data_parallel_size": ep,
                "enable_prefix_caching": False,
                "enable_expert_parallel": ep > 1,
            },
        )
        llm.generate(prompts[:2], SamplingParams(max_tokens=2, ignore_eos=True))
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        seconds = time.perf_counter() - start
        tokens = [o.outputs[0].token_ids for o in outputs]
        baseline = baseline or tokens
        emit(
            bench="moe_engine",
            fixture=fixture,
            data_parallel_size=ep,
            expert_parallel=ep > 1,
            output_tokens_per_s=round(16 * 32 / seconds, 1),
            same_outputs_as_one_device=tokens == baseline,
            device_imbalance=llm.stats().get("expert_device_imbalance"),
            note=NOTE,
        )
        if ep > 1:  # place experts by the load just routed, then serve the same workload again
            before = llm.stats()
            llm.rebalance_experts()
            outputs = llm.generate(prompts, params)
            devices = np.asarray(llm.stats()["expert_devices"])
            rerun = np.asarray(llm.stats()["expert_tokens"]) - np.asarray(before["expert_tokens"])
            per_layer = np.stack([np.bincount(d, weights=t, minlength=ep) for d, t in zip(devices, rerun)])
            emit(
                bench="moe_engine_rebalanced",
                fixture=fixture,
                data_parallel_size=ep,
                device_tokens_before=before["expert_device_tokens"],
                device_tokens_after=per_layer.sum(0).astype(int).tolist(),
                device_imbalance_before=before["expert_device_imbalance"],
                device_imbalance_after=round(per_layer.max(1).sum() / per_layer.mean(1).sum(), 4),
                same_outputs_as_one_device=[o.outputs[0].token_ids for o in outputs] == baseline,
                compiles_after_warmup=llm.stats()["num_compiles_after_warmup"],
            )


if __name__ == "__main__":
    layer_bench(np.random.default_rng(0))
    layer_bench(np.random.default_rng(0), mlp=128, num_experts=60, top_k=4)
    engine_bench("mixtral_8x", (1, 2, 4))
    engine_bench("mixtral_6x", (1, 4))
