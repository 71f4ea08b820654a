"""DeepSeek memory figures: a DeepSeek-V2-Lite-shaped random model placed on EP=8 fake CPU devices, and the KV
bytes per token of the latent cache against full per-head K/V.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \\
        .venv/bin/python -m bench.deepseek_memory --layers 2

The params are built and placed as the engine places them (build_model with the expert-parallel dispatch,
param_shardings with EXPERT_PARALLEL_RULES on a data-parallel mesh of 8), each initialized on its own shards
(bfloat16 constants, no checkpoint on disk); the script reports, per device, the bytes of routed-expert weights,
of attention weights and of everything it holds. `--layers` keeps V2-Lite's widths (27 layers on the Hub) but
fewer layers, so it fits a small machine; the fractions do not depend on it. KV bytes per token are the
engine's own (ModelConfig.kv_cache_head_dim, two pools per layer) for V2-Lite's and V3's full configs.
Prints one JSON line per figure.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.models import ModelConfig, build_model
from pallas_kernels.matmul import REFERENCE_PLAN
from sharding import build_mesh, param_shardings
from sharding.attention import attention_dispatch
from sharding.moe import expert_dispatch
from sharding.rules import EXPERT_PARALLEL_RULES
from tests.models.test_deepseek import DEEPSEEK_V2_LITE, DEEPSEEK_V3


def kv_bytes_per_token(config: ModelConfig, itemsize: int = 2) -> dict:
    latent = config.num_layers * 2 * config.kv_cache_head_dim * itemsize  # the engine's two pools per layer
    full = config.num_layers * config.num_heads * (config.head_dim + config.v_head_dim) * itemsize
    return {"model": config.model_type, "latent_bytes_per_token": latent, "full_kv_bytes_per_token": full}


def placed_params(config: ModelConfig, mesh):
    """The model's params, each created on its own shards of `mesh` as the engine would place them."""
    experts = expert_dispatch(mesh)

    def make():
        return build_model(
            config,
            jnp.bfloat16,
            write_and_attend=attention_dispatch("reference", mesh),
            matmul=REFERENCE_PLAN,
            experts=experts,
            rngs=nnx.Rngs(0),
        )

    abstract = nnx.eval_shape(make)
    _, abstract_params, _ = nnx.split(abstract, nnx.Param, ...)
    shardings = param_shardings(abstract_params, mesh, config.logical_axis_sizes(), EXPERT_PARALLEL_RULES)
    placed = {}
    for path, variable in nnx.to_flat_state(abstract_params):
        shape = variable.get_value().shape
        # a constant: each device makes only its own shards (random bits would be drawn whole on every device)
        create = jax.jit(lambda value, shape=shape: jnp.full(shape, value, jnp.bfloat16), out_shardings=shardings[path])
        placed[".".join(map(str, path))] = create(0.02)
    return placed


def bytes_on(arrays, device) -> int:
    return sum(s.data.nbytes for array in arrays for s in array.addressable_shards if s.device == device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=2, help="V2-Lite has 27; the first is dense")
    parser.add_argument("--devices", type=int, default=8)
    args = parser.parse_args()
    config = ModelConfig.from_hf_dict({**DEEPSEEK_V2_LITE, "num_hidden_layers": args.layers})
    mesh = build_mesh(data_parallel_size=args.devices, devices=jax.devices()[: args.devices])
    params = placed_params(config, mesh)
    groups = {
        "routed_experts": [a for n, a in params.items() if n.split(".")[-1] in ("gate_proj", "up_proj", "down_proj")],
        "attention": [a for n, a in params.items() if ".self_attn." in n],
        "all": list(params.values()),
    }
    for group, arrays in groups.items():
        total = sum(a.nbytes for a in arrays)
        per_device = [bytes_on(arrays, device) for device in mesh.devices.flat]
        print(
            json.dumps(
                {
                    "figure": f"v2_lite_ep{args.devices}_{group}",
                    "layers": args.layers,
                    "total_bytes": total,
                    "per_device_bytes": per_device,
                    "device0_fraction": round(per_device[0] / total, 4),
                }
            )
        )
    for hf in (DEEPSEEK_V2_LITE, DEEPSEEK_V3):
        print(json.dumps({"figure": "kv_bytes_per_token_bf16", **kv_bytes_per_token(ModelConfig.from_hf_dict(hf))}))


if __name__ == "__main__":
    main()
