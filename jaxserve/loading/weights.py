"""Hugging Face safetensors checkpoints -> the params of a jaxserve model.

The model is first built abstractly (shapes only); every param is then read through its family's
name mapping (jaxserve/models/llama.py, mixtral.py, ...), which names the checkpoint tensor(s) for
its nnx path and lays them out as ours; here each is cast, checked against the expected shape and
placed.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import json
import os
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open

from jaxserve.device.placement import put_on
from jaxserve.loading.multimodal import language_model_aliases
from jaxserve.loading.quantize import load_quantized
from jaxserve.models import CHECKPOINT_NAMES, ModelConfig


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
                with safe_open(path, framework="numpy") as f:
                    for key in f.keys():
                        self.location[key] = path
            except (SafetensorError, OSError, ValueError) as error:
                raise ValueError(f"malformed checkpoint file {path}: {error}") from None
        if weight_map is not None:
            missing = [key for key, name in weight_map.items() if key not in self.location]
            if missing:
                raise ValueError(f"checkpoint index lists tensors not found in the files: {missing[:5]}")
        # a multimodal checkpoint's language model, under text-only names (Gemma 3's model.language_model.*)
        self.aliases = language_model_aliases(self.location, model_dir)

    def __contains__(self, key: str) -> bool:
        return key in self.location or key in self.aliases

    def read(self, key: str) -> np.ndarray:
        """A host (numpy) copy: converted to the served dtype on the host, no compilation per shape."""
        key = self.aliases.get(key, key)
        if key not in self.location:
            raise ValueError(f"checkpoint is missing tensor {key!r}")
        try:
            with safe_open(self.location[key], framework="numpy") as f:
                return f.get_tensor(key)
        except (SafetensorError, OSError, ValueError) as error:
            raise ValueError(f"cannot read tensor {key!r} from {self.location[key]}: {error}") from None


def read_params(
    abstract_state: nnx.State, reader, read_param: Callable, dtype, placement: Callable = lambda path: None
) -> nnx.State:
    """Fill an abstract (shape-only) model state from a reader (`name in reader`, `reader.read(name)`)
    through a family's name mapping (read_param(reader, path, shape), jaxserve.models.CHECKPOINT_NAMES).

    placement(path) gives each param's sharding; each tensor is placed as soon as it is read, so the
    full model is never gathered on one device.
    """
    loaded = []
    for path, variable in nnx.to_flat_state(abstract_state):
        expected = tuple(variable.get_value().shape)
        spec = variable.get_metadata("quantization", None)  # loading/quantize.py's mark_quantized
        if spec is not None:
            names = tuple(str(p) for p in path)
            weight = load_quantized(reader, read_param, names, expected, spec, dtype, placement(path))
            if weight is not None:
                loaded.append((path, variable.replace(weight)))
                release_freed_host_memory()
                continue
        tensor = read_param(reader, tuple(str(p) for p in path), expected)
        if tuple(tensor.shape) != expected:
            raise ValueError(
                f"checkpoint tensor for {'.'.join(map(str, path))} has shape {tuple(tensor.shape)}, "
                f"the model's config implies {expected}"
            )
        value = jnp.asarray(tensor, dtype=dtype)
        del tensor  # the host copy goes before the next tensor is read: one tensor in flight at a time
        sharding = placement(path)
        name = ".".join(map(str, path))
        loaded.append((path, variable.replace(value if sharding is None else put_on(value, sharding, name))))
        del value
        release_freed_host_memory()
    return nnx.from_flat_state(loaded)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc's; other C libraries lack it
    except (OSError, AttributeError):
        return None


def release_freed_host_memory() -> None:
    """Hand the C heap's free pages back to the OS. Each tensor's host copy is freed once placed, but glibc
    keeps such memory (between the params that stay) for reuse: over a whole model, 20-40% of the
    weights' size in resident memory that nothing uses (measured by bench/load_memory.py)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def load_params(
    abstract_state: nnx.State, model_dir: str, config: ModelConfig, dtype, placement: Callable = lambda path: None
) -> nnx.State:
    """The params of a Hugging Face safetensors checkpoint, by the tensor names of config's family."""
    return read_params(
        abstract_state, CheckpointReader(model_dir), CHECKPOINT_NAMES[config.model_type], dtype, placement
    )
