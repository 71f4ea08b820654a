"""What travels with a handover besides the page bytes: plain data, the same in one process or over gRPC."""

from __future__ import annotations

from dataclasses import dataclass

from jaxserve.host.page_allocator import ROOT_KEY, num_pages_for, page_key
from jaxserve.host.request import SamplingParams


@dataclass(frozen=True)
class PrefilledRequest:
    """A request that a prefill replica ran to its first token."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    sampling_seed: int  # the seed the prefill side sampled with: later tokens draw from it too
    first_token_id: int
    first_logprobs: dict[int, float] | None


def prompt_page_keys(prompt_token_ids: list[int], page_size: int, root_key: int = ROOT_KEY) -> list[int]:
    """Keys of the prompt's full pages, as either side's prefix cache names them (the partial last
    page has none and always travels), chained from root_key: the request's LoRA adapter's identity (the
    same adapter files give the same identity on both replicas, whatever their slots), ROOT_KEY without."""
    keys, parent = [], root_key
    for start in range(0, len(prompt_token_ids) - page_size + 1, page_size):
        parent = page_key(parent, tuple(prompt_token_ids[start : start + page_size]))
        keys.append(parent)
    return keys


def missing_page_indices(prompt_token_ids: list[int], page_size: int, held_keys, root_key: int = ROOT_KEY) -> list[int]:
    """Which of the prompt's pages the receiver lacks: those whose key (from root_key) it does not hold,
    and the last partial page."""
    keys, held = prompt_page_keys(prompt_token_ids, page_size, root_key), set(held_keys)
    return [
        index
        for index in range(num_pages_for(len(prompt_token_ids), page_size))
        if index >= len(keys) or keys[index] not in held
    ]
