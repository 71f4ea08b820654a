"""Moving page bytes from a prefill engine to a decode engine in one process: gather the pages on the
prefill side's devices, jax.device_put them onto the decode side's sharding (another device set and
another mesh are fine), scatter them into the reserved pages."""

from __future__ import annotations

import jax


def check_same_layout(prefill_engine, decode_engine) -> None:
    """Pages are copied as they are stored: both caches must store the same KV heads and width."""
    source, target = prefill_engine.runner.kv_pages.keys[0], decode_engine.runner.kv_pages.keys[0]
    if (source.shape[1:], source.dtype, len(prefill_engine.runner.kv_pages.keys)) != (
        target.shape[1:],
        target.dtype,
        len(decode_engine.runner.kv_pages.keys),
    ):
        raise ValueError(
            f"prefill and decode KV pages differ in layout ({source.shape[1:]} {source.dtype} vs "
            f"{target.shape[1:]} {target.dtype}): use the same model, dtype, page size and kernel"
        )


def move_pages(prefill_engine, source_pages: list[int], decode_engine, target_pages: list[int]) -> int:
    """Copy the pages' KV across; returns the bytes moved (exactly the pages asked for)."""
    if len(source_pages) != len(target_pages):
        raise ValueError(f"{len(source_pages)} pages to send but {len(target_pages)} reserved")
    if not source_pages:
        return 0
    chunks = prefill_engine.runner.gather_pages(source_pages)
    chunks = jax.device_put(chunks, decode_engine.runner.page_array_sharding())
    decode_engine.runner.scatter_pages(target_pages, chunks)
    return sum(chunk.nbytes for chunk in chunks)
