"""Run by test_sharding.py with 8 fake CPU devices: the expert-parallel MoE layer against dense math."""

import json

import jax
import jax.numpy as jnp
import numpy as np

from sharding import build_mesh
from sharding.moe import LocalExperts, expert_parallel_moe, place_experts


def dense_moe(x, router, gate, up, down, top_k):
    probs = jax.nn.softmax(x @ router, axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    weights = weights / weights.sum(-1, keepdims=True)
    every = jnp.einsum("td,xdf->txf", x, gate)
    every = jax.nn.silu(every) * jnp.einsum("td,xdf->txf", x, up)
    every = jnp.einsum("txf,xfd->txd", every, down)  # [T, X, E]
    chosen = jnp.take_along_axis(every, experts[:, :, None], axis=1)
    return (chosen * weights[:, :, None]).sum(1), weights, experts


def run(case, num_devices, rng, top_k=2, num_experts=16, tokens=64, embed=32, mlp=48):
    mesh = build_mesh(data_parallel_size=num_devices, devices=jax.devices()[:num_devices])
    x = jnp.asarray(rng.standard_normal((tokens, embed)), jnp.float32)
    router = jnp.asarray(rng.standard_normal((embed, num_experts)), jnp.float32)
    if case == "skewed":  # every token prefers experts 0 and 1: all other experts (and devices) get nothing
        router = router * 0.01
        router = router.at[:, 0].add(5.0 * jnp.sign(x.mean(0))).at[:, 1].add(4.0 * jnp.sign(x.mean(0)))
        x = jnp.abs(x) * jnp.sign(x.mean(0))
    gate, up = (jnp.asarray(rng.standard_normal((num_experts, embed, mlp)) * 0.2, jnp.float32) for _ in range(2))
    down = jnp.asarray(rng.standard_normal((num_experts, mlp, embed)) * 0.2, jnp.float32)
    expected, weights, experts = dense_moe(x, router, gate, up, down, top_k)
    load = np.bincount(np.asarray(experts).reshape(-1), minlength=num_experts)
    local = LocalExperts()(x, weights, experts, gate, up, down, (), activation=jax.nn.silu)
    results = {"local_max_error": float(jnp.abs(local - expected).max())}
    for placement in ("blocks", "balanced"):
        device_of, slot_of, order = place_experts(None if placement == "blocks" else load, num_experts, num_devices)
        got = expert_parallel_moe(x, weights, experts, gate[order], up[order], down[order], device_of, slot_of,
                                  mesh=mesh, axis="data")
        device_load = np.bincount(np.asarray(device_of), weights=load, minlength=num_devices)
        results[placement] = {"max_error": float(jnp.abs(got - expected).max()),
                              "imbalance": float(device_load.max() / device_load.mean()),
                              "experts_per_device": np.bincount(np.asarray(device_of)).tolist(),
                              "devices_holding_expert_weights": len(jax.device_put(
                                  gate[order], jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
                              ).sharding.device_set)}
    results["empty_experts"] = int((load == 0).sum())
    return results


rng = np.random.default_rng(0)
report = {f"{case}:{d}": run(case, d, rng) for case in ("random", "skewed") for d in (2, 8)}
try:
    run("random", 3, rng)
    report["indivisible_error"] = None
except ValueError as error:
    report["indivisible_error"] = str(error)
print(json.dumps(report))
