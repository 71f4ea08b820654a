"""Hugging Face safetensors checkpoints -> the params of a jaxserve model.

The model is first built abstractly (shapes only); every param is then read from the checkpoint by
a name derived from its nnx path, transposed where torch stores [out, in], cast, and checked.
"""

from __future__ import annotations

import glob
import json
import os

import jax
import jax.numpy as jnp
from flax import nnx
from safetensors import SafetensorError, safe_open

from jaxserve.config import ModelConfig

# Mixtral experts, by our param name: (legacy per-expert tensor name, slice of the fused gate_up_proj).
EXPERT_PARAMS = {"gate_proj": ("w1", 0), "up_proj": ("w3", 1), "down_proj": ("w2", None)}


class CheckpointReader:
    """Lazily reads named tensors from one or many safetensors files."""

    def __init__(self, model_dir: str):
        index_path = os.path.join(model_dir, "model.safetensors.index.json")
        if os.path.isfile(index_path):
            try:
                with open(index_path) as f:
                    weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as error:
                raise ValueError(f"malformed checkpoint index {index_path}: {error!r}") from None
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(model_dir, "*.safetensors")))
            weight_map = None
        if not files:
            raise ValueError(f"no *.safetensors checkpoint files in {model_dir!r}")
        self.location = {}
        for name in files:
            path = os.path.join(model_dir, name)
            if not os.path.isfile(path):
                raise ValueError(f"checkpoint file {path} listed in the index is missing")
            try:
                with safe_open(path, framework="flax") as f:
                    for key in f.keys():
                        self.location[key] = path
            except (SafetensorError, OSError, ValueError) as error:
                raise ValueError(f"malformed checkpoint file {path}: {error}") from None
        if weight_map is not None:
            missing = [key for key, name in weight_map.items() if key not in self.location]
            if missing:
                raise ValueError(f"checkpoint index lists tensors not found in the files: {missing[:5]}")

    def __contains__(self, key: str) -> bool:
        return key in self.location

    def read(self, key: str) -> jax.Array:
        if key not in self.location:
            raise ValueError(f"checkpoint is missing tensor {key!r}")
        try:
            with safe_open(self.location[key], framework="flax") as f:
                return f.get_tensor(key)
        except (SafetensorError, OSError, ValueError) as error:
            raise ValueError(f"cannot read tensor {key!r} from {self.location[key]}: {error}") from None


def _read_expert_param(reader: CheckpointReader, layer: int, name: str, num_experts: int) -> jax.Array:
    legacy_name, fused_half = EXPERT_PARAMS[name]
    legacy = f"model.layers.{layer}.block_sparse_moe.experts.{{}}.{legacy_name}.weight"
    if legacy.format(0) in reader:
        return jnp.stack([reader.read(legacy.format(e)).T for e in range(num_experts)])
    # transformers >= 5 in-memory layout: gate_up_proj [X, 2F, E], down_proj [X, E, F].
    prefix = f"model.layers.{layer}.mlp.experts."
    if fused_half is None:
        return jnp.swapaxes(reader.read(prefix + "down_proj"), 1, 2)
    gate_up = reader.read(prefix + "gate_up_proj")
    half = gate_up.shape[1] // 2
    return jnp.swapaxes(gate_up[:, fused_half * half:(fused_half + 1) * half, :], 1, 2)


def _read_param(reader: CheckpointReader, config: ModelConfig, path: tuple) -> jax.Array:
    names = [str(p) for p in path]
    if names[0] == "lm_head":
        return reader.read("lm_head.weight").T
    if names[0] == "layers" and names[2] == "mlp" and config.is_moe:
        layer = int(names[1])
        if names[3] == "gate":  # the router
            key = f"model.layers.{layer}.block_sparse_moe.gate.weight"
            return reader.read(key if key in reader else f"model.layers.{layer}.mlp.gate.weight").T
        return _read_expert_param(reader, layer, names[3], config.num_experts)
    leaf = names[-1]
    key = "model." + ".".join(names[:-1]) + "." + {"kernel": "weight", "embedding": "weight"}.get(leaf, leaf)
    tensor = reader.read(key)
    return tensor.T if leaf == "kernel" else tensor


def load_params(abstract_state: nnx.State, model_dir: str, config: ModelConfig, dtype,
                placement=lambda path: None) -> nnx.State:
    """Fill an abstract (shape-only) model state from the checkpoint in model_dir.

    placement(path) gives each param's sharding; each tensor is placed as soon as it is read, so the
    full model is never gathered on one device.
    """
    reader = CheckpointReader(model_dir)
    loaded = []
    for path, variable in nnx.to_flat_state(abstract_state):
        expected = variable.get_value()
        tensor = _read_param(reader, config, path)
        if tuple(tensor.shape) != tuple(expected.shape):
            raise ValueError(
                f"checkpoint tensor for {'.'.join(map(str, path))} has shape {tuple(tensor.shape)}, "
                f"config.json implies {tuple(expected.shape)}")
        value = jnp.asarray(tensor, dtype=dtype)
        sharding = placement(path)
        loaded.append((path, variable.replace(value if sharding is None else jax.device_put(value, sharding))))
    return nnx.from_flat_state(loaded)
