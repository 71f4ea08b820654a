"""Run by test_sharding.py with 8 fake CPU devices: the expert-parallel MoE layer against dense math, with
expert counts that divide the devices and counts that do not (padded, some devices holding one more)."""

import jax
import jax.numpy as jnp
import numpy as np

from sharding import build_mesh
from sharding.moe import LocalExperts, expert_parallel_moe, place_experts, store_experts
from tests.support.fake_devices import report_and_exit


def dense_moe(x, router, gate, up, down, top_k):
    probs = jax.nn.softmax(x @ router, axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    weights = weights / weights.sum(-1, keepdims=True)
    every = jnp.einsum("td,xdf->txf", x, gate)
    every = jax.nn.silu(every) * jnp.einsum("td,xdf->txf", x, up)
    every = jnp.einsum("txf,xfd->txd", every, down)  # [T, X, E]
    chosen = jnp.take_along_axis(every, experts[:, :, None], axis=1)
    return (chosen * weights[:, :, None]).sum(1), weights, experts


def run(case, num_devices, rng, num_experts=16, top_k=2, tokens=64, embed=32, mlp=48):
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
    layer = jax.jit(lambda *args: expert_parallel_moe(*args, mesh=mesh, axis="data"))
    for placement in ("blocks", "balanced"):
        device_of, slot_of, order = place_experts(None if placement == "blocks" else load, num_experts, num_devices)
        stored = [store_experts(w, order) for w in (gate, up, down)]
        got = layer(x, weights, experts, *stored, device_of, slot_of)
        device_load = np.bincount(np.asarray(device_of), weights=load, minlength=num_devices)
        padding = np.asarray(order) < 0
        results[placement] = {
            "max_error": float(jnp.abs(got - expected).max()),
            "imbalance": float(device_load.max() / device_load.mean()),
            "experts_per_device": np.bincount(np.asarray(device_of), minlength=num_devices).tolist(),
            "stored_rows": len(order),
            "padding_rows_zero": bool(all(not np.asarray(w)[padding].any() for w in stored)),
            "devices_holding_expert_weights": len(
                jax.device_put(
                    stored[0], jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
                ).sharding.device_set
            ),
        }
    results["empty_experts"] = int((load == 0).sum())
    return results


rng = np.random.default_rng(0)
# case:devices[:experts]: 16 experts unless named; 16 on 3, 6 on 4, 60 on 8 and 6 on 8 do not divide
report = {f"{case}:{d}": run(case, d, rng) for case in ("random", "skewed") for d in (2, 8)}
for devices, num_experts in ((3, 16), (4, 6), (8, 60), (8, 6)):
    report[f"random:{devices}:{num_experts}"] = run("random", devices, rng, num_experts=num_experts)
report["skewed:4:6"] = run("skewed", 4, rng, num_experts=6)
mesh = build_mesh(data_parallel_size=3, devices=jax.devices()[:3])
try:  # weights not padded to the stored rows
    expert_parallel_moe(
        jnp.zeros((6, 4)),
        jnp.ones((6, 1)),
        jnp.zeros((6, 1), jnp.int32),
        *(jnp.zeros((16, 4, 4)),) * 3,
        *place_experts(None, 16, 3)[:2],
        mesh=mesh,
        axis="data",
    )
    report["unpadded_error"] = None
except ValueError as error:
    report["unpadded_error"] = str(error)
report_and_exit(report)
