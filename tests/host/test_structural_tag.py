"""vLLM's structural_tag (jaxserve/host/grammar.py's structural_tag_grammar): free text in which each trigger must
go on into one of the structures beginning with it, its body JSON fitting the structure's schema, then its end;
checked on the grammar tests' real tokenizers, and refused with a reason when malformed."""

import json
import os
import shutil

import pytest

from jaxserve.host.grammar import GrammarCompiler
from jaxserve.host.request import GuidedDecodingParams
from jaxserve.loading.tokenizer import Tokenizer
from tests.support.grammar_tokenizers import ROOT, TOKENIZERS, compiler_for, load_tokenizer

INVALID = [
    (dict(structural_tag="[1]"), "structural tag.*structures"),
    (dict(structural_tag='{"structures": [], "triggers": ["\\ud800"]}'), "structural tag.*surrogate"),
    (dict(structural_tag={"type": "structural_tag", "format": {"type": "any_text"}}), "structural tag.*'format'"),
    (dict(structural_tag={"structures": [{"begin": "<a>", "schema": {}, "end": "</a>"}]}), "structural tag.*triggers"),
    (dict(structural_tag={"structures": [], "triggers": ["<a"]}), "structural tag.*structures"),
    (dict(structural_tag={"structures": [{"begin": "<a>", "end": "</a>"}], "triggers": ["<a"]}), "schema"),
    (dict(structural_tag={"structures": [{"begin": "<b>", "schema": {}, "end": ""}], "triggers": ["<a"]}), "<b>"),
    (
        dict(
            structural_tag={
                "structures": [{"begin": "<a>", "schema": {"type": "strin"}, "end": ""}],
                "triggers": ["<a"],
            }
        ),
        "structural tag.*strin",
    ),
]


@pytest.mark.parametrize("fields, message", INVALID)
def test_a_malformed_structural_tag_is_refused_naming_the_problem(fields, message):
    with pytest.raises(ValueError, match=f"(?s){message}"):
        compiler_for("qwen_byte_level").check(GuidedDecodingParams(**fields))


@pytest.mark.parametrize("name", TOKENIZERS)
def test_a_structural_tag_lets_text_run_free_until_a_trigger_starts_one_of_its_structures(name):
    """vLLM's structural_tag (tool calls in running text): any text; a trigger must go on into a structure that
    begins with it, whose body follows its schema (compact JSON), then its end; then free text again."""
    add = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    weather = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    spec = {
        "structures": [
            {"begin": "<function=add>", "schema": add, "end": "</function>"},
            {"begin": "<function=weather>", "schema": weather, "end": "</function>"},
        ],
        "triggers": ["<function="],
    }
    tokenizer, compiler = load_tokenizer(name), compiler_for(name)
    matcher = compiler.compile_async(GuidedDecodingParams(structural_tag=spec)).result().new_matcher()

    def takes(text: str) -> bool:
        token_ids = tokenizer.encode(text, add_special_tokens=False)
        return matcher.num_acceptable_tokens(token_ids) == len(token_ids)

    assert takes("Just text, no call at all.")
    assert takes('Adding: <function=add>{"a": 12}</function> and <function=weather>{"city": "Oslo"}</function>.')
    assert not takes('<function=add>{"b": 1}</function>'), name  # the body follows the schema
    assert not takes('<function=add>{"a":1}</function>'), name  # compact JSON, as the JSON kinds
    assert not takes("<function=subtract>"), name  # the trigger must begin one of the structures
    assert not takes('<function=add>{"a": 1} done'), name  # the end is forced


def test_a_structural_tag_trigger_is_a_special_token_where_the_vocabulary_has_one_and_text_elsewhere(tmp_path):
    """Llama 3.1's <|python_tag|> and Mistral's [TOOL_CALLS] are one special token each, Qwen's <tool_call> text in
    some vocabularies: a trigger names the special token (by id) only where the vocabulary has it as one; llguidance
    would refuse <tool_call> as an unknown token, and [TOOL_CALLS] or <x y> written as names."""
    directory = tmp_path / "tokenizer"
    shutil.copytree(os.path.join(ROOT, "tests", "loading", "fixtures", "qwen_byte_level"), directory)
    with open(directory / "tokenizer.json") as f:
        spec = json.load(f)
    first = max(token["id"] for token in spec["added_tokens"]) + 1
    for offset, text in enumerate(("[TOOL_CALLS]", "<x y>")):
        spec["added_tokens"].append({"id": first + offset, "content": text, "single_word": False, "lstrip": False,
                                     "rstrip": False, "normalized": False, "special": True})  # fmt: skip
    with open(directory / "tokenizer.json", "w") as f:
        json.dump(spec, f)
    tokenizer = Tokenizer.from_model_dir(str(directory))
    assert tokenizer is not None
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    for trigger in ("<|im_start|>", "[TOOL_CALLS]", "<x y>", "<tool_call>"):
        tag = {"structures": [{"begin": trigger + "call", "schema": schema, "end": "!"}], "triggers": [trigger]}
        matcher = compiler.compile_async(GuidedDecodingParams(structural_tag=tag)).result().new_matcher()
        good = tokenizer.encode(f'hi {trigger}call{{"a": 1}}! ok', add_special_tokens=False)
        bad = tokenizer.encode(f'hi {trigger}call{{"a": "x"}}! ok', add_special_tokens=False)
        assert (tokenizer.token_to_id(trigger) is not None) == (trigger != "<tool_call>")  # special, text
        assert matcher.num_acceptable_tokens(good) == len(good), trigger
        assert matcher.num_acceptable_tokens(bad) < len(bad), trigger
