"""The step's per-row sampling inputs (device/sampler.py: SamplingInputs) from the scheduled chunks:
temperature and the other sampling parameters, the seed, and the logits processors' inputs.

Rows that use no processor get neutral values (no bias entries, every token allowed, no penalties), and
a step where no row uses one skips it on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxserve.device.sampler import SamplingInputs
from jaxserve.host.schedule import ScheduledChunk

ANY_TOKEN = -1  # a bitmask word with every bit set


@dataclass(frozen=True)
class SamplingWidths:
    """Fixed widths of the per-row processor inputs: part of every compiled step's shape."""

    bias_entries: int  # B: EngineConfig's max_bias_entries
    mask_words: int  # W: ceil(vocab_size / 32)

    @classmethod
    def for_vocab(cls, vocab_size: int, bias_entries: int) -> SamplingWidths:
        return cls(bias_entries=bias_entries, mask_words=-(-vocab_size // 32))


def seed_words(seed: int) -> tuple[int, int]:
    """A 64-bit seed as the two uint32 words of a threefry key."""
    return (seed >> 32) & 0xFFFFFFFF, seed & 0xFFFFFFFF


def _neutral_fields(num_rows: int, widths: SamplingWidths) -> dict[str, np.ndarray]:
    return dict(
        temperature=np.zeros(num_rows, np.float32),
        top_k=np.zeros(num_rows, np.int32),
        top_p=np.ones(num_rows, np.float32),
        min_p=np.zeros(num_rows, np.float32),
        seeds=np.zeros((num_rows, 2), np.uint32),
        token_indices=np.zeros(num_rows, np.int32),
        wants_logprobs=np.zeros(num_rows, np.bool_),
        bias_token_ids=np.full((num_rows, widths.bias_entries), -1, np.int32),
        bias_values=np.zeros((num_rows, widths.bias_entries), np.float32),
        bias_until=np.zeros((num_rows, widths.bias_entries), np.int32),
        allowed_tokens=np.full((num_rows, widths.mask_words), ANY_TOKEN, np.int32),
        presence_penalty=np.zeros(num_rows, np.float32),
        frequency_penalty=np.zeros(num_rows, np.float32),
        repetition_penalty=np.ones(num_rows, np.float32),
    )


def neutral_sampling_inputs(num_rows: int, widths: SamplingWidths | None = None, **fields) -> SamplingInputs:
    """num_rows rows that sample greedily and use no processor (a step's padding rows: no bias entries, every
    token allowed, no penalties), with `fields` (SamplingInputs' names: one value for every row, or an array
    whose first axis is the rows) set instead. widths: the processor inputs' (default: one bias entry and one
    mask word, which no row uses)."""
    neutral = _neutral_fields(num_rows, widths or SamplingWidths(bias_entries=1, mask_words=1))
    for name, value in fields.items():
        if name not in neutral:
            raise ValueError(f"SamplingInputs has no field {name!r}")
        array = np.asarray(value, neutral[name].dtype)
        per_row = array.ndim == neutral[name].ndim and array.shape[0] == num_rows
        neutral[name] = np.array(array if per_row else np.broadcast_to(array, neutral[name].shape))
    return SamplingInputs(**neutral)


def build_sampling_inputs(chunks: list[ScheduledChunk], num_seqs: int, widths: SamplingWidths) -> SamplingInputs:
    fields = _neutral_fields(num_seqs, widths)
    temperature, top_k, top_p, min_p = fields["temperature"], fields["top_k"], fields["top_p"], fields["min_p"]
    seeds, token_indices, wants_logprobs = fields["seeds"], fields["token_indices"], fields["wants_logprobs"]
    bias_token_ids, bias_values, bias_until = fields["bias_token_ids"], fields["bias_values"], fields["bias_until"]
    allowed_tokens = fields["allowed_tokens"]
    presence, frequency = fields["presence_penalty"], fields["frequency_penalty"]
    repetition = fields["repetition_penalty"]
    for row, chunk in enumerate(chunks):
        seq, params = chunk.seq, chunk.seq.params
        temperature[row] = params.temperature
        top_k[row] = params.top_k
        top_p[row] = params.top_p
        min_p[row] = params.min_p
        seeds[row] = seed_words(seq.sampling_seed)
        token_indices[row] = seq.num_planned_tokens - seq.num_prompt_tokens  # this row samples output token #
        wants_logprobs[row] = params.logprobs is not None
        presence[row], frequency[row] = params.presence_penalty, params.frequency_penalty
        repetition[row] = params.repetition_penalty
        controls = seq.controls
        if controls is not None:
            num = len(controls.bias_token_ids)
            bias_token_ids[row, :num] = controls.bias_token_ids
            bias_values[row, :num] = controls.bias_values
            bias_until[row, :num] = controls.bias_until
            if seq.next_token_bans:
                bans = list(seq.next_token_bans)[: widths.bias_entries - num]
                bias_token_ids[row, num : num + len(bans)] = bans
                bias_values[row, num : num + len(bans)] = -np.inf
                bias_until[row, num : num + len(bans)] = np.iinfo(np.int32).max
            if controls.allowed_mask is not None:
                allowed_tokens[row] = controls.allowed_mask
        if seq.next_token_mask is not None:
            allowed_tokens[row] = seq.next_token_mask
    return SamplingInputs(**fields)
