"""The C++ segmented multi-LoRA product (cpu_lora_matmul.cc, Punica's SGMV on the CPU): each row times its
own adapter's A and B only, each adapter present read once, rows without an adapter left alone. Built at
first use into the CPU kernels' one library (pallas_kernels/cpu_library.py); `path=` builds and calls
another instruction path's library beside it (tests, benches).

It serves lora.py's LoraMatmul on an engine with one CPU device; lora.py's masked XLA product stays the
form for every other backend and placement (a custom call XLA's partitioner cannot split: it must see the
whole slot arrays on one device).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import cpu_library

LORA = cpu_library.CustomCall("jaxserve_cpu_lora_matmul", "JaxserveLoraMatmul")
target, available = LORA.target, LORA.available
DTYPES = tuple(jnp.dtype(name) for name in ("float32", "bfloat16", "float16"))


def add_lora(rows, product, a, b, row_slots, *, path: str | None = None):
    """product [M, N] float32 plus, for each row m with slot s = row_slots[m] > 0, (rows[m] @ a[:, s]) @ b[s]
    (rows [M, K], a [K, L, r], b [L, r, N] in one float dtype; x @ A rounded to it before B, as lora.py's
    masked product does) -> float32 [M, N]. Slots outside [0, L) fail the call."""
    (num_rows, depth), (size_in, num_slots, rank), size_out = rows.shape, a.shape, b.shape[2]
    if jnp.dtype(a.dtype) not in DTYPES or rows.dtype != a.dtype or b.dtype != a.dtype:
        raise ValueError(
            f"the CPU LoRA product wants rows, A and B of one dtype among {[str(d) for d in DTYPES]}, got "
            f"{rows.dtype}, {a.dtype}, {b.dtype}"
        )
    if depth != size_in or b.shape[:2] != (num_slots, rank) or product.shape != (num_rows, size_out):
        raise ValueError(
            f"the CPU LoRA product wants rows [M, K], a [K, L, r], b [L, r, N], product [M, N]; got rows "
            f"{rows.shape}, a {a.shape}, b {b.shape}, product {product.shape}"
        )
    if row_slots.shape != (num_rows,):
        raise ValueError(f"one slot per row: rows {rows.shape}, row_slots {row_slots.shape}")
    if not available(path):
        raise RuntimeError("the CPU LoRA kernel could not be built; use lora.py's masked product")
    result = jax.ShapeDtypeStruct((num_rows, size_out), jnp.float32)
    call = jax.ffi.ffi_call(target(path), result, input_output_aliases={4: 0})  # added into the product in place
    return call(rows, a, b, row_slots.astype(jnp.int32), product.astype(jnp.float32))
