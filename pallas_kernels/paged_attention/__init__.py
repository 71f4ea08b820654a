"""Ragged paged attention: one call serves decode tokens and prefill chunks of many sequences.

Layout of a step's tokens: a flat array of T query tokens in blocks of `query_block` tokens, every
block belonging to one sequence (a decode step uses query_block=1, a prefill step pads each chunk
to whole blocks). Each block attends to the pages of its sequence, causally by absolute position.
Padding tokens carry position -1 and attend to nothing.
"""

from pallas_kernels.paged_attention import reference

ATTENTION_IMPLS = ("reference",)


def ragged_paged_attention(q, k_pages, v_pages, page_table, token_seq_ids, positions, *,
                           query_block: int, sliding_window: int | None = None, impl: str = "reference"):
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"unknown attention_impl {impl!r}; expected one of {ATTENTION_IMPLS}")
    return reference.ragged_paged_attention(
        q, k_pages, v_pages, page_table, token_seq_ids, positions,
        query_block=query_block, sliding_window=sliding_window)


def write_kv_pages(k_pages, v_pages, k, v, slot_ids, *, impl: str = "reference"):
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"unknown attention_impl {impl!r}; expected one of {ATTENTION_IMPLS}")
    return reference.write_kv_pages(k_pages, v_pages, k, v, slot_ids)
