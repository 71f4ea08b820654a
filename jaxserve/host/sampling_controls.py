"""A request's sampling controls as the step's per-row inputs take them, worked out once per request.

logit_bias, single-token bad words (bans: a bias of -inf) and min_tokens (EOS and stop tokens banned
until that many output tokens) become one list of bias entries; allowed_token_ids becomes a bitmask
row. What depends on the tokens generated so far (a bad word's last token, banned while its others
end the output; a grammar's mask) is worked out at every step (`dynamic_bans`, host/grammar.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxserve.host.request import SamplingParams
from jaxserve.loading.tokenizer import Tokenizer

NO_LIMIT = 2**31 - 1  # a bias entry's `until` when it applies to every output token (as the step's)


@dataclass(frozen=True)
class SamplingControls:
    bias_token_ids: np.ndarray  # [b] int32
    bias_values: np.ndarray  # [b] float32 (-inf: banned)
    bias_until: np.ndarray  # [b] int32: applies while the output token's index is below this
    allowed_mask: np.ndarray | None  # [W] int32 bitmask row of allowed_token_ids
    multi_token_bad_words: tuple[tuple[int, ...], ...]  # each banned by its last token, after the others

    @property
    def num_entries(self) -> int:
        """Bias entries a step may need for this request: the static ones and one per multi-token word."""
        return len(self.bias_token_ids) + len(self.multi_token_bad_words)


def pack_bitmask(token_ids, num_words: int) -> np.ndarray:
    """Token ids -> a [num_words] int32 row with bit b of word w set for token 32 w + b."""
    words = np.zeros(num_words, np.uint32)
    ids = np.asarray(sorted(set(token_ids)), np.int64)
    np.bitwise_or.at(words, ids // 32, (np.uint32(1) << (ids % 32).astype(np.uint32)))
    return words.view(np.int32)


def sampling_controls(
    params: SamplingParams,
    tokenizer: Tokenizer | None,
    eos_token_ids: frozenset[int],
    vocab_size: int,
    max_entries: int,
) -> SamplingControls | None:
    """None for a request without any of these controls. ValueError naming the problem for ids outside
    the vocabulary, bad words without a tokenizer, allowed_token_ids that are all banned, or more bias
    entries than the step holds."""
    for name, ids in (
        ("logit_bias", [t for t, _ in params.logit_bias or ()]),
        ("allowed_token_ids", params.allowed_token_ids or ()),
    ):
        outside = [t for t in ids if t >= vocab_size]
        if outside:
            raise ValueError(f"{name} token ids {outside[:5]} are outside the vocabulary [0, {vocab_size})")
    # (token, value, until): a token may appear twice (a logit_bias and min_tokens' ban): the step adds both
    entries: list[tuple[int, float, int]] = [(t, v, NO_LIMIT) for t, v in params.logit_bias or ()]
    banned: set[int] = set()
    multi_token_words: list[tuple[int, ...]] = []
    for word_ids in _bad_word_token_ids(params, tokenizer):
        if len(word_ids) != 1:  # more than one: _bad_word_token_ids keeps no empty encoding
            multi_token_words.append(word_ids)
        elif word_ids[0] < vocab_size and word_ids[0] not in banned:
            banned.add(word_ids[0])
            entries.append((word_ids[0], -np.inf, NO_LIMIT))
    stops: set[int] = set()
    if params.min_tokens:
        stops = set(params.stop_token_id_set) | (set() if params.ignore_eos else set(eos_token_ids))
        entries += [(t, -np.inf, params.min_tokens) for t in sorted(stops) if t < vocab_size]
    allowed = params.allowed_token_ids
    if allowed is not None and set(allowed) <= banned | stops:
        # every logit would be -inf, and the sampler's pick (the first id) is no token the caller allowed
        reasons = ["bad_words"] if banned & set(allowed) else []
        if stops & set(allowed):
            reasons.append(f"min_tokens (EOS and stop tokens, for the first {params.min_tokens} tokens)")
        raise ValueError(f"allowed_token_ids leaves nothing to generate: {' and '.join(reasons)} ban all its tokens")
    if not entries and not multi_token_words and allowed is None:
        return None
    if len(entries) + len(multi_token_words) > max_entries:
        raise ValueError(
            f"the request needs {len(entries) + len(multi_token_words)} biased tokens (logit_bias, bad_words, and "
            f"EOS and stop tokens for min_tokens), more than the engine's max_bias_entries ({max_entries})"
        )
    return SamplingControls(
        bias_token_ids=np.asarray([t for t, _, _ in entries], np.int32),
        bias_values=np.asarray([v for _, v, _ in entries], np.float32),
        bias_until=np.asarray([u for _, _, u in entries], np.int32),
        allowed_mask=pack_bitmask(allowed, -(-vocab_size // 32)) if allowed is not None else None,
        multi_token_bad_words=tuple(multi_token_words),
    )


def _bad_word_token_ids(params: SamplingParams, tokenizer: Tokenizer | None) -> list[tuple[int, ...]]:
    """Each bad word as the model would write it alone and after a space (as vLLM bans them)."""
    if not params.bad_words:
        return []
    if tokenizer is None:
        raise ValueError("bad_words need the model's tokenizer, and this model has none")
    variants = []
    for word in params.bad_words:
        for text in (word, " " + word.lstrip()):
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            if ids and ids not in variants:  # a word the tokenizer writes the same both ways counts once
                variants.append(ids)
    return variants


def dynamic_bans(controls: SamplingControls, output_token_ids: list[int]) -> list[int]:
    """The last tokens of the multi-token bad words whose other tokens end the output now."""
    banned = []
    for word in controls.multi_token_bad_words:
        prefix = list(word[:-1])
        if len(output_token_ids) >= len(prefix) and output_token_ids[len(output_token_ids) - len(prefix) :] == prefix:
            banned.append(word[-1])
    return banned
