"""Quantized weights at load: which params are quantized, how a float tensor becomes a QuantizedWeight (one
tensor at a time, on the host), and where each of its arrays is placed.

    mark_quantized(abstract, spec)   at build time: each projection kernel's abstract param gets a
                                      `quantization` metadata entry (the spec); shapes stay the float ones,
                                      so the sharding rules place it by its logical axes as before
    load_quantized(...)              called by loading.weights.read_params for a marked param: the reader's
                                      own quantized blocks where it holds them (GGUF, gguf_blocks.py), else
                                      the float tensor quantized here; then each array placed

Formats (`model.quantization`): none; int8 (symmetric, one scale per output channel); int4 (symmetric
groups of `quantization_group_size` along K, llama.cpp's Q4_0 rounding); auto (what the checkpoint holds:
a GGUF file's quantized blocks stay quantized, float tensors stay float).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import jax
import numpy as np
from flax import nnx

from jaxserve.config import INT4_GROUP_SIZES
from jaxserve.device.placement import put_on
from pallas_kernels.matmul.kquant import KQuantWeight
from pallas_kernels.matmul.quantized import QuantizedWeight, place_shardings

logger = logging.getLogger(__name__)

FORMATS = ("none", "int8", "int4", "auto")
EMBEDDING_FORMATS = ("same", "int8")  # quantization_embedding: the vocabulary tensors under int4
SPEC_BITS = {"int8": 8, "int4": 4}  # a stored layout of these bits serves the format as it is
# Kernels that stay float: MoE routers (a handful of columns whose exact scores pick the experts, as
# llama.cpp keeps ffn_gate_inp), the shared expert's one-column gate, and MLA's kv_b_proj, which attention
# reads in place as [rank, heads, dims] to absorb it into the query and output (models/mla.py), not as a
# projection.
UNQUANTIZED_MODULES = ("gate", "shared_expert_gate", "kv_b_proj")


@dataclass(frozen=True)
class QuantizationSpec:
    """How the engine quantizes the projections' weights."""

    format: str = "none"  # one of FORMATS
    group_size: int = 32  # int4: rows of K per scale
    # int4 only: the token embedding and the head ([V, E] each; the tied one is both) at int8, as llama.cpp's
    # Q4_0 files keep them at 6-8 bits (they weigh most in quality per byte); "same": int4 like the rest
    embedding: str = "same"

    def __post_init__(self):
        if self.format not in FORMATS:
            raise ValueError(f"unknown quantization {self.format!r} (option quantization); known: {list(FORMATS)}")
        if self.format == "int4" and self.group_size not in INT4_GROUP_SIZES:
            raise ValueError(
                f"quantization_group_size must be one of {list(INT4_GROUP_SIZES)} for int4, got {self.group_size}"
            )
        if self.embedding not in EMBEDDING_FORMATS:
            raise ValueError(f"unknown quantization_embedding {self.embedding!r}; known: {list(EMBEDDING_FORMATS)}")


EMBEDDING = ("embed_tokens", "embedding")  # [V, E]: quantized, it is stored [E, V], as the tied head it may be
# A mixture-of-experts layer's stacked expert weights, [X, K, N] each (models/moe.py): quantized expert by
# expert, read by the grouped expert matmul (pallas_kernels/matmul/quantized_experts.py). Biases stay float.
EXPERT_WEIGHTS = ("gate_proj", "up_proj", "down_proj")


def is_projection_kernel(path: tuple[str, ...], shape: tuple[int, ...]) -> bool:
    """Whether the param at `path` is a projection's [K, N] kernel that quantization applies to."""
    return path[-1] == "kernel" and len(shape) == 2 and (len(path) < 2 or path[-2] not in UNQUANTIZED_MODULES)


def is_expert_weight(path: tuple[str, ...], shape: tuple[int, ...]) -> bool:
    """A mixture-of-experts layer's stacked [X, K, N] expert weight."""
    return len(shape) == 3 and path[-1] in EXPERT_WEIGHTS


def is_quantizable(path: tuple[str, ...], shape: tuple[int, ...]) -> bool:
    """A projection kernel, the stacked expert weights, or the token embedding (a lookup, and the head where
    it is tied)."""
    return (
        is_projection_kernel(path, shape)
        or is_expert_weight(path, shape)
        or (tuple(path[-2:]) == EMBEDDING and len(shape) == 2)
    )


def stored_shape(path: tuple[str, ...], shape: tuple[int, ...]) -> tuple[int, ...]:
    """The [K, N] a quantized param is stored as: the embedding [V, E] transposed, a kernel as it is."""
    return shape[::-1] if tuple(path[-2:]) == EMBEDDING else shape


def mark_quantized(abstract_state: nnx.State, spec: QuantizationSpec) -> nnx.State:
    """The abstract params with each projection kernel marked for quantization (metadata `quantization`),
    after checking that every such kernel's K takes the spec's groups."""
    if spec.format == "none":
        return abstract_state
    marked = []
    for path, variable in nnx.to_flat_state(abstract_state):
        shape = tuple(variable.get_value().shape)
        names = tuple(str(p) for p in path)
        if is_quantizable(names, shape):
            param_spec = spec_for(names, spec)
            check_groups(names, stored_shape(names, shape), param_spec)
            variable = variable.replace(variable.get_value(), quantization=param_spec)
        marked.append((path, variable))
    return nnx.from_flat_state(marked)


HEAD = ("lm_head", "kernel")


def spec_for(path: tuple[str, ...], spec: QuantizationSpec) -> QuantizationSpec:
    """The spec one param is quantized by: int8 for the embedding and the head where quantization_embedding
    asks it of int4, else the engine's."""
    vocabulary = tuple(path[-2:]) in (EMBEDDING, HEAD)
    if vocabulary and spec.format == "int4" and spec.embedding == "int8":
        return dataclasses.replace(spec, format="int8")
    return spec


def check_groups(path: tuple[str, ...], shape: tuple[int, ...], spec: QuantizationSpec) -> None:
    """shape: the stored [..., K, N]."""
    depth = shape[-2]
    if spec.format == "int4" and depth % spec.group_size:
        dividing = [size for size in INT4_GROUP_SIZES if depth % size == 0]
        remedy = f"quantization_group_size {dividing[0]} divides it" if dividing else "int4 cannot take it: use int8"
        raise ValueError(
            f"cannot quantize {'.'.join(path)} {list(shape)} to int4: K = {depth} is not a "
            f"multiple of quantization_group_size {spec.group_size} ({remedy})"
        )


def quantize_int8(weight: np.ndarray, compute_dtype: str) -> QuantizedWeight:
    """weight [K, N] float -> int8 with one float32 scale per output column (absmax / 127)."""
    w = np.asarray(weight, np.float32)
    absmax = np.max(np.abs(w), axis=0, keepdims=True)  # [1, N]
    scales = np.where(absmax > 0, absmax / 127.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(w / scales), -127, 127).astype(np.int8)
    return QuantizedWeight(q, scales, None, bits=8, group_size=w.shape[0], compute_dtype=compute_dtype)


def quantize_int4(weight: np.ndarray, group_size: int, compute_dtype: str) -> QuantizedWeight:
    """weight [K, N] float -> 4-bit groups of `group_size` along K with float16 scales, as llama.cpp's Q4_0:
    the group's value of largest magnitude maps to -8, so all sixteen levels are used."""
    w = np.asarray(weight, np.float32)
    depth, columns = w.shape
    grouped = w.reshape(depth // group_size, group_size, columns)
    extreme = np.take_along_axis(grouped, np.argmax(np.abs(grouped), axis=1)[:, None, :], axis=1)[:, 0, :]
    d = (extreme / np.float32(-8.0)).astype(np.float32)  # [G, N]
    inverse = np.divide(np.float32(1.0), d, out=np.zeros_like(d), where=d != 0)
    # llama.cpp's rounding, to the bit: from the float32 d, truncating x / d + 8.5
    q = np.clip(np.trunc(grouped * inverse[:, None, :] + np.float32(8.5)), 0, 15).astype(np.uint8)
    q = q.reshape(depth, columns)
    scales = d.astype(np.float16)
    return QuantizedWeight(pack_nibbles(q), scales, None, bits=4, group_size=group_size, compute_dtype=compute_dtype)


def pack_nibbles(q: np.ndarray) -> np.ndarray:
    """q [..., K, N] uint8 in 0..15 -> [..., K / 2, N]: rows 2i in the low nibble, 2i + 1 in the high."""
    return (q[..., 0::2, :] | (q[..., 1::2, :] << 4)).astype(np.uint8)


# Bytes of float32 input quantized at a time: each chunk's temporaries (several float32 copies) stay small
# beside the tensor, so loading holds the tensor once plus its quantized form (bench: peak load memory).
CHUNK_BYTES = 4 << 20


def quantize(weight: np.ndarray, spec: QuantizationSpec, compute_dtype: str) -> QuantizedWeight:
    """weight [K, N], or stacked experts [X, K, N] (each quantized on its own) -> its QuantizedWeight."""
    if weight.ndim == 2:
        return _quantize_matrix(weight, spec, compute_dtype)
    return stack([_quantize_matrix(np.asarray(matrix), spec, compute_dtype) for matrix in weight])


def stack(weights: list[QuantizedWeight]) -> QuantizedWeight:
    """[K, N] QuantizedWeights of one layout -> the [X, K, N] one, each array stacked along a new first axis."""
    first = weights[0]

    def stacked(leaf: str):
        arrays = [getattr(weight, leaf) for weight in weights]
        return None if arrays[0] is None else np.stack(arrays)

    return dataclasses.replace(first, values=stacked("values"), scales=stacked("scales"), mins=stacked("mins"))


def _quantize_matrix(weight: np.ndarray, spec: QuantizationSpec, compute_dtype: str) -> QuantizedWeight:
    """weight [K, N] -> its QuantizedWeight, computed in chunks of columns (columns quantize independently)
    written into arrays allocated once (no second copy of the result while joining chunks)."""
    depth, columns = weight.shape
    step = max(16, CHUNK_BYTES // (4 * depth))
    result: dict[str, np.ndarray | None] = {}
    first = None
    for start in range(0, columns, step):
        chunk = weight[:, start : start + step]
        if spec.format == "int8":
            part = quantize_int8(chunk, compute_dtype)
        else:
            part = quantize_int4(chunk, spec.group_size, compute_dtype)
        if first is None:
            if step >= columns:
                return part
            first = part
            for leaf in ("values", "scales", "mins"):
                array = getattr(part, leaf)
                result[leaf] = None if array is None else np.empty((*array.shape[:-1], columns), array.dtype)
        for leaf, array in result.items():
            if array is not None:
                array[..., start : start + step] = getattr(part, leaf)
    assert first is not None, "a weight has columns"
    return dataclasses.replace(first, **result)


def load_quantized(reader, read_param, path: tuple[str, ...], shape: tuple[int, ...], spec, dtype, sharding):
    """The value of a param marked for quantization: the reader's quantized blocks where it holds this
    tensor quantized with as many bits as the spec asks (auto: any), else the tensor quantized by the spec
    (auto: left float): blocks of other bits re-quantized chunk by chunk, a float tensor quantized whole.
    Returns a placed QuantizedWeight, or None for the caller's float path."""
    from jaxserve.loading.quantize_gguf import layout_bits, mapped_blocks, requantized

    compute_dtype = str(np.dtype(dtype)) if not isinstance(dtype, str) else dtype
    as_stored = stored_shape(path, shape)
    transposed = as_stored != shape
    # a GGUF file's blocks, through the family's own name mapping (any family: no list of them)
    blocks = mapped_blocks(reader, read_param, path, shape, transposed)
    if blocks is not None and spec.format in SPEC_BITS and layout_bits(blocks) != SPEC_BITS[spec.format]:
        # e.g. int8 asked of a Q4_1 file: re-quantized from the dequantized values, a chunk of rows at a time
        stored = requantized(blocks, lambda matrix: _quantize_matrix(matrix, spec, compute_dtype))
    elif blocks is not None:
        stored = blocks.quantized(compute_dtype)
    elif spec.format == "auto":
        return None
    else:
        tensor = read_param(reader, path, shape)
        if tuple(tensor.shape) != shape:
            raise ValueError(
                f"checkpoint tensor for {'.'.join(path)} has shape {tuple(tensor.shape)}, the model's config implies {shape}"
            )
        stored = quantize(np.asarray(tensor).T if transposed else np.asarray(tensor), spec, compute_dtype)
        del tensor
    if tuple(stored.shape) != as_stored:
        raise ValueError(
            f"checkpoint tensor for {'.'.join(path)} has shape {stored.shape}, the model's config implies {shape}"
        )
    return place(stored, sharding, stored_transposed=transposed)


def place(weight: QuantizedWeight | KQuantWeight, sharding, stored_transposed: bool = False):
    """Each of the weight's arrays on the device(s) place_shardings gives them; without a sharding, on the
    default device uncommitted, as the float params are."""
    if sharding is None:
        return jax.tree.map(jax.numpy.asarray, weight)
    return jax.tree.map(put_on, weight, place_shardings(weight, sharding, stored_transposed))


__all__ = [
    "EMBEDDING_FORMATS",
    "FORMATS",
    "QuantizationSpec",
    "is_expert_weight",
    "is_projection_kernel",
    "is_quantizable",
    "load_quantized",
    "mark_quantized",
    "pack_nibbles",
    "place",
    "place_shardings",
    "quantize",
    "quantize_int4",
    "quantize_int8",
    "spec_for",
    "stack",
]
