"""Tool-call parsers per family: replies parsed into calls (or left as text), streams held back only where
a call may begin, and each family's grammar accepting exactly its own format (checked with llguidance over
a byte-level tokenizer, so any text can be spelled)."""

import json

import pytest
from llguidance import LLMatcher, LLTokenizer
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from tokenizers.pre_tokenizers import ByteLevel

from jaxserve.server.tool_parsers import parser_name_for_template, tool_parser
from jaxserve.server.tool_parsers.stream import ToolCallHoldback

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters: any object


def test_hermes_parses_calls_and_keeps_the_text_around_them():
    text = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    reply = tool_parser("hermes").parse(text)
    assert reply.content == "Let me look.\n"  # unstripped, as vLLM's hermes and as the stream sent it
    [call] = reply.tool_calls
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert call.id.startswith("call_") and len(call.id) > 10
    assert call.openai()["type"] == "function" and call.openai()["function"]["arguments"] == call.arguments


def test_hermes_reads_several_calls_and_an_unclosed_last_one():
    text = (
        '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n'
        '<tool_call>\n{"name": "b", "arguments": {"x": 1}}'  # EOS before the closing tag
    )
    reply = tool_parser("hermes").parse(text)
    assert [c.name for c in reply.tool_calls] == ["a", "b"] and reply.content is None
    assert len({c.id for c in reply.tool_calls}) == 2  # every call its own id


@pytest.mark.parametrize(
    "text",
    [
        "no calls here",
        "<tool_call>\n{not json}\n</tool_call>",
        '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
        '<tool_call>\n{"name": "a", "arguments": [1]}\n</tool_call>',  # arguments not an object
    ],
)
def test_hermes_leaves_a_reply_without_valid_calls_as_text(text):
    reply = tool_parser("hermes").parse(text)
    assert reply.tool_calls == () and reply.content == text.strip()


def test_llama3_json_parses_the_whole_reply_as_calls():
    parser = tool_parser("llama3_json")
    reply = parser.parse('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}')
    assert [(c.name, json.loads(c.arguments)) for c in reply.tool_calls] == [("get_weather", {"city": "Oslo"})]
    two = parser.parse('{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"y": 2}}')
    assert [c.name for c in two.tool_calls] == ["a", "b"]
    assert parser.parse('{"answer": 42}').tool_calls == ()  # JSON content is not a call
    assert parser.parse('It is {"name": "a"}').content == 'It is {"name": "a"}'


def test_mistral_parses_the_marked_list_and_an_unmarked_one():
    parser = tool_parser("mistral")
    reply = parser.parse('Sure [TOOL_CALLS][{"name": "a", "arguments": {"q": "x"}}, {"name": "b", "arguments": {}}]')
    assert reply.content == "Sure " and [c.name for c in reply.tool_calls] == ["a", "b"]
    # [TOOL_CALLS] is a special token, dropped from the detokenized text
    assert [c.name for c in parser.parse(' [{"name": "a", "arguments": {}}]').tool_calls] == ["a"]
    assert parser.parse("[1, 2, 3]").tool_calls == ()
    assert parser.parse('[TOOL_CALLS][{"name": "a", "arguments": {}}] trailing').tool_calls == ()


@pytest.mark.parametrize(
    "template,expected",
    [
        ("{% for t in tools %}<tool_call>{% endfor %}", "hermes"),
        ("[AVAILABLE_TOOLS] ... [TOOL_CALLS]", "mistral"),
        ("{{- '<|python_tag|>' }}", "llama3_json"),
        ("{% if message.role == 'ipython' %}", "llama3_json"),
        ("{{ messages }}", "hermes"),  # cannot be told: the fallback
    ],
)
def test_auto_tells_the_family_from_the_template(template, expected):
    assert parser_name_for_template(template) == expected
    assert tool_parser("auto", template).name == expected


def test_an_unknown_parser_name_is_refused():
    with pytest.raises(ValueError, match="tool_call_parser"):
        tool_parser("qwen_xml")


def feed_all(parser_name: str, pieces: list[str]) -> tuple[str, list]:
    holdback = ToolCallHoldback(tool_parser(parser_name))
    passed = [holdback.feed(piece) for piece in pieces]
    rest, reply = holdback.finish()
    return "".join(passed) + rest, passed, list(reply.tool_calls)


def test_a_stream_passes_text_on_until_a_call_may_begin():
    pieces = ["Hello", " there <tool", "_call>\n", '{"name": "a", "arguments": {}}', "\n</tool_call>"]
    text, passed, calls = feed_all("hermes", pieces)
    assert passed[0] == "Hello"  # nothing like a marker: passed on at once
    assert passed[1] == " there "  # "<tool" could begin the marker: held
    assert passed[2:] == ["", "", ""]
    assert text.strip() == "Hello there" and [c.name for c in calls] == ["a"]


def test_held_text_that_is_no_call_is_passed_on_at_the_end():
    text, passed, calls = feed_all("hermes", ["a <tool", "box> b"])
    assert calls == [] and text == "a <toolbox> b"
    text, passed, calls = feed_all("llama3_json", ["  {", '"x": 1}'])
    assert passed == ["  ", ""] and calls == [] and text == '  {"x": 1}'  # from the brace on: held


def test_llama3_holds_back_only_a_reply_that_begins_like_a_call():
    text, passed, calls = feed_all("llama3_json", ["Sure, ", "{json} later"])
    assert passed == ["Sure, ", "{json} later"] and calls == []
    text, passed, calls = feed_all("llama3_json", ['{"name": "a", ', '"parameters": {"k": 1}}'])
    assert passed == ["", ""] and text == "" and [json.loads(c.arguments) for c in calls] == [{"k": 1}]


@pytest.fixture(scope="module")
def byte_tokenizer() -> LLTokenizer:
    # one token per byte (plus an EOS), so any text spells out and every grammar decision is visible
    vocab = {c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}
    vocab["</s>"] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["</s>"])
    return LLTokenizer(tokenizer.to_str(), eos_token=vocab["</s>"])


def accepts(tokenizer: LLTokenizer, grammar: str, text: str) -> bool:
    matcher = LLMatcher(tokenizer, LLMatcher.grammar_from_lark(grammar), log_level=0)
    return matcher.consume_tokens(tokenizer.tokenize_str(text)) and matcher.is_accepting()


GRAMMAR_CASES = {
    "hermes": (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n</tool_call>',
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
        "\n",
    ),
    "llama3_json": (
        '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "c"}}',
        '{"name": "get_time", "parameters": {}}',
        "; ",
    ),
    "mistral": (
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}]',
        '[TOOL_CALLS][{"name": "get_time", "arguments": {}}]',
        None,
    ),
}


@pytest.mark.parametrize("name", sorted(GRAMMAR_CASES))
def test_each_grammar_accepts_its_format_and_nothing_invalid(byte_tokenizer, name):
    parser = tool_parser(name)
    weather, time_call, separator = GRAMMAR_CASES[name]
    grammar = parser.grammar([WEATHER, TIME], parallel=True)
    is_error, messages = LLMatcher.validate_grammar_with_warnings(LLMatcher.grammar_from_lark(grammar), byte_tokenizer)
    assert not is_error, messages
    assert accepts(byte_tokenizer, grammar, weather) and accepts(byte_tokenizer, grammar, time_call)
    for text in (weather, time_call):
        assert [c.name for c in parser.parse(text).tool_calls] in (["get_weather"], ["get_time"])
    assert not accepts(byte_tokenizer, grammar, weather.replace("get_weather", "get_wether"))  # unknown function
    assert not accepts(byte_tokenizer, grammar, weather.replace('"c"', '"kelvin"'))  # outside the schema
    assert not accepts(byte_tokenizer, grammar, "Sure!")  # text instead of a call
    if separator is not None:  # several calls only with parallel
        both = weather + separator + time_call
        assert accepts(byte_tokenizer, grammar, both) and len(parser.parse(both).tool_calls) == 2
        assert not accepts(byte_tokenizer, parser.grammar([WEATHER, TIME], parallel=False), both)
    only_time = parser.grammar([TIME], parallel=False)  # a named function
    assert accepts(byte_tokenizer, only_time, time_call) and not accepts(byte_tokenizer, only_time, weather)


def test_hermes_reads_a_closing_tag_inside_a_string_as_text_of_the_string():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "a</tool_call>b"}}\n</tool_call>'
    reply = tool_parser("hermes").parse(text)
    assert reply.content is None and [json.loads(c.arguments) for c in reply.tool_calls] == [{"city": "a</tool_call>b"}]


@pytest.mark.parametrize(
    "name,text",
    [
        ("hermes", '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "a", "argu'),
        ("hermes", '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool'),  # cut in the next tag
        ("llama3_json", '{"name": "a", "parameters": {}}; {"name": "a", "parameters": {"k": "v'),
        ("hermes", '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n'),  # cut after the tag
        ("hermes", '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>'),
        ("mistral", '[TOOL_CALLS][{"name": "a", "arguments": {}}, {"name": "a", "argu'),
        ("mistral", '[TOOL_CALLS][{"name": "a", "arguments": {}}, '),
    ],
)
def test_complete_calls_before_a_cut_one_are_the_reply(name, text):
    """max_tokens cutting the second of parallel calls left no calls at all before (the markup as content)."""
    reply = tool_parser(name).parse(text)
    assert [c.name for c in reply.tool_calls] == ["a"] and reply.content is None
    if name == "hermes":  # a broken call that is not the last, or a closed one, is no cut: the reply is text
        broken = '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>{oops}</tool_call>'
        assert tool_parser(name).parse(broken).tool_calls == ()
        assert tool_parser(name).parse(broken + text).tool_calls == ()


def test_a_call_must_name_one_of_the_requests_functions():
    """With the request's tools known (plan_tools binds them), JSON that has a "name" is a call only of a declared
    function: a reply in a response_format with a name field is not a call of "Mike"."""
    for name, text in (
        ("llama3_json", '{"name": "Mike", "age": 3}'),
        ("hermes", '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>'),
        ("mistral", '[TOOL_CALLS][{"name": "rm_rf", "arguments": {}}]'),
    ):
        bound = tool_parser(name).for_tools([WEATHER, TIME])
        assert bound.parse(text).tool_calls == () and bound.parse(text).content == text
        assert tool_parser(name).names is None  # the server's parser itself is left unbound
    bound = tool_parser("llama3_json").for_tools([WEATHER])
    assert [c.name for c in bound.parse('{"name": "get_weather", "parameters": {"city": "x"}}').tool_calls] == [
        "get_weather"
    ]


def test_tool_parameters_with_local_references_constrain_the_arguments(byte_tokenizer):
    """$defs (pydantic's pydantic_function_tool writes them) and "#" (a recursive tree) point into the parameters
    wherever the call's schema embeds them: refused before ($defs), or the wrapper's own schema ("#")."""
    tree = {
        "type": "function",
        "function": {
            "name": "make_tree",
            "parameters": {
                "type": "object",
                "properties": {
                    "unit": {"$ref": "#/$defs/Unit"},
                    "kids": {"type": "array", "items": {"$ref": "#"}},
                    "tag": {"const": {"$ref": "#/not/a/reference"}},
                    "default": {"$ref": "#/$defs/Unit"},  # a property named as a data keyword holds a schema
                },
                "required": ["unit"],
                "additionalProperties": False,
                "$defs": {"Unit": {"enum": ["c", "f"]}},
            },
        },
    }
    for name, key in (("hermes", "arguments"), ("llama3_json", "parameters")):
        grammar = tool_parser(name).grammar([TIME, tree], parallel=False)
        is_error, messages = LLMatcher.validate_grammar_with_warnings(
            LLMatcher.grammar_from_lark(grammar), byte_tokenizer
        )
        assert not is_error, messages
        wrap = (lambda call: f"<tool_call>\n{call}\n</tool_call>") if name == "hermes" else (lambda call: call)
        good = json.dumps({"name": "make_tree", key: {"unit": "c", "kids": [{"unit": "f", "kids": []}]}})
        assert accepts(byte_tokenizer, grammar, wrap(good))
        assert not accepts(byte_tokenizer, grammar, wrap(good.replace('"f"', '"k"')))  # outside $defs' enum
        nested_call = json.dumps({"name": "make_tree", key: {"unit": "c", "kids": [{"name": "make_tree"}]}})
        assert not accepts(byte_tokenizer, grammar, wrap(nested_call))  # "#" is the parameters, not the call
        tagged = json.dumps({"name": "make_tree", key: {"unit": "c", "tag": {"$ref": "#/not/a/reference"}}})
        assert accepts(byte_tokenizer, grammar, wrap(tagged))  # data is left as it is


def test_arguments_that_strict_json_cannot_write_are_no_call():
    """1e999 reads as inf, which json.dumps wrote as Infinity (clients' JSON.parse refuses it)."""
    for text in ('{"name": "a", "parameters": {"x": 1e999}}', '{"name": "a", "parameters": {"x": NaN}}'):
        assert tool_parser("llama3_json").parse(text).tool_calls == ()


def test_json_nested_past_pythons_stack_is_a_value_error():
    """5000 nested brackets made json.loads raise RecursionError: gRPC answered UNKNOWN with a traceback."""
    from jaxserve.host.request import GuidedDecodingParams
    from jaxserve.proto import jaxserve_pb2 as pb
    from jaxserve.server.grpc_chat import tools_from_proto
    from jaxserve.server.sampling_proto import guided_decoding_from_proto
    from jaxserve.server.tool_choice import template_messages

    deep = "[" * 5000 + "]" * 5000
    with pytest.raises(ValueError, match="nested too deeply"):
        guided_decoding_from_proto(pb.GuidedDecoding(json_schema=deep))
    with pytest.raises(ValueError, match="nested too deeply"):
        tools_from_proto([deep])
    call = {"id": "c", "type": "function", "function": {"name": "a", "arguments": deep}}
    with pytest.raises(ValueError, match="nested too deeply"):
        template_messages([{"role": "assistant", "content": None, "tool_calls": [call]}])
    with pytest.raises(ValueError, match="not JSON data"):
        GuidedDecodingParams(json={"enum": {1, 2}})
    assert tool_parser("hermes").parse("<tool_call>\n" + deep).tool_calls == ()
