"""GPT-OSS's harmony tool calls (messages addressed to functions.NAME, ended by <|call|>) as OpenAI tool_calls,
answered whole and streamed, with no engine (token ids scripted into the chat handler as in
test_gpt_oss_reasoning.py); and the tool-call round trip through a harmony chat template."""

import asyncio
import dataclasses
import json
from types import SimpleNamespace

import pytest
from openai.types.chat import ChatCompletion

from jaxserve.loading.chat_template import render_chat
from jaxserve.server.openai.chat import ChatCall
from jaxserve.server.openai.protocol import ChatCompletionRequest
from jaxserve.server.reasoning_parsers import reasoning_parser
from jaxserve.server.reasoning_parsers.harmony import SPECIAL
from jaxserve.server.tool_choice import plan_tools, template_messages
from jaxserve.server.tool_parsers import tool_parser
from tests.server.test_gpt_oss_reasoning import ScriptedGroup, byte_level_tokenizer, streamed

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]
THINKING = "The user wants the weather in Paris: call get_weather."
ARGUMENTS = '{"city": "Paris, Île-de-France"}'
CALL = (
    f"<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{ARGUMENTS}<|call|>"
)
REPLY = f"<|channel|>analysis<|message|>{THINKING}<|end|>{CALL}"
# the recipient after the role, and a second call (parallel)
TWO_CALLS = f"{REPLY}<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{{}}<|call|>"


@pytest.fixture(scope="module")
def tokenizer():
    """Harmony's words as few tokens, as o200k_harmony has them (a header is a handful of tokens)."""
    words = "assistant analysis commentary final to=functions.get_weather to=functions.get_time json"
    return byte_level_tokenizer((*SPECIAL, "<|constrain|>"), [words] * 20 + [THINKING, ARGUMENTS])


def chat_call(tokenizer, pieces, stream: bool, tools=TOOLS, parallel=None) -> ChatCall:
    request = ChatCompletionRequest(
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        stream=stream,
        tools=tools,
        parallel_tool_calls=parallel,
    )
    plan = plan_tools(request.tools, request.tool_choice, request.parallel_tool_calls, tool_parser("hermes"))
    context = SimpleNamespace(model_name="m", system_fingerprint="fp_test", response_model=lambda name: "m")
    group = ScriptedGroup(pieces, tokenizer)
    return ChatCall(context, request, group, plan, reasoning_parser("auto", "gpt_oss", tokenizer))  # type: ignore[arg-type]


def whole(tokenizer, text: str, **options) -> ChatCompletion:
    call = chat_call(tokenizer, [tokenizer.encode(text)], stream=False, **options)
    return ChatCompletion.model_validate(asyncio.run(call.collect()))


def test_a_harmony_call_is_a_tool_call(tokenizer):
    choice = whole(tokenizer, REPLY).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None and choice.message.model_extra["reasoning_content"] == THINKING
    (call,) = choice.message.tool_calls or []
    assert (call.function.name, call.function.arguments) == ("get_weather", ARGUMENTS)  # type: ignore[union-attr]
    assert call.id.startswith("call_")


def test_parallel_calls_and_a_recipient_after_the_role(tokenizer):
    calls = whole(tokenizer, TWO_CALLS).choices[0].message.tool_calls or []
    assert [(c.function.name, c.function.arguments) for c in calls] == [  # type: ignore[union-attr]
        ("get_weather", ARGUMENTS),
        ("get_time", "{}"),
    ]
    only_first = whole(tokenizer, TWO_CALLS, parallel=False).choices[0].message.tool_calls or []
    assert [c.function.name for c in only_first] == ["get_weather"]  # type: ignore[union-attr]


def test_without_tools_a_call_stays_text(tokenizer):
    """A request with no tools gets no tool_calls (as before): the call's body is the reply's content."""
    choice = whole(tokenizer, REPLY, tools=None).choices[0]
    assert not choice.message.tool_calls and choice.finish_reason == "stop"
    assert choice.message.content == ARGUMENTS


@pytest.mark.parametrize("tokens_per_delta", [1, 4])
def test_a_streamed_call_arrives_whole_after_the_reasoning(tokenizer, tokens_per_delta):
    token_ids = tokenizer.encode(REPLY + "<|start|>assistant<|channel|>final<|message|>Checking.<|return|>")
    pieces = [token_ids[i : i + tokens_per_delta] for i in range(0, len(token_ids), tokens_per_delta)]
    chunks = streamed(chat_call(tokenizer, pieces, stream=True))
    deltas = [c.choices[0].delta for c in chunks]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == THINKING
    assert "".join(d.content or "" for d in deltas) == "Checking."  # the arguments never leak into content
    calls = [call for d in deltas for call in d.tool_calls or []]
    assert [(c.index, c.function.name, c.function.arguments) for c in calls] == [(0, "get_weather", ARGUMENTS)]  # type: ignore[union-attr]
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["tool_calls"]


def test_a_reply_cut_inside_a_call_keeps_its_length_finish(tokenizer):
    token_ids = tokenizer.encode(REPLY)[:-3]  # max_tokens stopped it inside the arguments
    call = chat_call(tokenizer, [token_ids], stream=False)
    group = call.group
    original = group.deltas

    async def cut():  # the last delta ends with "length"
        async for position, delta in original():
            yield position, dataclasses.replace(delta, finish_reason="length") if delta.finish_reason else delta

    group.deltas = cut  # type: ignore[method-assign]
    choice = ChatCompletion.model_validate(asyncio.run(call.collect())).choices[0]
    assert choice.finish_reason == "length" and (choice.message.tool_calls or [])[0].function.name == "get_weather"  # type: ignore[union-attr]


# A harmony template's tool-call branches (the shape of gpt-oss' own: the call's arguments written with tojson,
# a tool message answering the last call, the assistant's reasoning as `thinking`).
HARMONY_TEMPLATE = """
{%- set last_call = namespace(name=none) -%}
{%- for message in messages -%}
{%- if message.role == 'assistant' and message.tool_calls is defined -%}
{%- set call = message.tool_calls[0].function -%}
{%- if message.thinking is defined -%}<|start|>assistant<|channel|>analysis<|message|>{{ message.thinking }}<|end|>{%- endif -%}
<|start|>assistant to=functions.{{ call.name }}<|channel|>commentary json<|message|>{{ call.arguments|tojson }}<|call|>
{%- set last_call.name = call.name -%}
{%- elif message.role == 'tool' -%}
<|start|>functions.{{ last_call.name }} to=assistant<|channel|>commentary<|message|>{{ message.content|tojson }}<|end|>
{%- else -%}
<|start|>{{ message.role }}<|message|>{{ message.content }}<|end|>
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"""


def test_the_tool_call_round_trip_renders(tokenizer):
    """The reply's tool_calls sent back (content null, reasoning_content) and the tool's answer."""
    reply = whole(tokenizer, REPLY).choices[0].message
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        reply.model_dump(exclude_none=False),
        {"role": "tool", "tool_call_id": reply.tool_calls[0].id, "content": '{"celsius": 21}'},  # type: ignore[index]
    ]
    rendered = render_chat(tokenizer, template_messages(json.loads(json.dumps(messages))), HARMONY_TEMPLATE)
    assert rendered == (
        "<|start|>user<|message|>Weather in Paris?<|end|>"
        f"<|start|>assistant<|channel|>analysis<|message|>{THINKING}<|end|>"
        '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris, Île-de-France"}'
        "<|call|>"
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"{\\"celsius\\": 21}"<|end|>'
        "<|start|>assistant"
    )


def test_grpc_chat_reads_harmony_calls_from_the_token_ids(tokenizer):
    """gRPC Chat: the last message carries the harmony call (from the token ids: the text has lost the special
    tokens) and, as content, the final channel's text only; without the parser the call is not seen."""
    from jaxserve.proto import jaxserve_pb2 as pb
    from jaxserve.server.grpc_chat import with_tool_calls

    token_ids = tokenizer.encode(REPLY + "<|start|>assistant<|channel|>final<|message|>Checking.<|return|>")
    pieces = [token_ids[i : i + 5] for i in range(0, len(token_ids), 5)]

    def responses():
        for number, piece in enumerate(pieces):
            text = tokenizer.decode(piece, skip_special_tokens=True)
            yield pb.GenerateResponse(
                token_ids=piece, text=text, finish_reason="stop" if number == len(pieces) - 1 else ""
            )

    plan = plan_tools(TOOLS, None, None, tool_parser("hermes"))
    harmony = reasoning_parser("auto", "gpt_oss", tokenizer)
    last = list(with_tool_calls(responses(), plan, harmony))[-1]
    assert [(c.name, c.arguments) for c in last.tool_calls] == [("get_weather", ARGUMENTS)]
    assert last.finish_reason == "tool_calls" and last.content == "Checking."
    assert not list(with_tool_calls(responses(), plan))[-1].tool_calls
