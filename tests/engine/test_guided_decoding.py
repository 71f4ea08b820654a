"""Guided decoding end to end on tiny-random: its weights are random, so replies fit their JSON schema,
regex, choice or Lark grammar only because the grammar's mask made them; each sequence of n > 1 has its
own matcher; plain requests sharing the batch are unchanged; overlapped steps change nothing; nothing
compiles after warm-up; a dead end ends the request, and a bad grammar is refused before it is queued."""

import json
import re

import jsonschema
import pytest

from jaxserve import SamplingParams
from jaxserve.host.request import FinishReason, GuidedDecodingParams
from tests.support.sampling_engines import assert_idle, greedy, tiny_random_llm, token_ids

PROMPT = "def forward(self, x):"
SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
            "ok": {"type": "boolean"},
        },
        "required": ["name", "age", "tags", "ok"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 9999},
            "kind": {"enum": ["circle", "square"]},
            "center": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": -50, "maximum": 50},
                    "y": {"type": "integer", "minimum": -50, "maximum": 50},
                },
                "required": ["x", "y"],
                "additionalProperties": False,
            },
        },
        "required": ["id", "kind", "center"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,5}$"}, "minItems": 1, "maxItems": 4},
    {
        "type": "object",
        "properties": {
            "value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99}, {"type": "null"}]},
            "flag": {"const": "yes"},
            "note": {"type": "string", "maxLength": 4},
        },
        "required": ["value", "flag"],
        "additionalProperties": False,
    },
]
REGEXES = [r"(yes|no)-[0-9]{3}", r"[A-Z][a-z]{2,6}( [A-Z][a-z]{2,6})?", r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)"]
CHOICES = ["alpha", "beta gamma", "delta"]
LARK = r"""
start: "let " NAME " = " NUMBER ";"
NAME: /[a-z]{1,6}/
NUMBER: /[0-9]{1,4}/
"""
LARK_TEXT = r"let [a-z]{1,6} = [0-9]{1,4};"


def guided(max_tokens: int, seed: int | None = None, n: int = 1, **kind) -> SamplingParams:
    temperature = 0.0 if seed is None else 1.0
    return SamplingParams(
        max_tokens=max_tokens, temperature=temperature, seed=seed, n=n, guided_decoding=GuidedDecodingParams(**kind)
    )


@pytest.fixture(scope="module")
def llm():
    return tiny_random_llm()


def test_sampled_json_always_fits_its_schema(llm):
    params = [guided(150, seed=seed, json=schema) for schema in SCHEMAS for seed in (11, 12)]
    params.append(guided(150, seed=13, json_object=True))
    for result, p in zip(llm.generate([PROMPT] * len(params), params), params):
        out = result.outputs[0]
        assert out.finish_reason == "stop", (out.finish_reason, out.text)
        value = json.loads(out.text)
        if p.guided_decoding.json_object:
            assert isinstance(value, dict)
        else:
            jsonschema.validate(value, json.loads(p.guided_decoding.json))


def test_sampled_regex_choice_and_lark_grammar_fit(llm):
    params = [guided(40, seed=seed, regex=regex) for regex in REGEXES for seed in (1, 2)]
    params += [guided(20, seed=seed, choice=CHOICES) for seed in (1, 2, 3)]
    params += [guided(40, seed=seed, grammar=LARK) for seed in (1, 2)]
    patterns = [regex for regex in REGEXES for _ in (1, 2)] + [None] * 3 + [LARK_TEXT] * 2
    for result, pattern in zip(llm.generate([PROMPT] * len(params), params), patterns):
        out = result.outputs[0]
        assert out.finish_reason == "stop", (out.finish_reason, out.text)
        if pattern is None:
            assert out.text in CHOICES
        else:
            assert re.fullmatch(pattern, out.text), (pattern, out.text)


def test_each_of_n_sequences_has_its_own_matcher(llm):
    results = llm.generate(
        [PROMPT, PROMPT],
        [guided(150, seed=21, n=4, json=SCHEMAS[0]), guided(40, seed=22, n=4, regex=REGEXES[2])],
    )
    for out in results[0].outputs:
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), SCHEMAS[0])
    for out in results[1].outputs:
        assert out.finish_reason == "stop" and re.fullmatch(REGEXES[2], out.text), out.text
    for result in results:
        assert len({out.text for out in result.outputs}) > 1, "differently seeded sequences should differ"


def test_plain_greedy_outputs_unchanged_beside_constrained_and_penalised_rows(llm):
    plain_prompts = [[1, 275, 240], [1, 302, 123, 94, 304, 336], "The quick brown fox"]
    alone = [token_ids(llm, [prompt], greedy(30))[0] for prompt in plain_prompts]
    compiles = llm.stats()["num_compiles_after_warmup"]
    crowd = [
        guided(100, seed=31, json=SCHEMAS[1]),
        guided(30, regex=REGEXES[0]),
        greedy(30, presence_penalty=0.5, repetition_penalty=1.2),
        SamplingParams(max_tokens=30, temperature=0.8, seed=32, logit_bias={300: 5}, bad_words=["b"], min_tokens=3),
        guided(20, seed=33, choice=CHOICES),
    ]
    prompts = [plain_prompts[0], PROMPT, plain_prompts[1], PROMPT, PROMPT, plain_prompts[2], PROMPT, PROMPT]
    params = [greedy(30), crowd[0], greedy(30), crowd[1], crowd[2], greedy(30), crowd[3], crowd[4]]
    mixed = llm.generate(prompts, params)
    assert [mixed[i].outputs[0].token_ids for i in (0, 2, 5)] == alone
    assert re.fullmatch(REGEXES[0], mixed[3].outputs[0].text) and mixed[7].outputs[0].text in CHOICES
    jsonschema.validate(json.loads(mixed[1].outputs[0].text), SCHEMAS[1])
    assert llm.stats()["num_compiles_after_warmup"] == compiles == 0
    assert_idle(llm)


def test_overlapped_steps_give_the_same_constrained_outputs():
    prompts = [PROMPT] * 5 + [[1, 275, 240]]
    params = [
        guided(150, json=SCHEMAS[0]),
        guided(150, json=SCHEMAS[2]),
        guided(40, regex=REGEXES[1]),
        guided(20, choice=CHOICES),
        guided(40, grammar=LARK),
        greedy(32, bad_words=["t_"], presence_penalty=0.4),
    ]
    results = {}
    for overlap in (True, False):
        outputs = tiny_random_llm(overlap).generate(prompts, params)
        results[overlap] = [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outputs]
    assert results[True] == results[False]
    assert [reason for _, _, reason in results[True]] == ["stop"] * 5 + ["length"]


def run_to_completion(llm, request_id, prompt, params, max_steps=50):
    """Steps the engine until the request finishes (a failure, not a hang, if it never does)."""
    llm.engine.add_request(request_id, prompt, params)
    for _ in range(max_steps):
        for output in llm.engine.step():
            if output.request_id == request_id and output.finished:
                while llm.engine.has_unfinished_requests():
                    llm.engine.step()
                return output
    raise AssertionError(f"{request_id} did not finish in {max_steps} steps")


def test_a_choice_of_thousands_of_strings_completes(llm):
    """Past llguidance's default 2000 items in a parser row such a choice validated, then died at its first tokens."""
    choices = [f"c{i}" for i in range(3000)]
    params = [guided(12, seed=seed, choice=choices) for seed in (1, 2)]
    for result in llm.generate([PROMPT] * len(params), params):
        out = result.outputs[0]
        assert out.finish_reason == "stop" and out.text in choices, (out.finish_reason, out.text)


def test_eos_allowed_by_a_grammar_in_its_error_state_is_a_dead_end():
    """llguidance in its error state (a resource limit hit computing a mask) allows EOS alone; sampling it must not
    end the request as a complete text ("stop")."""
    from types import SimpleNamespace

    from jaxserve.host.output_processor import append_token
    from jaxserve.host.request import SequenceState

    seq = SequenceState(0, "r", [1, 2, 3], SamplingParams(max_tokens=8), 0, 0)
    seq.grammar = SimpleNamespace(is_dead_end=True)  # pyright: ignore[reportAttributeAccessIssue]
    assert append_token(seq, 2, None, None, frozenset({2}), 64) == FinishReason.GRAMMAR_DEAD_END
    seq.grammar = None
    assert append_token(seq, 2, None, None, frozenset({2}), 64) == FinishReason.STOP


DIGITS = [51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 319, 328, 342, 345, 348, 372, 349, 379, 378, 376]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_dead_end_finishes_the_request(llm, temperature):
    tokenizer = llm.get_tokenizer()
    assert all(tokenizer.decode([t]).isdigit() for t in DIGITS)
    controls = dict(max_tokens=20, temperature=temperature, seed=41, allowed_token_ids=DIGITS)
    # nothing the grammar allows is allowed: it ends before its first token
    at_once = run_to_completion(
        llm,
        f"dead-at-once-{temperature}",
        PROMPT,
        SamplingParams(**controls, guided_decoding=GuidedDecodingParams(regex="[a-z]+")),
    )
    # two digits, then the grammar wants letters
    later = run_to_completion(
        llm,
        f"dead-later-{temperature}",
        PROMPT,
        SamplingParams(**controls, guided_decoding=GuidedDecodingParams(regex="[0-9]{2}[a-z]+")),
    )
    for output in (at_once, later):
        assert output.outputs[0].finish_reason == "grammar_dead_end"
        assert set(output.outputs[0].token_ids) <= set(DIGITS), output.outputs[0].token_ids
    assert at_once.outputs[0].token_ids == []
    assert len(later.outputs[0].token_ids) == 2 and re.fullmatch("[0-9]{2}", later.outputs[0].text)
    assert_idle(llm)


@pytest.mark.parametrize(
    "kind, message",
    [
        (dict(json={"type": "object", "properties": {"a": {"type": "no-such-type"}}}), "invalid guided JSON schema"),
        (dict(json="{not json"), "invalid guided JSON schema"),
        (dict(regex="(ab"), "invalid guided regex"),
        (dict(grammar="start: missing_rule"), "guided grammar"),
    ],
    ids=["schema", "schema-text", "regex", "grammar"],
)
def test_invalid_grammar_is_refused_before_anything_is_queued(llm, kind, message):
    valid = guided(20, choice=CHOICES)
    with pytest.raises(ValueError, match=message):
        llm.generate([PROMPT, PROMPT], [valid, guided(20, **kind)])
    assert not llm.engine.requests
    assert_idle(llm)
    assert llm.generate([PROMPT], valid)[0].outputs[0].text in CHOICES


@pytest.mark.parametrize("overlap", [True, False])
def test_a_grammar_after_a_token_lets_the_text_before_it_run_free(overlap):
    """guided_decoding_after_token (a reasoning model's </think>: the server sets it): the tokens up to and
    including the first one of that id are the unconstrained model's; from the next on, the grammar's, whole.
    Overlapped steps must not sample the token after it before its mask is known."""
    engine = tiny_random_llm(overlap)
    free = engine.generate([PROMPT], greedy(12))[0].outputs[0].token_ids
    at = next(i for i in range(2, len(free)) if free[i] not in free[:i])  # its first occurrence, not the first token
    params = SamplingParams(
        max_tokens=40,
        temperature=0.0,
        guided_decoding=GuidedDecodingParams(regex=REGEXES[0]),
        guided_decoding_after_token=free[at],
    )
    output = engine.generate([PROMPT], params)[0].outputs[0]
    assert output.token_ids[: at + 1] == free[: at + 1]
    answer = engine.get_tokenizer().decode(output.token_ids[at + 1 :], skip_special_tokens=True)
    assert re.fullmatch(REGEXES[0], answer) and output.finish_reason == "stop", answer
    # from the first token, the grammar changes the first token already
    assert engine.generate([PROMPT], guided(40, regex=REGEXES[0]))[0].outputs[0].token_ids[: at + 1] != free[: at + 1]
    with pytest.raises(ValueError, match="needs guided_decoding"):
        SamplingParams(guided_decoding_after_token=3)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate(
            [PROMPT], SamplingParams(guided_decoding=GuidedDecodingParams(regex="a"), guided_decoding_after_token=10**6)
        )
    assert_idle(engine)


def test_a_structural_tag_constrains_only_what_follows_its_trigger(llm):
    """vLLM's structural_tag: the text runs free; each trigger the model writes goes on into a structure whose
    body fits its schema. A bias on the trigger's tokens makes the random model write it often."""
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["a"],
        "additionalProperties": False,
    }
    tag = {"structures": [{"begin": "<f=add>", "schema": schema, "end": "</f>"}], "triggers": ["<f="]}
    tokenizer = llm.get_tokenizer()
    trigger_ids = [t for t in tokenizer.encode("<f=", add_special_tokens=False) if tokenizer.decode([t])]
    assert "".join(tokenizer.decode([t]) for t in trigger_ids) == "<f="
    params = [
        SamplingParams(
            max_tokens=120,
            temperature=1.0,
            seed=seed,
            logit_bias={t: 100 for t in trigger_ids},
            guided_decoding=GuidedDecodingParams(structural_tag=tag),
        )
        for seed in (1, 2, 3)
    ]
    structure = re.compile(r"<f=add>(.*?)</f>")
    outputs = [result.outputs[0] for result in llm.generate([PROMPT] * len(params), params)]
    assert any(structure.search(out.text) for out in outputs), [out.text for out in outputs]
    for out in outputs:
        for body in structure.findall(out.text):
            jsonschema.validate(json.loads(body), schema)
        # every trigger begins a whole structure, but one that max_tokens cut off at the end
        for trigger in re.finditer("<f=", out.text):
            tail = out.text[trigger.start() :]
            assert structure.match(tail) or (out.finish_reason == "length" and "</f>" not in tail), out.text
