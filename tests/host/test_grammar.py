"""Constrained decoding's host side (jaxserve/host/grammar.py, no JAX): decoding is simulated with real
tokenizers (byte-level Qwen-style, metaspace Llama-style, a lone sentencepiece tokenizer.model), each step
filling the mask, picking a random allowed token (seeded) and accepting it until EOS; the text must then
satisfy the grammar it was made under."""

import functools
import json
import re
import subprocess
import sys
import threading

import jsonschema
import numpy as np
import pytest

from jaxserve.host.grammar import GrammarCompiler
from jaxserve.host.grammar_matcher import GrammarMatcher
from jaxserve.host.request import GuidedDecodingParams
from jaxserve.loading.tokenizer import Tokenizer
from tests.support.grammar_tokenizers import NUM_PADDED_ROWS, ROOT, TOKENIZERS, compiler_for, load_tokenizer

MAX_TOKENS = 400
CLOSING_CHARACTERS = set('"]}')  # tokens of only these end strings, arrays and objects: picked often


@functools.cache
def closing_token_ids(name: str) -> np.ndarray:
    tokenizer = load_tokenizer(name)
    texts = (tokenizer.decode([i]) for i in range(tokenizer.vocab_size))
    return np.array([i for i, text in enumerate(texts) if text and set(text) <= CLOSING_CHARACTERS])


def allowed_ids(row: np.ndarray) -> np.ndarray:
    """Bit b of word w is token 32w + b (llguidance's layout, little-endian words)."""
    return np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))


def output_text(tokenizer: Tokenizer, token_ids: list[int]) -> str:
    """The text as the engine shows it: decoded after a prompt (a metaspace or sentencepiece vocabulary
    drops the space of a decode's first token, never of a token that follows the prompt)."""
    prompt_ids = tokenizer.encode("Answer:", add_special_tokens=False)
    prompt_text = tokenizer.decode(prompt_ids, skip_special_tokens=True)
    full_text = tokenizer.decode(prompt_ids + token_ids, skip_special_tokens=True)
    assert full_text.startswith(prompt_text)
    return full_text[len(prompt_text) :]


def generate(name: str, guided: GuidedDecodingParams, seed: int) -> str:
    """Random decoding under the mask; checks every mask on the way (EOS exactly when complete, no padded
    or out-of-vocabulary row, never a dead end) and returns the text."""
    tokenizer, compiler = load_tokenizer(name), compiler_for(name)
    eos_ids = np.array(sorted(tokenizer.eos_token_ids))
    matcher = compiler.compile_async(guided).result(timeout=60).new_matcher()
    rng = np.random.default_rng(seed)
    bitmask = compiler.allocate_bitmask(2)  # all ones: a bit the fill failed to clear would show
    token_ids: list[int] = []
    for _ in range(MAX_TOKENS):
        matcher.fill_bitmask(bitmask, 1)
        allowed = allowed_ids(bitmask[1])
        assert not matcher.is_dead_end, matcher.dead_end_reason
        assert allowed.size and allowed.max() < tokenizer.vocab_size  # padded rows never
        assert np.isin(eos_ids, allowed).all() == matcher.is_accepting  # every EOS id, and only when complete
        assert np.isin(eos_ids, allowed).any() == matcher.is_accepting
        if matcher.is_finished:
            assert set(allowed) == set(eos_ids)  # nothing past the end
        assert (bitmask[0] == -1).all()  # other rows untouched
        text_ids = np.setdiff1d(allowed, eos_ids)
        closing = np.intersect1d(text_ids, closing_token_ids(name))
        if matcher.is_accepting and (not text_ids.size or rng.random() < 0.5):
            token_id = int(rng.choice(eos_ids))
        elif closing.size and rng.random() < 0.3:
            token_id = int(rng.choice(closing))
        else:
            token_id = int(rng.choice(text_ids))
        assert matcher.accept_token(token_id)
        if token_id in tokenizer.eos_token_ids:
            assert matcher.is_finished and matcher.is_accepting
            return output_text(tokenizer, token_ids)
        token_ids.append(token_id)
    raise AssertionError(f"no EOS within {MAX_TOKENS} tokens: {output_text(tokenizer, token_ids)!r}")


SCHEMAS = [
    {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    },
    {
        "type": "object",
        "properties": {
            "person": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "minLength": 1, "maxLength": 12},
                    "address": {
                        "type": "object",
                        "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                        "required": ["city", "zip"],
                        "additionalProperties": False,
                    },
                },
                "required": ["name", "address"],
                "additionalProperties": False,
            }
        },
        "required": ["person"],
    },
    {"type": "array", "items": {"type": "integer", "minimum": -50, "maximum": 50}, "minItems": 1, "maxItems": 4},
    {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "version": {"const": 2}, "ok": {"type": "boolean"}},
        "required": ["color", "version", "ok"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "price": {"type": "number", "minimum": 0, "maximum": 1000},
            "ratio": {"type": "number", "exclusiveMinimum": -1, "exclusiveMaximum": 1},
            "count": {"type": "integer", "minimum": 1, "maximum": 9},
        },
        "required": ["price", "ratio", "count"],
    },
    {
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}-[0-9]{2}$"},
            "note": {"type": ["string", "null"]},
        },
        "required": ["code", "note"],
        "additionalProperties": False,
    },
    {  # pydantic's layout: $defs and $ref, titles, optional fields
        "$defs": {
            "Item": {
                "title": "Item",
                "type": "object",
                "properties": {
                    "sku": {"title": "Sku", "type": "string"},
                    "qty": {"title": "Qty", "type": "integer", "minimum": 1},
                },
                "required": ["sku", "qty"],
            }
        },
        "title": "Order",
        "type": "object",
        "properties": {
            "items": {"type": "array", "items": {"$ref": "#/$defs/Item"}, "maxItems": 3},
            "gift": {"anyOf": [{"type": "boolean"}, {"type": "null"}], "default": None},
        },
        "required": ["items"],
        "additionalProperties": False,
    },
    {  # a tagged union, as tool calls are written
        "oneOf": [
            {
                "type": "object",
                "properties": {"kind": {"const": "circle"}, "radius": {"type": "number", "minimum": 0}},
                "required": ["kind", "radius"],
                "additionalProperties": False,
            },
            {
                "type": "object",
                "properties": {"kind": {"const": "label"}, "text": {"type": "string", "maxLength": 10}},
                "required": ["kind", "text"],
                "additionalProperties": False,
            },
        ]
    },
    {"type": "array", "items": {"enum": ["a", "b", 3, None]}, "minItems": 2, "maxItems": 5},
    {"type": "string", "format": "date"},
    {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,6}$"}}},
        "additionalProperties": {"type": "integer"},
    },
]


@pytest.mark.parametrize("name", TOKENIZERS)
@pytest.mark.parametrize("schema_index", range(len(SCHEMAS)))
def test_json_schema_outputs_validate(name, schema_index):
    schema = SCHEMAS[schema_index]
    guided = GuidedDecodingParams(json=schema)
    for seed in range(3):
        text = generate(name, guided, seed)
        jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())


@pytest.mark.parametrize("name", TOKENIZERS)
def test_json_object_outputs_are_objects(name):
    for seed in range(4):
        assert isinstance(json.loads(generate(name, GuidedDecodingParams(json_object=True), seed)), dict)


REGEXES = [
    r"[a-z]{2,6}@[a-z]{2,5}\.(com|org|net)",
    r"[0-9]{3}-[0-9]{4}",  # not \d: Rust's Unicode tables know digits (U+1CCF0...) Python 3.11's do not
    r"[A-Z][a-z]*( [A-Z][a-z]*){0,3}",
    r"-?(0|[1-9][0-9]{0,5})(\.[0-9]{1,3})?",
    r"héllo|wörld|😀+",
]


@pytest.mark.parametrize("name", TOKENIZERS)
@pytest.mark.parametrize("regex", REGEXES)
def test_regex_outputs_match(name, regex):
    for seed in range(4):
        text = generate(name, GuidedDecodingParams(regex=regex), seed)
        assert re.fullmatch(regex, text), text


@pytest.mark.parametrize("name", TOKENIZERS)
def test_choice_outputs_are_choices(name):
    choices = ["yes", "yes please", "héllo", 'a "quoted" word', "back\\slash", "two\nlines", "😀"]
    seen = {generate(name, GuidedDecodingParams(choice=choices), seed) for seed in range(12)}
    assert seen <= set(choices) and len(seen) > 1


GRAMMARS = [  # (Lark or GBNF, an equivalent Python regex)
    (
        'start: "[" item ("," item)* "]"\nitem: /[0-9]{1,3}/ | "true" | "false"',
        r"\[([0-9]{1,3}|true|false)(,([0-9]{1,3}|true|false))*\]",
    ),
    (
        'root ::= greeting " " name\ngreeting ::= "hello" | "hi"\nname ::= [A-Z] [a-z]{0,6}',
        r"(hello|hi) [A-Z][a-z]{0,6}",
    ),
]


@pytest.mark.parametrize("name", TOKENIZERS)
@pytest.mark.parametrize("grammar, regex", GRAMMARS)
def test_grammar_outputs_match(name, grammar, regex):
    for seed in range(4):
        text = generate(name, GuidedDecodingParams(grammar=grammar), seed)
        assert re.fullmatch(regex, text), text


@pytest.mark.parametrize("name", ["qwen_byte_level"])  # byte-level: encode() spells text exactly, no leading space
def test_the_usual_tokenization_of_a_valid_document_is_accepted(name):
    tokenizer, compiler = load_tokenizer(name), compiler_for(name)
    document = {"person": {"name": "Ada", "address": {"city": "Zürich", "zip": "80331"}}}
    token_ids = tokenizer.encode(json.dumps(document, ensure_ascii=False), add_special_tokens=False)
    # As text: GuidedDecodingParams sorts a dict's keys, and the output's properties follow the schema's order.
    guided = GuidedDecodingParams(json=json.dumps(SCHEMAS[1]))
    matcher = compiler.compile_async(guided).result().new_matcher()
    assert matcher.num_acceptable_tokens(token_ids) == len(token_ids)
    assert matcher.num_accepted_tokens == 0  # validating changes nothing
    assert all(matcher.accept_token(t) for t in token_ids)
    assert matcher.is_accepting and matcher.is_finished


INVALID = [
    (dict(json={"type": "strin"}), "JSON schema.*strin"),
    (dict(json={"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}), "JSON schema.*missing"),
    (dict(json={"type": "string", "pattern": "(["}), "JSON schema.*unclosed"),
    (dict(json={"type": "integer", "minimum": 5, "maximum": 1}), "JSON schema.*minimum"),
    (dict(json="{not json"), "JSON schema"),
    (dict(json={"type": "array", "uniqueItems": True}), "uniqueItems"),  # llguidance cannot enforce it: refused
    (dict(json={"type": "string", "format": "nonsense"}), "nonsense"),
    (dict(regex="(["), "regex.*unclosed"),
    (dict(regex="a{2,1}"), "regex"),
    (dict(grammar="start: undefined_rule"), "grammar.*undefined_rule"),
    (dict(grammar='root ::= "a" (  '), "grammar"),
]


@pytest.mark.parametrize("fields, message", INVALID)
def test_invalid_guides_raise_value_error_naming_the_problem(fields, message):
    compiler = compiler_for("qwen_byte_level")
    with pytest.raises(ValueError, match=f"(?s){message}"):
        compiler.check(GuidedDecodingParams(**fields))


def test_valid_guides_pass_the_check():
    compiler = compiler_for("qwen_byte_level")
    for guided in (
        GuidedDecodingParams(json=SCHEMAS[6]),
        GuidedDecodingParams(json_object=True),
        GuidedDecodingParams(regex=REGEXES[0]),
        GuidedDecodingParams(choice=["a", "b"]),
        GuidedDecodingParams(grammar=GRAMMARS[1][0]),
    ):
        assert compiler.check(guided) is None


def test_the_cache_compiles_each_grammar_once():
    tokenizer = load_tokenizer("qwen_byte_level")
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids, max_cached_grammars=2)
    first = compiler.compile_async(GuidedDecodingParams(json={"type": "integer", "minimum": 1}))
    again = compiler.compile_async(GuidedDecodingParams(json={"type": "integer", "minimum": 1}))
    assert again is first and first.result() is again.result() and compiler.num_compiles == 1
    compiler.check(GuidedDecodingParams(json={"type": "integer", "minimum": 1}))
    assert compiler.num_compiles == 1  # check() compiles through the same cache
    assert compiler.compile_async(GuidedDecodingParams(regex="[0-9]+")) is not first  # another kind
    compiler.compile_async(GuidedDecodingParams(choice=["x"]))
    assert compiler.num_compiles == 3 and compiler.num_cached_grammars == 2  # bounded: the oldest went
    assert compiler.compile_async(GuidedDecodingParams(json={"type": "integer", "minimum": 1})) is not first
    assert compiler.num_compiles == 4
    with pytest.raises(ValueError):
        compiler.check(GuidedDecodingParams(regex="(["))
    with pytest.raises(ValueError):
        compiler.check(GuidedDecodingParams(regex="(["))
    assert compiler.num_compiles == 5  # failures are cached as well
    compiler.close()


def test_compiling_runs_off_the_callers_thread(monkeypatch):
    """A slow grammar: compile_async returns at once, the compile runs on the pool's thread."""
    tokenizer = load_tokenizer("qwen_byte_level")
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)
    release, threads = threading.Event(), []
    compile_now = compiler._compile

    def slow_compile(kind, text, whitespace_pattern=None):
        threads.append(threading.current_thread())
        assert release.wait(timeout=30)
        return compile_now(kind, text, whitespace_pattern)

    monkeypatch.setattr(compiler, "_compile", slow_compile)
    future = compiler.compile_async(GuidedDecodingParams(json={"type": "string"}))
    assert not future.done()  # the caller was not held up
    release.set()
    matcher = future.result(timeout=30).new_matcher()
    assert threads and threads[0] is not threading.current_thread()
    assert isinstance(matcher, GrammarMatcher)
    compiler.close()


def test_batched_fill_equals_single_fills():
    name = "qwen_byte_level"
    tokenizer, compiler = load_tokenizer(name), compiler_for(name)
    compiled = compiler.compile_async(GuidedDecodingParams(json=json.dumps(SCHEMAS[1]))).result()  # keys in order
    document = '{"person": {"name": "Ada", "address": {"city": "Paris", "zip": "75001"}}}'
    token_ids = tokenizer.encode(document, add_special_tokens=False)
    matchers = []
    for num_tokens in range(0, len(token_ids), 2):  # matchers at different places in the document
        matcher = compiled.new_matcher()
        assert all(matcher.accept_token(t) for t in token_ids[:num_tokens])
        matchers.append(matcher)
    ended = compiled.new_matcher()
    assert all(ended.accept_token(t) for t in [*token_ids, min(tokenizer.eos_token_ids)])
    matchers.append(ended)
    rows = np.random.default_rng(0).permutation(len(matchers) + 3)[: len(matchers)]  # 3 rows unconstrained
    batched = compiler.allocate_bitmask(len(matchers) + 3)
    compiler.fill_bitmasks(list(zip(matchers, rows.tolist(), strict=True)), batched)
    for matcher, row in zip(matchers, rows, strict=True):
        single = compiler.allocate_bitmask(1)
        matcher.fill_bitmask(single, 0)
        np.testing.assert_array_equal(batched[row], single[0])
    assert set(allowed_ids(batched[rows[-1]])) == set(tokenizer.eos_token_ids)  # after EOS: EOS only
    for row in set(range(len(matchers) + 3)) - set(rows.tolist()):
        assert (batched[row] == -1).all()
    alone = compiler.allocate_bitmask(2)
    compiler.fill_bitmasks([(matchers[1], 1)], alone)  # one row takes the direct path
    np.testing.assert_array_equal(alone[1], batched[rows[1]])
    assert (alone[0] == -1).all()
    with pytest.raises(ValueError, match="one matcher"):
        compiler.fill_bitmasks([(matchers[0], 0), (matchers[1], 0)], batched)


def test_a_refused_token_is_a_dead_end_with_a_reason():
    name = "qwen_byte_level"
    tokenizer, compiler = load_tokenizer(name), compiler_for(name)
    matcher = compiler.compile_async(GuidedDecodingParams(regex="[0-9]+")).result().new_matcher()
    letter = tokenizer.encode("x", add_special_tokens=False)[0]
    assert not matcher.accept_token(letter)
    assert matcher.is_dead_end and "dead end" in (matcher.dead_end_reason or "")
    assert not matcher.is_accepting and not matcher.is_finished
    assert not matcher.accept_token(tokenizer.encode("1", add_special_tokens=False)[0])  # dead for good
    with pytest.raises(ValueError, match="dead end"):
        matcher.rollback(0)
    early_eos = compiler.compile_async(GuidedDecodingParams(regex="[0-9]+")).result().new_matcher()
    assert not early_eos.accept_token(min(tokenizer.eos_token_ids))  # EOS before the text is complete
    assert early_eos.is_dead_end
    padded = compiler.compile_async(GuidedDecodingParams(regex="[0-9]+")).result().new_matcher()
    assert not padded.accept_token(tokenizer.vocab_size + 1)  # a padded row, were one ever sampled
    assert "outside the vocabulary" not in (padded.dead_end_reason or "")  # inside the model's, outside the tokenizer's
    assert padded.is_dead_end
    beyond = compiler.compile_async(GuidedDecodingParams(regex="[0-9]+")).result().new_matcher()
    assert not beyond.accept_token(tokenizer.vocab_size + NUM_PADDED_ROWS)
    assert "outside the vocabulary" in (beyond.dead_end_reason or "")


@pytest.mark.parametrize("name", ["qwen_byte_level", "sentencepiece"])
def test_rollback_restores_earlier_masks(name):
    tokenizer, compiler = load_tokenizer(name), compiler_for(name)
    matcher = compiler.compile_async(GuidedDecodingParams(json=SCHEMAS[3])).result().new_matcher()
    rng = np.random.default_rng(1)
    masks, bitmask = [], compiler.allocate_bitmask(1)
    while True:
        matcher.fill_bitmask(bitmask, 0)
        masks.append(bitmask[0].copy())
        allowed = allowed_ids(bitmask[0])
        token_id = int(rng.choice(allowed)) if not matcher.is_accepting else min(tokenizer.eos_token_ids)
        assert matcher.accept_token(token_id)
        if token_id in tokenizer.eos_token_ids:
            break
    num_tokens = matcher.num_accepted_tokens
    assert num_tokens == len(masks) and matcher.is_finished
    for num_back in (1, 3, num_tokens - 1):  # the first undoes the EOS, the last goes back to the start
        matcher.rollback(num_back - (num_tokens - matcher.num_accepted_tokens))
        assert matcher.num_accepted_tokens == num_tokens - num_back
        matcher.fill_bitmask(bitmask, 0)
        np.testing.assert_array_equal(bitmask[0], masks[num_tokens - num_back])
    with pytest.raises(ValueError, match="roll back"):
        matcher.rollback(matcher.num_accepted_tokens + 1)


def test_a_model_vocabulary_smaller_than_the_tokenizer_never_allows_the_excess():
    tokenizer = load_tokenizer("qwen_byte_level")
    vocab_size = tokenizer.vocab_size - 40  # every id the fixture's EOS ids use stays inside it
    compiler = GrammarCompiler(tokenizer, vocab_size, tokenizer.eos_token_ids)
    matcher = compiler.compile_async(GuidedDecodingParams(regex="[^0-9]+")).result().new_matcher()
    bitmask = compiler.allocate_bitmask(1)
    matcher.fill_bitmask(bitmask, 0)
    allowed = allowed_ids(bitmask[0])
    assert allowed.max() < vocab_size and allowed.size > 100


def test_wrong_bitmasks_and_eos_sets_are_refused():
    tokenizer, compiler = load_tokenizer("qwen_byte_level"), compiler_for("qwen_byte_level")
    matcher = compiler.compile_async(GuidedDecodingParams(regex="a+")).result().new_matcher()
    good = compiler.allocate_bitmask(2)
    for bad in (good.astype(np.int64), good[:, :-1], np.ones((2, 2 * good.shape[1]), np.int32)[:, ::2]):
        with pytest.raises(ValueError, match="int32 array of shape"):
            matcher.fill_bitmask(bad, 0)
    with pytest.raises(ValueError, match="outside"):
        matcher.fill_bitmask(good, 2)
    with pytest.raises(ValueError, match="EOS"):
        GrammarCompiler(tokenizer, tokenizer.vocab_size, [tokenizer.vocab_size + 5])


def test_the_module_imports_no_jax():
    code = "import sys, jaxserve.host.grammar; assert 'jax' not in sys.modules, 'jax imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)


def test_verify_rows_hold_each_positions_mask_and_the_matchers_end_where_they_began():
    """fill_verify_bitmasks (a verify row's masks, engine/speculation.py): row first + i is the mask after the
    first i proposals, as a matcher stepped through them writes it; the rows after a refused proposal are left
    alone; rows of plain matchers sit beside them; every matcher's next mask is the one it had before."""
    name = "qwen_byte_level"
    tokenizer, compiler = load_tokenizer(name), compiler_for(name)
    compiled = compiler.compile_async(GuidedDecodingParams(json=json.dumps(SCHEMAS[1]))).result()
    document = '{"person": {"name": "Ada", "address": {"city": "Paris", "zip": "75001"}}}'
    token_ids = tokenizer.encode(document, add_special_tokens=False)
    refused = tokenizer.encode("x", add_special_tokens=False)[0]  # never valid right after '{'
    cases = [  # (tokens accepted before, proposals, proposals the grammar takes)
        (0, token_ids[:5], 5),
        (3, token_ids[3:4], 1),
        (2, [], 0),
        (1, [refused, *token_ids[1:3]], 0),  # refused first: position 0's mask only
        (4, [*token_ids[4:6], refused, token_ids[7]], 2),
        # EOS is no proposal the grammar takes (speculation cuts a proposal before an EOS), even where allowed
        (len(token_ids), [min(tokenizer.eos_token_ids)], 0),
    ]
    matchers, rows, first = [], [], 0
    for before, proposals, _ in cases:
        matcher = compiled.new_matcher()
        assert all(matcher.accept_token(t) for t in token_ids[:before])
        matchers.append(matcher)
        rows.append((matcher, first, proposals))
        first += 1 + len(proposals)
    bitmask = compiler.allocate_bitmask(first)
    before_masks = []
    for matcher in matchers:
        single = compiler.allocate_bitmask(1)
        matcher.fill_bitmask(single, 0)
        before_masks.append(single[0].copy())
    compiler.fill_verify_bitmasks(rows, bitmask)
    for (before, proposals, taken), (matcher, first_row, _), mask_before in zip(cases, rows, before_masks):
        assert matcher.num_accepted_tokens == before and not matcher.is_dead_end
        single = compiler.allocate_bitmask(1)
        matcher.fill_bitmask(single, 0)
        np.testing.assert_array_equal(single[0], mask_before)  # it ends where it began
        stepped = compiled.new_matcher()
        assert all(stepped.accept_token(t) for t in token_ids[:before])
        for position in range(len(proposals) + 1):
            row = bitmask[first_row + position]
            if position > taken:
                assert (row == -1).all()  # left alone: never reached (the row before forbids the proposal)
                continue
            stepped.fill_bitmask(single, 0)
            np.testing.assert_array_equal(row, single[0])
            if position < taken:
                assert stepped.accept_token(proposals[position])
            elif position < len(proposals) and proposals[position] not in tokenizer.eos_token_ids:
                assert proposals[position] not in allowed_ids(row)
    assert set(allowed_ids(bitmask[rows[-1][1]])) == set(tokenizer.eos_token_ids)  # complete: EOS only


def test_trouble_ahead_of_a_verify_row_leaves_the_sequences_matcher_alone(monkeypatch):
    """The positions after the proposals come from a copy of the matcher: a copy that breaks there (an
    llguidance error, simulated by a refused token) neither raises nor marks the sequence's own matcher."""
    name = "qwen_byte_level"
    tokenizer, compiler = load_tokenizer(name), compiler_for(name)
    compiled = compiler.compile_async(GuidedDecodingParams(json=json.dumps(SCHEMAS[1]))).result()
    token_ids = tokenizer.encode('{"person": {"name": "Ada"}}', add_special_tokens=False)
    refused = tokenizer.encode("x", add_special_tokens=False)[0]
    matcher = compiled.new_matcher()
    copy = GrammarMatcher.copy

    def broken_copy(self):
        twin = copy(self)
        assert not twin.accept_token(refused)  # the copy is in llguidance's error state from here
        return twin

    monkeypatch.setattr(GrammarMatcher, "copy", broken_copy)
    bitmask = compiler.allocate_bitmask(4)
    compiler.fill_verify_bitmasks([(matcher, 0, token_ids[:3])], bitmask)
    assert not matcher.is_dead_end and matcher.num_accepted_tokens == 0
    single = compiler.allocate_bitmask(1)
    matcher.fill_bitmask(single, 0)
    np.testing.assert_array_equal(bitmask[0], single[0])
    assert not bitmask[1:].any()  # what the copy could not vouch for allows no token (a dead end if reached)


def test_a_whitespace_pattern_lets_json_hold_the_whitespace_it_matches():
    """vLLM's guided_whitespace_pattern: whitespace matching it may go between a JSON reply's tokens, instead of
    the compact separators; each pattern is a grammar of its own in the cache; other kinds refuse it."""
    name = "qwen_byte_level"
    tokenizer, compiler = load_tokenizer(name), compiler_for(name)
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})

    def takes(guided: GuidedDecodingParams, text: str) -> bool:
        matcher = compiler.compile_async(guided).result().new_matcher()
        token_ids = tokenizer.encode(text, add_special_tokens=False)
        return matcher.num_acceptable_tokens(token_ids) == len(token_ids)

    compact = GuidedDecodingParams(json=schema)
    newlines = GuidedDecodingParams(json=schema, whitespace_pattern=r"[\n ]{0,2}")
    assert takes(compact, '{"a": 1}') and not takes(compact, '{\n "a":1}') and not takes(compact, '{"a":1}')
    assert takes(newlines, '{\n "a":1}') and takes(newlines, '{"a": 1}') and takes(newlines, '{"a":1}')
    assert not takes(newlines, '{   "a": 1}')  # three spaces: more than the pattern allows
    assert takes(GuidedDecodingParams(json_object=True, whitespace_pattern="\n?"), '{\n"k":\n"v"}')
    with pytest.raises(ValueError, match="not to guided regex"):
        GuidedDecodingParams(regex="a+", whitespace_pattern=" ")
    with pytest.raises(ValueError, match="whitespace_pattern"):
        GuidedDecodingParams(json=schema, whitespace_pattern="")
    with pytest.raises(ValueError, match="invalid guided JSON schema"):
        compiler.check(GuidedDecodingParams(json=schema, whitespace_pattern="[unclosed"))
