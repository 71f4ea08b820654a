"""Constrained decoding's host side, over llguidance: grammars compiled, and each step's token bitmask.

A request's GuidedDecodingParams (host/request.py) is checked before the request is queued
(GrammarCompiler.check), compiled once per distinct grammar on a small thread pool (compile_async; an
LRU cache keyed by kind and text), and each of its sequences gets a GrammarMatcher (grammar_matcher.py)
copied from the compiled template. Each step the engine writes the bitmask rows of its constrained
sequences (fill_bitmasks: llguidance's parallel executor), the device masks the logits with them, and
the sampled tokens are accepted back into the matchers. Once the text is complete the engine's EOS ids
are allowed and nothing else, so the engine's ordinary stop ends the request.

llguidance rather than xgrammar: xgrammar's wheel requires torch, transformers and triton, while
llguidance has no dependencies and writes numpy bitmasks.
"""

from __future__ import annotations

import copy
import json
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import llguidance
import numpy as np
import sentencepiece
from sentencepiece import sentencepiece_model_pb2

from jaxserve.host.grammar_matcher import GrammarMatcher, MaskLayout
from jaxserve.host.request import GuidedDecodingParams
from jaxserve.loading.fast_tokenizer import FastTokenizer
from jaxserve.loading.sentencepiece_tokenizer import SentencePieceTokenizer
from jaxserve.loading.tokenizer import Tokenizer, check_unicode

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # a TypedDict its stubs declare, absent at run time

KIND_NAMES = {
    "json": "JSON schema",
    "json_object": "json_object",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
    "structural_tag": "structural tag",
}
# Compact JSON, as OpenAI's structured outputs write it: a sampled model given free whitespace can spend its
# whole token budget on newlines, and a reply cut off there is invalid JSON. A schema can still ask for
# free whitespace with llguidance's own "x-guidance": {"whitespace_flexible": true}.
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_JSON_OBJECT = '{"type": "object"}'


@dataclass(frozen=True, eq=False)
class CompiledGrammar:
    """A grammar compiled against the engine's vocabulary; matchers are cheap copies of its template."""

    kind: str
    template: llguidance.LLMatcher  # at the start of the text, its first mask already computed
    layout: MaskLayout

    def new_matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self.template.deep_copy(), self.layout)


MAX_ITEMS_IN_ROW = 20_000  # llguidance's Earley items in one parser row (its default 2000)


class GrammarCompiler:
    """One per engine. vocab_size is the model's (padded embedding rows are never allowed);
    eos_token_ids are the ids the engine stops on, allowed exactly when the text is complete."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        eos_token_ids: Iterable[int],
        *,
        max_cached_grammars: int = 256,
        num_compile_threads: int = 2,
        num_mask_threads: int | None = None,  # None: llguidance's default (80% of the cores, at most 32)
    ):
        eos = frozenset(int(t) for t in eos_token_ids if 0 <= t < vocab_size)
        if not eos:
            raise ValueError(
                f"constrained decoding needs an EOS token id below the vocabulary size ({vocab_size}) to end on, "
                f"got {sorted(eos_token_ids)}"
            )
        if max_cached_grammars < 1:
            raise ValueError(f"max_cached_grammars must be >= 1, got {max_cached_grammars}")
        self.layout = MaskLayout(vocab_size, max(vocab_size, tokenizer.vocab_size), eos)
        self._tokenizer = _llguidance_tokenizer(tokenizer, self.layout)
        # what a structural tag's trigger names as a token, not text: text -> id, written by id (llguidance's
        # "<[id]>": its "<|python_tag|>" syntax reads only names in angle brackets, and Mistral's is [TOOL_CALLS])
        self._special_tokens = {
            text: token_id
            for token_id, text in tokenizer.added_token_texts.items()
            if token_id < self.layout.num_grammar_tokens and self._tokenizer.is_special_token(token_id)
        }
        # Terse errors: verbose ones dump parser state and the whole grammar into the client's error message.
        # max_items_in_row past llguidance's 2000: a choice of 2000+ strings (or a schema with as many optional
        # properties) validated, then died at its first tokens ("Current row has 2002 items"); a request's
        # max_structured_bytes keeps rows well under this, and step_max_items still bounds a mask's work
        self._limits = llguidance.LLParserLimits(verbose_errors=False, max_items_in_row=MAX_ITEMS_IN_ROW)
        self._compile_pool = ThreadPoolExecutor(num_compile_threads, thread_name_prefix="grammar-compile")
        self._mask_executor = llguidance.LLExecutor(num_mask_threads)
        self._cache: OrderedDict[tuple[str, str, str | None], Future[CompiledGrammar]] = OrderedDict()
        self._lock = threading.Lock()
        self.max_cached_grammars = max_cached_grammars
        self.num_compiles = 0  # grammars compiled (cache misses), for stats and tests

    def check(self, guided: GuidedDecodingParams) -> None:
        """ValueError naming the problem when guided is invalid or cannot be compiled for this vocabulary.

        Blocks until compiled (the compile itself runs on the pool and is cached, so the engine's
        compile_async for the same grammar finds it done); call it where blocking is fine."""
        self.compile_async(guided).result()

    def compile_async(self, guided: GuidedDecodingParams) -> Future[CompiledGrammar]:
        """The compiled grammar, from the cache or compiled on the pool; the future raises ValueError
        for a grammar that cannot be compiled (failures are cached too: compiling is deterministic)."""
        key = grammar_key(guided)
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._compile_pool.submit(self._compile, *key)
            self.num_compiles += 1
            self._cache[key] = future
            if len(self._cache) > self.max_cached_grammars:
                self._cache.popitem(last=False)  # holders of its future keep the compiled grammar alive
            return future

    @property
    def num_cached_grammars(self) -> int:
        return len(self._cache)

    def allocate_bitmask(self, num_rows: int) -> np.ndarray:
        """[num_rows, ceil(V / 32)] int32, all allowed (V: max of the model's and the tokenizer's sizes)."""
        return self.layout.allocate_bitmask(num_rows)

    def fill_bitmasks(
        self, rows: Sequence[tuple[GrammarMatcher, int]], bitmask: np.ndarray, marks_dead_ends: bool = True
    ) -> None:
        """bitmask[row] = the tokens matcher allows next, for every (matcher, row), on llguidance's threads.
        Rows not named are left as they are (all ones for unconstrained sequences). marks_dead_ends: see
        GrammarMatcher.note_filled."""
        self.layout.check_bitmask(bitmask)
        row_ids = [row for _, row in rows]
        if len(set(row_ids)) != len(row_ids):
            raise ValueError(f"each bitmask row can hold one matcher, got rows {row_ids}")
        if any(not 0 <= row < bitmask.shape[0] for row in row_ids):
            raise ValueError(f"rows {row_ids} reach outside the bitmask's {bitmask.shape[0]} rows")
        to_compute = []
        for matcher, row in rows:
            if matcher.ended_by_eos:
                bitmask[row] = self.layout.eos_row()
            else:
                to_compute.append((matcher.llguidance_matcher, row))
        if len(to_compute) == 1:  # one row: the executor's hand-off would cost more than it saves
            matcher, row = to_compute[0]
            matcher.unsafe_compute_mask_ptr(bitmask[row].ctypes.data, bitmask[row].nbytes)
        elif to_compute:
            self._mask_executor.unsafe_compute_mask_ptr(
                to_compute, bitmask.ctypes.data, bitmask.shape[1] * bitmask.itemsize, bitmask.shape[0]
            )
        for matcher, row in rows:
            matcher.note_filled(bitmask[row : row + 1], marks_dead_ends)

    def fill_verify_bitmasks(
        self, rows: Sequence[tuple[GrammarMatcher, int, Sequence[int]]], bitmask: np.ndarray
    ) -> None:
        """For each (matcher, first_row, proposals): bitmask[first_row + i] = the tokens allowed after the first i
        proposals, i = 0 .. len(proposals) (a verify row's positions: engine/speculation.py), position by
        position on llguidance's threads. Position 0 is the matcher's own row; the later ones come from a copy
        that takes the proposals the grammar accepts, so whatever happens ahead (an llguidance error, an empty
        row) touches only the copy: the sequence meets it only if the target accepts those proposals, and
        then a plain step would have met it too (a copy that cannot take a proposal it validated leaves the
        rows from there empty: no token allowed, as a dead end). The rows after a proposal the grammar refuses
        are left as they are: the sample at that proposal's position never equals it (the row before forbids
        it), so no later position is ever accepted."""
        taken = [matcher.num_acceptable_tokens(proposals) for matcher, _, proposals in rows]
        self.fill_bitmasks([(matcher, first) for matcher, first, _ in rows], bitmask)
        ahead = [(matcher.copy(), first, proposals[:n]) for (matcher, first, proposals), n in zip(rows, taken) if n]
        for position in range(1, max(taken, default=0) + 1):
            current = []
            for index, (twin, first, proposals) in enumerate(ahead):
                if len(proposals) < position:
                    continue
                if twin.accept_token(int(proposals[position - 1])):
                    current.append((twin, first + position))
                else:
                    bitmask[first + position : first + len(proposals) + 1] = 0
                    ahead[index] = (twin, first, proposals[: position - 1])  # nothing further from this copy
            self.fill_bitmasks(current, bitmask, marks_dead_ends=False)

    def token_bytes(self, token_id: int) -> bytes | None:
        """The token's own bytes (a byte-level or byte-fallback token may hold part of a UTF-8 character, which
        its decoded text shows as U+FFFD); None for a special token or an id outside the vocabulary."""
        if not 0 <= token_id < self.layout.num_grammar_tokens or self._tokenizer.is_special_token(token_id):
            return None
        return self._tokenizer.decode_bytes([token_id])

    def close(self) -> None:
        """Compiles not yet started are cancelled; running ones finish in the background."""
        self._compile_pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, kind: str, text: str, whitespace_pattern: str | None = None) -> CompiledGrammar:
        name = KIND_NAMES[kind]
        try:
            grammar = _llguidance_grammar(kind, text, whitespace_pattern, self._special_tokens)
        except Exception as error:  # llguidance's converters raise assorted types for malformed input
            raise ValueError(f"invalid guided {name}: {error}") from None
        template = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0, limits=self._limits)
        if template.is_error():
            raise ValueError(f"invalid guided {name}: {template.get_error()}")
        # The first mask is computed here, off the engine's thread; the copies share what it built.
        first = self.layout.allocate_bitmask(1)
        template.unsafe_compute_mask_ptr(first.ctypes.data, first.nbytes)
        if template.is_error():
            raise ValueError(f"guided {name} cannot be compiled: {template.get_error()}")
        self.layout.clear_beyond_vocab(first)
        if not first.any():
            raise ValueError(f"guided {name} cannot start with any token of this model's vocabulary")
        return CompiledGrammar(kind, template, self.layout)


def grammar_key(guided: GuidedDecodingParams) -> tuple[str, str, str | None]:
    """(kind, text, JSON whitespace pattern): what the cache tells grammars apart by."""
    kind = guided.kind
    if kind == "json_object":
        return kind, ANY_JSON_OBJECT, guided.whitespace_pattern
    if kind == "choice":
        return kind, json.dumps(list(guided.choice or ())), None
    value = getattr(guided, kind)
    return kind, value if isinstance(value, str) else json.dumps(value, sort_keys=True), guided.whitespace_pattern


def _llguidance_grammar(
    kind: str, text: str, whitespace_pattern: str | None = None, special_tokens: Mapping[str, int] | None = None
) -> str:
    if kind in ("json", "json_object"):
        # a whitespace pattern takes the compact separators' place: whitespace matching it may go between tokens
        options: JsonCompileOptions = (
            JSON_OPTIONS
            if whitespace_pattern is None
            else {"whitespace_flexible": True, "whitespace_pattern": whitespace_pattern}
        )
        return llguidance.LLMatcher.grammar_from_json_schema(text, defaults=options)
    if kind == "choice":
        return llguidance.grammar_from("choice", text)
    if kind == "structural_tag":
        return structural_tag_grammar(text, special_tokens)
    # "grammar": Lark as written, or GBNF (llama.cpp's) converted to Lark
    return llguidance.grammar_from("regex" if kind == "regex" else "grammar", text)


def structural_tag_grammar(text: str, special_tokens: Mapping[str, int] | None = None) -> str:
    """vLLM's structural tag as a Lark grammar (llguidance's tool-calling syntax, as vLLM's guidance backend
    builds it): free text, in which each trigger must go on into one of the structures that begin with it, its
    body JSON following the structure's schema (compact, as the JSON kinds), then its end; then free text
    again. A trigger that is one of special_tokens (text -> id: Llama's <|python_tag|>, Mistral's [TOOL_CALLS]) is
    that token; any other (a "<function=" prefix, or a <tool_call> the vocabulary spells in text) is text, matched
    lazily."""
    special_tokens = special_tokens or {}
    try:
        spec = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as error:
        raise ValueError(f"not valid JSON ({error})") from None
    if not isinstance(spec, dict):
        raise ValueError('expected an object {"structures": [...], "triggers": [...]}')
    check_unicode(json.dumps(spec, ensure_ascii=False), "it")  # JSON's "\ud800" escapes a lone surrogate
    if "format" in spec:  # xgrammar's newer form; vLLM's guidance backend reads only the one below
        raise ValueError("the 'format' form (xgrammar's) is not supported: give 'structures' and 'triggers'")
    structures, triggers = spec.get("structures"), spec.get("triggers")
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise ValueError(f"'triggers' must be a non-empty list of non-empty strings, got {triggers!r}"[:200])
    if not isinstance(structures, list) or not structures:
        raise ValueError("'structures' must be a non-empty list of {'begin', 'schema', 'end'} objects")
    rules = []
    for index, structure in enumerate(structures):
        begin, end = (structure.get(k) if isinstance(structure, dict) else None for k in ("begin", "end"))
        schema = structure.get("schema") if isinstance(structure, dict) else None
        if not isinstance(begin, str) or not isinstance(end, str) or not isinstance(schema, dict):
            raise ValueError(f"structures[{index}] needs 'begin' and 'end' strings and a 'schema' object")
        trigger = next((t for t in triggers if begin.startswith(t)), None)
        if trigger is None:
            raise ValueError(f"structures[{index}]'s begin {begin!r} starts with none of the triggers {triggers}"[:300])
        schema = schema if "x-guidance" in schema else {**schema, "x-guidance": dict(JSON_OPTIONS)}
        body = " ".join(
            part for part in (_lark_text(begin[len(trigger) :]), "%json " + json.dumps(schema), _lark_text(end)) if part
        )
        if trigger in special_tokens:
            rules.append(f"tag_{index}: TAG_TEXT <[{special_tokens[trigger]}]> {body}")
        else:  # lazy: the free text ends at the trigger's first occurrence
            rules += [
                f"tag_{index}_trigger[lazy]: TAG_TEXT {_lark_text(trigger)}",
                f"tag_{index}: tag_{index}_trigger {body}",
            ]
    alternatives = " | ".join(f"tag_{i}" for i in range(len(structures)))
    head = ["%llguidance {}", f"start: ({alternatives})* tag_end", "tag_end: TAG_TEXT", r"TAG_TEXT: /(.|\n)*/"]
    return "\n".join(head + rules) + "\n"


def _lark_text(text: str) -> str:
    """A Lark string literal (JSON's escapes are Lark's); nothing for the empty string."""
    return json.dumps(text) if text else ""


def _llguidance_tokenizer(tokenizer: Tokenizer, layout: MaskLayout) -> llguidance.LLTokenizer:
    eos = sorted(layout.eos_token_ids)
    if isinstance(tokenizer, FastTokenizer):
        backend = copy.copy(tokenizer.backend)  # llguidance re-reads its JSON: no padding, no truncation
        backend.no_padding()
        backend.no_truncation()
        try:
            return llguidance.LLTokenizer(backend.to_str(), n_vocab=layout.num_grammar_tokens, eos_token=eos)
        except Exception as error:  # llguidance reports an unsupported tokenizer.json as a bare error
            raise ValueError(f"constrained decoding cannot use this tokenizer: {error}") from None
    if isinstance(tokenizer, SentencePieceTokenizer):
        vocabulary = SentencePieceVocabulary(tokenizer, layout)
        return llguidance.LLTokenizer(llguidance.TokenizerWrapper(vocabulary), eos_token=eos)
    raise ValueError(f"constrained decoding does not support {type(tokenizer).__name__} tokenizers")


class SentencePieceVocabulary:
    """What llguidance.TokenizerWrapper reads from a lone tokenizer.model: every token's bytes, the special
    ids, and an encoder (llguidance encodes text the grammar forces, to allow its usual tokenization)."""

    def __init__(self, tokenizer: SentencePieceTokenizer, layout: MaskLayout):
        processor = tokenizer.processor
        self.tokens = [_piece_bytes(processor, i) for i in range(processor.GetPieceSize())]
        self.tokens += [b""] * (layout.num_grammar_tokens - len(self.tokens))  # padded rows: never allowed
        self.special_token_ids = sorted(tokenizer.special_ids)
        self.eos_token_id = min(layout.eos_token_ids)  # LLTokenizer is given the full set
        self.bos_token_id = tokenizer.bos_token_id
        # sentencepiece ships no stubs for this generated protobuf module, whose classes are made at import time
        proto = sentencepiece_model_pb2.ModelProto()  # pyright: ignore[reportAttributeAccessIssue]
        proto.ParseFromString(processor.serialized_model_proto())
        # Forced text sits mid-sequence: no dummy-prefix space before it, its spaces kept as written.
        proto.normalizer_spec.add_dummy_prefix = False
        proto.normalizer_spec.remove_extra_whitespaces = False
        self._encoder = sentencepiece.SentencePieceProcessor()
        self._encoder.LoadFromSerializedProto(proto.SerializeToString())

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):  # TokenizerWrapper probes with bytes; refusing makes it pass strings
            raise TypeError("SentencePieceVocabulary encodes str")
        return self._encoder.EncodeAsIds(text)


def _piece_bytes(processor: sentencepiece.SentencePieceProcessor, token_id: int) -> bytes:
    piece = processor.IdToPiece(token_id)
    if processor.IsByte(token_id):  # "<0xE2>": one byte of a character the vocabulary lacks
        return bytes([int(piece[3:-1], 16)])
    return piece.replace("\u2581", " ").encode("utf-8")
