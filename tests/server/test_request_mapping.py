"""Request bodies (OpenAI JSON, the gRPC proto) mapped to SamplingParams and tool plans, with no engine:
every new field lands where the engine reads it, and every malformed one is a ValueError naming it."""

import json

import pytest

from jaxserve.host.request import GuidedDecodingParams, SamplingParams
from jaxserve.proto import jaxserve_pb2 as pb
from jaxserve.server.limits import RequestLimits
from jaxserve.server.openai.protocol import ChatCompletionRequest, CompletionRequest
from jaxserve.server.sampling_proto import check_sampling, sampling_params_from_proto, sampling_params_to_proto
from jaxserve.server.tool_choice import plan_tools, template_messages
from jaxserve.server.tool_parsers import tool_parser

LIMITS = RequestLimits.for_engine(max_model_len=128, vocab_size=1000)
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TOOL = {"type": "function", "function": {"name": "lookup", "parameters": SCHEMA}}
TAG = {"structures": [{"begin": "<f=lookup>", "schema": SCHEMA, "end": "</f>"}], "triggers": ["<f="]}


def params_of(**body) -> SamplingParams:
    return CompletionRequest(prompt="x", **body).sampling_params(LIMITS, 16, None)


def test_sampling_controls_reach_sampling_params():
    params = params_of(
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        repetition_penalty=1.2,
        logit_bias={"7": 5, "3": -100},
        min_tokens=4,
        bad_words=["foo", "bar baz"],
        allowed_token_ids=[1, 2, 3],
    )
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.5, -0.25, 1.2)
    assert params.logit_bias == ((3, -100.0), (7, 5.0)) and params.min_tokens == 4
    assert params.bad_words == ("foo", "bar baz") and params.allowed_token_ids == (1, 2, 3)
    plain = params_of()
    assert (plain.presence_penalty, plain.repetition_penalty, plain.logit_bias, plain.guided_decoding) == (
        0.0,
        1.0,
        None,
        None,
    )


@pytest.mark.parametrize(
    "body,expected",
    [
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, GuidedDecodingParams(json_object=True)),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "r", "schema": SCHEMA, "strict": True},
                }
            },
            GuidedDecodingParams(json=SCHEMA),
        ),
        ({"guided_json": SCHEMA}, GuidedDecodingParams(json=SCHEMA)),
        ({"guided_json": json.dumps(SCHEMA)}, GuidedDecodingParams(json=json.dumps(SCHEMA))),  # text kept as sent
        ({"guided_regex": "[a-z]+"}, GuidedDecodingParams(regex="[a-z]+")),
        ({"guided_grammar": 'start: "yes"'}, GuidedDecodingParams(grammar='start: "yes"')),
        ({"guided_choice": ["yes", "no"]}, GuidedDecodingParams(choice=("yes", "no"))),
        ({"structured_outputs": {"regex": "\\d+"}}, GuidedDecodingParams(regex="\\d+")),
        ({"structured_outputs": {"json_object": True}}, GuidedDecodingParams(json_object=True)),
        ({"guided_decoding_backend": "llguidance", "guided_regex": "a"}, GuidedDecodingParams(regex="a")),
        (
            {"guided_json": SCHEMA, "guided_whitespace_pattern": "[ ]?"},
            GuidedDecodingParams(json=SCHEMA, whitespace_pattern="[ ]?"),
        ),
        (
            {"response_format": {"type": "json_object"}, "guided_whitespace_pattern": "\\n?"},
            GuidedDecodingParams(json_object=True, whitespace_pattern="\\n?"),
        ),
        (
            {"structured_outputs": {"json": SCHEMA, "whitespace_pattern": " ?"}},
            GuidedDecodingParams(json=SCHEMA, whitespace_pattern=" ?"),
        ),
        # vLLM's structural tag: in structured_outputs as JSON text, in response_format beside its type
        ({"structured_outputs": {"structural_tag": json.dumps(TAG)}}, GuidedDecodingParams(structural_tag=TAG)),
        ({"response_format": {"type": "structural_tag", **TAG}}, GuidedDecodingParams(structural_tag=TAG)),
    ],
)
def test_every_way_of_asking_for_structure_becomes_one_guide(body, expected):
    assert params_of(**body).guided_decoding == expected


@pytest.mark.parametrize(
    "body,reason",
    [
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "json_schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": [1]}}}, "schema"),
        ({"guided_json": "{not json"}, "not valid JSON"),
        ({"guided_choice": []}, "choice"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "give only one"),
        ({"response_format": {"type": "json_object"}, "guided_json": SCHEMA}, "give only one"),
        ({"structured_outputs": {"structural_tag": 5}}, "structural_tag"),
        ({"structured_outputs": {"structural_tag": TAG, "regex": "a"}}, "exactly one"),
        ({"guided_whitespace_pattern": " *"}, "guided_whitespace_pattern needs a JSON constraint"),
        ({"guided_regex": "a+", "guided_whitespace_pattern": " *"}, "not to guided regex"),
        ({"guided_decoding_backend": "outlines"}, "outlines"),
        ({"logit_bias": {"1000": 1}}, "outside the vocabulary"),
        ({"logit_bias": {"5": 101}}, "[-100, 100]"),
        ({"logit_bias": {"five": 1}}, "token ids"),
        ({"allowed_token_ids": [5, 4000]}, "allowed_token_ids [4000] outside the vocabulary"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_tokens": 17}, "min_tokens"),
        ({"bad_words": [""]}, "bad_words"),
        ({"guided_regex": "a" * 70_000}, "server.max_structured_bytes"),
    ],
)
def test_malformed_fields_are_refused_by_name(body, reason):
    with pytest.raises(ValueError) as refusal:
        params_of(**body)
    assert reason in str(refusal.value)


def test_tool_choice_plans():
    hermes = tool_parser("hermes")
    auto = plan_tools([TOOL], None, None, hermes)
    assert auto.tools == [TOOL] and auto.guided_decoding is None and auto.parallel
    assert isinstance(auto.parser, type(hermes)) and auto.parser.names == {"lookup"}  # bound to the request's tools
    none = plan_tools([TOOL], "none", None, hermes)
    assert none.tools == [TOOL] and none.parser is None  # the template still sees the tools
    required = plan_tools([TOOL], "required", False, hermes)
    assert required.guided_decoding is not None and required.guided_decoding.grammar == hermes.grammar([TOOL], False)
    named = plan_tools([TOOL], {"type": "function", "function": {"name": "lookup"}}, None, hermes)
    assert named.guided_decoding is not None and not named.parallel  # a named function: exactly one call
    assert plan_tools(None, "auto", None, hermes).tools is None


@pytest.mark.parametrize(
    "tools,choice,reason",
    [
        ([{"type": "function", "function": {"parameters": SCHEMA}}], None, "tools[0]: a tool needs a function name"),
        ([TOOL, TOOL], None, "tools[1]: the function name 'lookup' is used by two tools"),
        ([TOOL], {"type": "function", "function": {"name": "nope"}}, "'nope', which is not among the tools"),
        (None, "required", "needs tools"),
        ([], {"type": "function", "function": {"name": "lookup"}}, "needs tools"),
        ([TOOL], "sometimes", "tool_choice must be"),
        ([{"type": "retrieval"}], None, "only tools of type 'function'"),
        ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], None, "JSON schema object"),
    ],
)
def test_bad_tools_are_refused_by_name(tools, choice, reason):
    with pytest.raises(ValueError) as refusal:
        plan_tools(tools, choice, None, tool_parser("hermes"))
    assert reason in str(refusal.value)


def test_tool_choice_and_another_constraint_are_refused_together():
    body = ChatCompletionRequest(messages=[], response_format={"type": "json_object"})
    tool_guide = GuidedDecodingParams(grammar='start: "x"')
    with pytest.raises(ValueError, match="cannot be combined"):
        body.sampling_params(LIMITS, 16, None, tool_guide)


def test_assistant_tool_calls_reach_the_template_with_object_arguments():
    call = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": '{"a": 1}'}}
    messages = [{"role": "assistant", "content": None, "tool_calls": [call]}, {"role": "tool", "content": "2"}]
    converted = template_messages(messages)
    assert converted[0]["tool_calls"][0]["function"]["arguments"] == {"a": 1} and converted[1] == messages[1]
    assert messages[0]["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'  # the request is left as it was
    broken = {**call, "function": {"name": "lookup", "arguments": "{oops"}}
    with pytest.raises(ValueError, match="not JSON"):
        template_messages([{"role": "assistant", "tool_calls": [broken]}])


def test_sampling_params_survive_the_proto_both_ways():
    params = params_of(
        n=1,
        temperature=0.5,
        seed=3,
        presence_penalty=0.5,
        frequency_penalty=0.25,
        repetition_penalty=1.5,
        logit_bias={"9": -100},
        min_tokens=2,
        bad_words=["x"],
        allowed_token_ids=[4, 5],
        include_stop_str_in_output=True,
        skip_special_tokens=False,
        spaces_between_special_tokens=False,
        truncate_prompt_tokens=7,
    )
    assert params.include_stop_str_in_output and not params.skip_special_tokens and params.truncate_prompt_tokens == 7
    assert not params.spaces_between_special_tokens
    for guided in (
        None,
        GuidedDecodingParams(structural_tag=TAG),
        GuidedDecodingParams(json=SCHEMA),
        GuidedDecodingParams(json_object=True),
        GuidedDecodingParams(json=SCHEMA, whitespace_pattern="[ \n]{0,2}"),
        GuidedDecodingParams(json_object=True, whitespace_pattern=" ?"),
        GuidedDecodingParams(regex="a+"),
        GuidedDecodingParams(choice=("a", "b")),
        GuidedDecodingParams(grammar='start: "a"'),
    ):
        original = SamplingParams(**{**params.__dict__, "guided_decoding": guided})
        sampling = pb.SamplingParams.FromString(sampling_params_to_proto(original).SerializeToString())
        assert sampling_params_from_proto(sampling) == original


def test_proto_sampling_is_checked_against_the_limits():
    with pytest.raises(ValueError, match="outside the vocabulary"):
        check_sampling(LIMITS, pb.SamplingParams(logit_bias={5000: 1.0}))
    with pytest.raises(ValueError, match="max_sampling_token_ids"):
        check_sampling(LIMITS, pb.SamplingParams(allowed_token_ids=[1] * 1025))
    with pytest.raises(ValueError, match="not valid JSON"):
        sampling_params_from_proto(pb.SamplingParams(guided_decoding=pb.GuidedDecoding(json_schema="{")))
    with pytest.raises(ValueError, match="finite"):
        sampling_params_from_proto(pb.SamplingParams(logit_bias={1: float("nan")}))


def test_vllm_fields_the_server_does_not_honour_are_refused_not_ignored():
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], stream=True, use_beam_search=True)
    with pytest.raises(ValueError, match="use_beam_search"):
        chat.check(LIMITS, "r1")
    # the neutral value, as clients that fill every field send it, passes
    ChatCompletionRequest(messages=[], use_beam_search=False).check(LIMITS, "r1")
    with pytest.raises(ValueError, match="use_beam_search"):
        CompletionRequest(prompt="x", stream=True, use_beam_search=True).check(LIMITS, "r1")


def test_chat_echo_repeats_the_last_message_only_when_it_has_the_replys_role():
    def chat(messages, **body) -> ChatCompletionRequest:
        return ChatCompletionRequest(messages=messages, echo=True, **body)

    user, assistant = {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, I am"}
    assert chat([user]).echo_text() == ""  # the reply is the assistant's, the last message the user's
    assert chat([user, assistant]).echo_text() == "Hello, I am"
    continued = chat([user, assistant], add_generation_prompt=False, continue_final_message=True)
    assert continued.response_role == "assistant" and continued.echo_text() == "Hello, I am"
    # vLLM's: without a generation prompt the reply takes the last message's role, so its text is echoed
    assert chat([user], add_generation_prompt=False).response_role == "user"
    assert chat([user], add_generation_prompt=False).echo_text() == "Hi"
    parts = {"role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    assert chat([user, parts]).echo_text() == "a\nb"
    assert ChatCompletionRequest(messages=[user, assistant]).echo_text() == ""  # echo off


def test_token_ids_are_json_integers_not_booleans():
    with pytest.raises(ValueError):
        CompletionRequest(prompt=[True])
    with pytest.raises(ValueError):
        ChatCompletionRequest(messages=[], stop_token_ids=[False])
    assert CompletionRequest(prompt=[1, 2]).prompts() == [[1, 2]] and CompletionRequest(prompt=[[3]]).prompts() == [[3]]


@pytest.mark.parametrize("stop_reason", [None, "###", 0, 917])
def test_a_stop_reason_survives_the_wire_to_the_router(stop_reason):
    from jaxserve.router.http_api import delta_from_response
    from jaxserve.server.request_stream import Delta
    from jaxserve.server.service import response_from_delta

    delta = Delta([5], "x", None, "stop", 3, 0, stop_reason=stop_reason)
    response = response_from_delta(delta, "r")
    assert pb.GenerateResponse.FromString(response.SerializeToString()) == response
    assert delta_from_response(response).stop_reason == stop_reason


def test_tokenize_renders_messages_as_chat_completions_does():
    """/tokenize with messages passes tools, chat_template_kwargs and tool calls' arguments (as objects) to the
    template as /v1/chat/completions does (it dropped the first two and double-encoded the arguments)."""
    from types import SimpleNamespace

    from jaxserve.server.openai.app import tokenized
    from jaxserve.server.openai.protocol import TokenizeRequest
    from tests.loading.test_tokenizer import load

    template = (
        "{% for t in tools or [] %}<tool {{ t.function.name }}>{% endfor %}{{ style }}"
        "{% for m in messages %}{{ m.role }}:{{ m.content or '' }}"
        "{% for c in m.tool_calls or [] %}[{{ c.function.arguments.city }}]{% endfor %}{% endfor %}"
    )
    tokenizer = load("llama_metaspace")
    context = SimpleNamespace(tokenizer=tokenizer, limits=LIMITS, chat_template=template)
    call = {"id": "c", "type": "function", "function": {"name": "lookup", "arguments": '{"city": "Paris"}'}}
    body = TokenizeRequest(
        messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [call]}],
        tools=[TOOL],
        chat_template_kwargs={"style": "terse"},
        add_generation_prompt=False,
    )
    expected_text = "<tool lookup>terseuser:hiassistant:[Paris]"
    assert tokenized(context, body) == tokenizer.encode(expected_text, add_special_tokens=False)


@pytest.mark.parametrize("value", ["4", 2.0, 1.5, [3], {"k": 1}])
def test_a_truncate_prompt_tokens_that_is_no_integer_is_refused_by_name_on_token_ids_and_chat(value):
    """The HTTP handlers truncate token-id prompts and the rendered chat before SamplingParams checks the value:
    a string or a float there raised a TypeError (500), not a ValueError naming the field (400)."""
    from types import SimpleNamespace

    from jaxserve.server.openai.chat import checked_chat
    from jaxserve.server.openai.completions import checked_completion
    from tests.loading.test_tokenizer import load

    tokenizer = load("llama_metaspace")
    context = SimpleNamespace(
        tokenizer=tokenizer,
        limits=LIMITS,
        chat_template="{% for m in messages %}{{ m.role }}:{{ m.content }}{% endfor %}",
        ready_loop=lambda: SimpleNamespace(max_in_flight=8),
        tool_parser=lambda tools: tool_parser("hermes"),
    )
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        checked_completion(context, CompletionRequest(prompt=[5, 6, 7], truncate_prompt_tokens=value), "r1")  # type: ignore[arg-type]
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], truncate_prompt_tokens=value)
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        checked_chat(context, chat, "r1", None)  # type: ignore[arg-type]
