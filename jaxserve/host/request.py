"""Requests as the host sees them: sampling parameters, per-sequence state, and the outputs returned."""

from __future__ import annotations

import enum
import functools
import json
import math
from dataclasses import dataclass, field
from typing import Any

MAX_ABS_LOGIT_BIAS = 100.0  # OpenAI's range for logit_bias values
GUIDED_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


class Logprob(float):
    """A token's log-probability, as vLLM's Logprob: a float (so `logprobs[token]` is its value) that also has
    `.logprob`, `.rank` (1: the most likely token; as vLLM counts it, tied tokens share the worse rank) and
    `.decoded_token` (the token's own text, filled in the offline API's outputs)."""

    __slots__ = ("rank", "decoded_token")

    def __new__(cls, logprob: float, rank: int | None = None, decoded_token: str | None = None):
        value = super().__new__(cls, logprob)
        value.rank, value.decoded_token = rank, decoded_token
        return value

    @property
    def logprob(self) -> float:
        return float(self)

    def __reduce__(self):
        return Logprob, (float(self), self.rank, self.decoded_token)

    def __repr__(self) -> str:
        return f"Logprob(logprob={float(self)!r}, rank={self.rank!r}, decoded_token={self.decoded_token!r})"


@dataclass(frozen=True)
class GuidedDecodingParams:
    """Constrain the output to a grammar (one of these, as vLLM's GuidedDecodingParams): a JSON schema
    (`json`, a dict or its JSON text), any JSON object (`json_object`), a regular expression, one of
    `choice`'s strings, a Lark / GBNF grammar (`grammar`), or vLLM's `structural_tag` (free text in which each
    trigger starts a tag whose body follows its JSON schema: {"structures": [{"begin", "schema", "end"}],
    "triggers": [...]}, a dict or its JSON text). host/grammar.py compiles it."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    structural_tag: dict | str | None = None
    # vLLM's: a regex for the whitespace a JSON reply may hold between its tokens (json / json_object only);
    # None: compact JSON (", " and ": ")
    whitespace_pattern: str | None = None

    def __post_init__(self):
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) for c in self.choice) or not self.choice:
                raise ValueError(f"guided choice must be a non-empty list of strings, got {self.choice!r}")
            object.__setattr__(self, "choice", tuple(self.choice))
        for kind, name in (("json", "JSON schema"), ("structural_tag", "structural tag")):
            value = getattr(self, kind)
            if isinstance(value, dict):
                try:  # key order kept: replies follow it
                    object.__setattr__(self, kind, json.dumps(value))
                except (TypeError, ValueError, RecursionError) as error:  # a set, a circular or too deep a schema
                    raise ValueError(f"invalid guided {name}: not JSON data ({error})") from None
        given = [kind for kind in GUIDED_KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"guided decoding takes exactly one of {', '.join(GUIDED_KINDS)}; got {given or 'none'}")
        for kind in ("json", "regex", "grammar", "structural_tag"):
            value = getattr(self, kind)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"guided {kind} must be a non-empty string, got {value!r}")
        if self.whitespace_pattern is not None:
            if not isinstance(self.whitespace_pattern, str) or not self.whitespace_pattern:
                raise ValueError(f"whitespace_pattern must be a non-empty regex, got {self.whitespace_pattern!r}")
            if given[0] not in ("json", "json_object"):
                raise ValueError(f"whitespace_pattern applies to JSON (json, json_object), not to guided {given[0]}")

    @property
    def kind(self) -> str:
        return next(kind for kind in GUIDED_KINDS if getattr(self, kind) not in (None, False))


StructuredOutputsParams = GuidedDecodingParams  # vLLM's newer name for the same parameters


def check_truncate_prompt_tokens(k) -> None:
    """ValueError unless k is None, -1 or an integer >= 1."""
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or (k < 1 and k != -1)):
        raise ValueError(f"truncate_prompt_tokens must be an integer >= 1 or -1, got {k!r}")


def truncate_prompt(prompt_token_ids: list[int], truncate_prompt_tokens: int | None, max_model_len: int) -> list[int]:
    """The last truncate_prompt_tokens tokens (-1: the last max_model_len; None: all), or a ValueError where
    that is more than max_model_len (as vLLM)."""
    k = truncate_prompt_tokens
    if k is None:
        return prompt_token_ids
    check_truncate_prompt_tokens(k)  # a server truncates before SamplingParams checks the request's value
    if k > max_model_len:
        raise ValueError(f"truncate_prompt_tokens ({k}) is more than max_model_len ({max_model_len})")
    return prompt_token_ids[-(max_model_len if k == -1 else k) :]


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling, named as in vLLM. temperature 0 means greedy."""

    n: int = 1
    max_tokens: int | None = 16  # None: as many as max_model_len and the KV cache leave after the prompt (vLLM's)
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k cut
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] | list[str] | str | None = None
    stop_token_ids: tuple[int, ...] | list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per generated token (the sampled one is always added)
    # vLLM's: the log-probability of every prompt token after the first (and this many top alternatives),
    # computed in the prompt's prefill; such a request's own prefill reuses no cached pages (see README)
    prompt_logprobs: int | None = None
    # OpenAI's: subtracted from the logit of every token already in the output, once (presence) or per
    # occurrence (frequency); transformers': logits of prompt and output tokens divided (if > 0) or
    # multiplied by it.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # {token_id: bias} added to the logits (OpenAI's keys may be strings of ids); -100 bans in effect
    logit_bias: dict | tuple[tuple[int, float], ...] | None = None
    min_tokens: int = 0  # EOS and stop tokens are banned until this many tokens were generated
    bad_words: tuple[str, ...] | list[str] | None = (
        None  # never generated (each word's last token banned after its others)
    )
    allowed_token_ids: tuple[int, ...] | list[int] | None = None  # only these may be generated
    guided_decoding: GuidedDecodingParams | None = None
    structured_outputs: GuidedDecodingParams | None = None  # vLLM's newer name for guided_decoding (moved there)
    # The token after which guided_decoding starts (a reasoning model's end of thinking, "</think>": its
    # reasoning runs free and the grammar governs the answer, as vLLM's structured outputs with a reasoning
    # parser); None: from the first token. The server sets it (server.reasoning_parser).
    guided_decoding_after_token: int | None = None
    lora: str | None = None  # the name of a loaded LoRA adapter to generate with (None: the base model)
    include_stop_str_in_output: bool = False  # vLLM's: the stop string that ends the text stays in it
    skip_special_tokens: bool = True  # vLLM's: special tokens (EOS, chat markup) are left out of the text
    # vLLM's: False (with skip_special_tokens False) writes an added token that follows another as its bare
    # text, without the space a tokenizer's decoder may put between them (WordPiece's does; byte-level and
    # sentencepiece decoders put none, so there it changes nothing)
    spaces_between_special_tokens: bool = True
    # vLLM's: only the prompt's last k tokens are used (left truncation); -1: the last max_model_len
    truncate_prompt_tokens: int | None = None

    def __post_init__(self):
        if self.structured_outputs is not None:
            if self.guided_decoding is not None:
                raise ValueError("give structured_outputs or guided_decoding (its older name), not both")
            object.__setattr__(self, "guided_decoding", self.structured_outputs)
            object.__setattr__(self, "structured_outputs", None)
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        object.__setattr__(self, "stop", stop)
        stop_token_ids = tuple(int(t) for t in (self.stop_token_ids or ()))
        object.__setattr__(self, "stop_token_ids", stop_token_ids)
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be a positive integer, got {self.n!r}")
        # 0: nothing generated, the request ends after its prefill (scoring a prompt with prompt_logprobs)
        if self.max_tokens is not None and (
            isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 0
        ):
            raise ValueError(f"max_tokens must be None or an integer >= 0, got {self.max_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be a non-negative integer below 2**63, got {self.seed!r}")
        if any(t < 0 for t in stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative token ids, got {min(stop_token_ids)}")
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop strings must be non-empty strings, got {self.stop!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        self._check_controls()
        for name in (
            "include_stop_str_in_output",
            "skip_special_tokens",
            "spaces_between_special_tokens",
            "ignore_eos",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        check_truncate_prompt_tokens(self.truncate_prompt_tokens)
        if self.lora is not None and (not isinstance(self.lora, str) or not self.lora):
            raise ValueError(f"lora must be the name of a loaded LoRA adapter, got {self.lora!r}")

    @property
    def max_new_tokens(self) -> int:
        """max_tokens as the engine reads it: admission (Engine.add_request) made None the room the prompt leaves."""
        assert self.max_tokens is not None, "max_tokens None is resolved when the request is admitted"
        return self.max_tokens

    def _check_controls(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        if not isinstance(self.repetition_penalty, (int, float)) or not 0 < self.repetition_penalty <= 10:
            raise ValueError(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty!r}")
        object.__setattr__(self, "logit_bias", _logit_bias_pairs(self.logit_bias))
        most = self.max_tokens if self.max_tokens is not None else self.min_tokens  # None: checked at admission
        bad = isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int)
        if bad or not 0 <= self.min_tokens <= most:
            raise ValueError(
                f"min_tokens must be between 0 and max_tokens ({self.max_tokens}), got {self.min_tokens!r}"
            )
        if self.bad_words is not None:
            if isinstance(self.bad_words, str) or any(not isinstance(w, str) or not w for w in self.bad_words):
                raise ValueError(f"bad_words must be a list of non-empty strings, got {self.bad_words!r}")
            object.__setattr__(self, "bad_words", tuple(self.bad_words))
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if (
                isinstance(ids, (str, bytes))
                or not ids
                or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids)
            ):
                raise ValueError(f"allowed_token_ids must be a non-empty list of token ids, got {ids!r}")
            object.__setattr__(self, "allowed_token_ids", tuple(ids))
        if self.guided_decoding is not None and not isinstance(self.guided_decoding, GuidedDecodingParams):
            raise ValueError(
                f"guided_decoding must be a GuidedDecodingParams, got {type(self.guided_decoding).__name__}"
            )
        after = self.guided_decoding_after_token
        if after is not None and (isinstance(after, bool) or not isinstance(after, int) or after < 0):
            raise ValueError(f"guided_decoding_after_token must be a token id, got {after!r}")
        if after is not None and self.guided_decoding is None:
            raise ValueError("guided_decoding_after_token needs guided_decoding")

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @functools.cached_property
    def stop_token_id_set(self) -> frozenset[int]:
        """stop_token_ids for the per-token check: O(1) however many a request names."""
        return frozenset(self.stop_token_ids or ())  # a tuple once constructed


def _logit_bias_pairs(bias) -> tuple[tuple[int, float], ...] | None:
    """{token: bias} (keys ints or strings of ints, as OpenAI's JSON sends them) -> sorted pairs."""
    if bias is None:
        return None
    items = bias.items() if isinstance(bias, dict) else bias
    pairs = {}
    for key, value in items:
        try:
            token_id = int(key)
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias keys must be token ids, got {key!r}") from None
        if token_id < 0 or isinstance(key, float):
            raise ValueError(f"logit_bias keys must be non-negative token ids, got {key!r}")
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not -MAX_ABS_LOGIT_BIAS <= value <= MAX_ABS_LOGIT_BIAS
        ):
            raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {value!r} for token {token_id}")
        pairs[token_id] = float(value)
    return tuple(sorted(pairs.items()))


class FinishReason(enum.StrEnum):
    """Why a sequence ended. A str, so it travels as itself over JSON and gRPC ("stop", "length", ...)."""

    STOP = "stop"  # an EOS or stop token, or a stop string
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"  # the caller (or the server, for a client that stopped reading) cancelled it
    ERROR = "error"  # the server failed it; the stream carries the reason
    HANDED_OVER = "handed_over"  # a prefill replica's request whose KV pages a decode replica took
    # guided decoding: no token can continue the grammar (e.g. it and allowed_token_ids share none);
    # the text so far is returned, and it does not complete the grammar
    GRAMMAR_DEAD_END = "grammar_dead_end"
    # the sampling controls left no token to generate (bad words' bans covering allowed_token_ids)
    NO_TOKEN_ALLOWED = "no_token_allowed"


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(eq=False)  # identity, not field-by-field, equality: sequences are compared in queues
class SequenceState:
    """One generated sequence: the prompt plus what has been sampled so far, and where its KV lives.

    A request with n > 1 owns n sequences that share the prompt.
    """

    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    sampling_seed: int  # the key all of this sequence's random draws derive from
    arrival_order: int
    session_id: str | None = None
    rank: int = 0  # the data-parallel rank whose devices and pages hold this sequence
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    # The request's prompt logprobs, gathered as its prefill chunks run: entry i is prompt token i + 1's
    # {token_id: logprob}. None unless this sequence scores the prompt (the first of a request that asks).
    prompt_logprobs: list[dict[int, float]] | None = None
    page_ids: list[int] = field(default_factory=list)
    page_keys: list[int] = field(default_factory=list)  # prefix-cache keys of the full pages, in order
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    # Overlapped steps: the scheduler plans a step while the previous one still runs on the device.
    num_inflight_tokens: int = 0  # tokens whose KV a dispatched, not yet processed, step computes
    num_pending_tokens: int = 0  # tokens a dispatched step samples that the host has not seen yet
    token_buffer_entry: int = -1  # where the device keeps this sequence's newest sampled token (-1: not running)
    num_cached_tokens: int = 0  # prompt tokens reused from the prefix cache
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    # vLLM's: the stop string or stop_token_ids entry that ended the sequence (None for EOS, length, ...)
    stop_reason: int | str | None = None
    flushing: bool = False  # finished for its caller; runs one more step to cache its last page
    text: str = ""
    detokenizer_state: object = None
    stop_matcher: object = None  # where the stop-string search stands in text (host/stop_strings.py)
    # Sampling controls (host/sampling_controls.py: SamplingControls, worked out once per request) and
    # the grammar's matcher (host/grammar_matcher.py: GrammarMatcher), when the request has them; the
    # engine sets next_token_mask ([W] int32 bitmask row) and next_token_bans before each step that
    # samples this sequence's next token (the grammar's mask, bad words' last tokens).
    controls: Any = None
    grammar: Any = None
    # a grammar that starts after params.guided_decoding_after_token: its matcher, until that token is sampled
    waiting_grammar: Any = None
    next_token_mask: Any = None
    # a verify row's masks for its positions after its proposals ([len(proposals), W]: after the first, ...)
    draft_token_masks: Any = None
    next_token_bans: tuple[int, ...] = ()
    # LoRA (jaxserve/lora): the adapter's device slot (0: the base model), and the root its prefix-cache
    # page keys chain from (the adapter's identity), so that a page never serves another adapter
    lora_slot: int = 0
    cache_root_key: int = 0
    # Speculative decoding: tokens proposed for this sequence, and how many of them it accepted
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0

    def token_slice(self, start: int, end: int) -> list[int]:
        """token_ids[start:end] without concatenating prompt and output (this runs every step)."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]

    @property
    def cumulative_logprob(self) -> float | None:
        if self.params.logprobs is None:
            return None
        return sum(logprobs[token] for token, logprobs in zip(self.output_token_ids, self.output_logprobs))

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_planned_tokens(self) -> int:
        """Known tokens plus the ones dispatched steps are sampling: what the scheduler plans over."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending_tokens

    @property
    def next_kv_position(self) -> int:
        """The first position whose KV no step has computed or is computing."""
        return self.num_computed_tokens + self.num_inflight_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_unscored_prompt_tokens(self) -> int:
        """Prompt tokens (after the first) whose logprobs this sequence still has to gather."""
        if self.prompt_logprobs is None:
            return 0
        return max(self.num_prompt_tokens - 1 - len(self.prompt_logprobs), 0)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[dict[int, float]] | None = None
    # Speculative decoding: tokens proposed for this sequence and how many were accepted
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    # vLLM's: the sum of the generated tokens' logprobs (None unless logprobs were asked for)
    cumulative_logprob: float | None = None
    # vLLM's: the stop string or stop_token_ids entry that ended the sequence (None for EOS, length, ...)
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def acceptance_rate(self) -> float:
        """Accepted proposals over proposed ones (0 when nothing was proposed)."""
        return self.num_accepted_draft_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    # With SamplingParams.prompt_logprobs, as vLLM: None for the first prompt token, then one
    # {token_id: logprob} per prompt token (itself and the top prompt_logprobs alternatives)
    prompt_logprobs: list[dict[int, float] | None] | None = None

    @property
    def finished(self) -> bool:
        return all(output.finished for output in self.outputs)


@dataclass
class Request:
    """A request as the engine holds it: its prompt and its n sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[SequenceState]

    @property
    def finished(self) -> bool:
        return all(seq.finish_reason is not None for seq in self.seqs)

    def output(self) -> RequestOutput:
        outputs = [
            CompletionOutput(
                index=i,
                text=seq.text,
                token_ids=list(seq.output_token_ids),
                finish_reason=seq.finish_reason,
                logprobs=list(seq.output_logprobs) if seq.params.logprobs is not None else None,
                num_draft_tokens=seq.num_draft_tokens,
                num_accepted_draft_tokens=seq.num_accepted_draft_tokens,
                cumulative_logprob=seq.cumulative_logprob,
                stop_reason=seq.stop_reason,
            )
            for i, seq in enumerate(self.seqs)
        ]
        scored = self.seqs[0].prompt_logprobs
        return RequestOutput(
            self.request_id,
            self.prompt,
            list(self.prompt_token_ids),
            outputs,
            num_cached_tokens=self.seqs[0].num_cached_tokens,
            prompt_logprobs=None if scored is None else [None, *scored],
        )
