"""/v1/responses through the real openai client (client.responses.create, streamed and not, and the
client.responses.stream helper) on a random tiny model: greedy text equals the chat completion's for the same
messages, json_schema and tool_choice constrain it as they do chat's, the refusals are 400s naming the field
(the store and previous_response_id: test_openai_responses_store.py).
The reasoning item is checked with no engine, on a scripted <think> reply (test_think_reasoning.py's)."""

import asyncio
import json
import time
from http.client import HTTPConnection
from types import SimpleNamespace

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from jaxserve.server.openai.chat import ChatCall
from jaxserve.server.openai.responses_api import ResponsesAnswer
from jaxserve.server.openai.responses_request import ResponsesRequest, chat_request
from jaxserve.server.reasoning_parsers import reasoning_parser
from jaxserve.server.tool_choice import NO_TOOLS, plan_tools
from jaxserve.server.tool_parsers import tool_parser
from tests.server import test_chat_tool_stream
from tests.server.test_gpt_oss_reasoning import ScriptedGroup, byte_level_tokenizer
from tests.server.test_openai_structured import SCHEMA, check_schema
from tests.server.test_openai_tools import CLOCK, TOOLS_TEMPLATE, WEATHER
from tests.server.test_think_reasoning import ANSWER, THINKING, prompt
from tests.support.openai_harness import error_of, http, openai_client
from tests.support.server_harness import ServerProcess

MODEL = "llama_gqa"
ASK = "Weather in Oslo?"
# Responses' function tools are flat: name and parameters beside the type
WEATHER_TOOL = {"type": "function", **WEATHER["function"]}
CLOCK_TOOL = {"type": "function", **CLOCK["function"]}
GREEDY = {"temperature": 0.0, "max_output_tokens": 12}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    process = ServerProcess(
        tmp_path_factory.mktemp("responses"),
        engine={"max_num_seqs": 4, "max_model_len": 256},
        server={"chat_template": TOOLS_TEMPLATE},
    )
    process.wait_until_serving()
    yield process
    assert process.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    with openai_client(server) as client:
        yield client


def chat_text(client, messages: list, max_tokens: int = 12) -> tuple[str, str, int]:
    reply = client.chat.completions.create(model=MODEL, messages=messages, temperature=0.0, max_tokens=max_tokens)
    return reply.choices[0].message.content, reply.choices[0].finish_reason, reply.usage.prompt_tokens


def check_against_chat(response, chat: tuple[str, str, int]) -> None:
    text, finish_reason, prompt_tokens = chat
    assert response.output_text == text and text
    assert response.status == ("incomplete" if finish_reason == "length" else "completed")
    assert response.usage.input_tokens == prompt_tokens
    assert response.usage.total_tokens == prompt_tokens + response.usage.output_tokens


def test_a_string_input_answers_as_chat_does(client):
    response = client.responses.create(model=MODEL, input=ASK, **GREEDY)
    check_against_chat(response, chat_text(client, [{"role": "user", "content": ASK}]))
    assert response.id.startswith("resp_") and response.object == "response" and response.model == MODEL
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert [part.type for part in message.content] == ["output_text"] and message.content[0].annotations == []
    assert response.max_output_tokens == 12 and response.temperature == 0.0 and response.tools == []
    assert response.usage.output_tokens_details.reasoning_tokens == 0


def test_instructions_are_a_system_message_first(client):
    response = client.responses.create(model=MODEL, input=ASK, instructions="Be brief.", **GREEDY)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": ASK}]
    check_against_chat(response, chat_text(client, messages))
    assert response.instructions == "Be brief."


def test_a_list_of_messages_with_parts_is_the_conversation(client):
    items = [
        {"role": "developer", "content": "Answer in French."},
        {"role": "user", "content": [{"type": "input_text", "text": "Hello"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Bonjour"}]},
        {"role": "user", "content": [{"type": "input_text", "text": "Weather"}, {"type": "input_text", "text": "?"}]},
    ]
    messages = [
        {"role": "developer", "content": "Answer in French."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Bonjour"},
        {"role": "user", "content": [{"type": "text", "text": "Weather"}, {"type": "text", "text": "?"}]},
    ]
    check_against_chat(client.responses.create(model=MODEL, input=items, **GREEDY), chat_text(client, messages))


def test_max_output_tokens_cuts_the_response_as_incomplete(client):
    response = client.responses.create(
        model=MODEL, input=ASK, max_output_tokens=3, temperature=0.0, extra_body={"ignore_eos": True}
    )
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3 and response.output[0].status == "incomplete"


def test_streamed_events_come_in_order_and_add_up_to_the_whole_response(client):
    options = {"model": MODEL, "input": ASK, "temperature": 0.0, "max_output_tokens": 20}
    whole = client.responses.create(**options)
    events = list(client.responses.create(**options, stream=True))
    kinds = [event.type for event in events]
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert deltas  # (the engine may send a fast reply's tokens as one delta: the scripted test below sends many)
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * len(deltas),
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert "".join(deltas) == whole.output_text == events[-4].text == events[-2].item.content[0].text
    completed = events[-1].response
    assert completed.output_text == whole.output_text and completed.status == whole.status
    assert completed.id == events[0].response.id and events[0].response.status == "in_progress"
    assert completed.usage.output_tokens == whole.usage.output_tokens
    with client.responses.stream(**options) as stream:  # the SDK's helper accumulates the same events
        helper_deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(helper_deltas) == final.output_text == whole.output_text


@pytest.mark.parametrize("seed", [1, 2])
def test_a_json_schema_format_yields_json_that_fits(client, seed):
    response = client.responses.create(
        model=MODEL,
        input="colour?",
        text={"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA, "strict": True}},
        temperature=1.0,
        max_output_tokens=60,
        extra_body={"seed": seed},
    )
    assert response.status == "completed" and response.text.format.type == "json_schema"
    check_schema(response.output_text)


def test_a_tool_call_and_its_output_make_a_round_trip(client):
    # one call: where the grammar lets more follow, a random-weight model sampled at temperature 1 runs on to
    # max_output_tokens in ~40% of the draws (the seed, not the code, decided whether this passed)
    first = client.responses.create(
        model=MODEL,
        input=ASK,
        tools=[WEATHER_TOOL],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=1.0,
        max_output_tokens=120,
    )
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) >= 1 and first.status == "completed", first.output
    call = calls[0]
    assert call.call_id.startswith("call_") and call.id.startswith("fc_") and call.name == "get_weather"
    arguments = json.loads(call.arguments)
    assert arguments["city"] in ("Oslo", "Lima") and arguments["unit"] in ("c", "f")
    follow_up = [
        {"role": "user", "content": ASK},
        *[item.model_dump(exclude_none=True) for item in first.output],  # the output fed back, as clients do
        {"type": "function_call_output", "call_id": call.call_id, "output": "12 C"},
    ]
    second = client.responses.create(model=MODEL, input=follow_up, tools=[WEATHER_TOOL], **GREEDY)
    # the template raises on arguments left as text: an answer means the call arrived as the assistant's object
    assert second.usage.input_tokens > first.usage.input_tokens and second.output[0].type in (
        "message",
        "function_call",
    )
    assert second.tools[0].name == "get_weather"


def test_a_streamed_named_function_call_comes_as_its_events(client):
    options = {
        "model": MODEL,
        "input": ASK,
        "tools": [WEATHER_TOOL, CLOCK_TOOL],
        "tool_choice": {"type": "function", "name": "get_time"},
        "temperature": 1.0,
        "max_output_tokens": 60,
    }
    events = list(client.responses.create(**options, stream=True))
    kinds = [event.type for event in events]
    start = kinds.index("response.output_item.added")
    assert events[start].item.type == "function_call" and events[start].item.name == "get_time"
    assert kinds[start:] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    done = events[start + 3].item
    assert json.loads(done.arguments) == json.loads(events[start + 1].delta) and done.call_id.startswith("call_")
    assert events[-1].response.output[0].call_id == done.call_id
    with client.responses.stream(**options) as stream:  # the SDK's helper accumulates the call
        final = stream.get_final_response()
    [item] = final.output
    assert item.type == "function_call" and item.name == "get_time" and json.loads(item.arguments) == {}


@pytest.mark.parametrize(
    "body,param,reason",
    [
        ({"background": True}, "background", "background is not supported"),
        ({"conversation": "conv_1"}, "conversation", "not supported"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type", "'web_search' are not supported"),
        ({"tool_choice": {"type": "file_search"}}, "tool_choice", "tool_choice must be"),
        ({"text": {"format": {"type": "xml"}}}, "text.format", "text.format.type"),
        ({"include": ["message.output_text.logprobs"]}, "include", "not supported"),
        ({"truncation": "auto"}, "truncation", "only 'disabled'"),
        ({"max_output_tokens": 0}, "max_output_tokens", ">= 1"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
            "input[0].content[0]",
            "'input_image'",
        ),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type", "'item_reference'"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role", "role must be"),
        ({"input": [{"type": "function_call", "call_id": "c"}]}, "input[0]", "needs call_id, name and arguments"),
        ({"input": []}, "input", "input is empty"),
        ({"input": 7}, "input.str", "input"),  # (pydantic names the union member it tried first)
        ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "name": "nope"}}, None, "not among the tools"),
    ],
)
def test_what_is_not_served_is_a_400_naming_the_field(server, body, param, reason):
    status, _, answer = http(server, "POST", "/v1/responses", {"model": MODEL, "input": ASK, **body})
    error = error_of(answer)
    assert status == 400 and reason in error["message"] and error["param"] == param, answer


def test_a_client_that_leaves_a_stream_aborts_its_request(server):
    aborted = 'jaxserve_requests_total{finish_reason="abort"}'
    aborted_before = server.metric(aborted, default=0.0)
    connection = HTTPConnection("127.0.0.1", server.http_port, timeout=30)
    body = {"model": MODEL, "input": ASK, "max_output_tokens": 200, "stream": True, "ignore_eos": True}
    connection.request("POST", "/v1/responses", json.dumps(body), {"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200 and response.readline() == b"event: response.created\n"
    connection.close()  # mid-stream: about 200 tokens are still to come
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (
        server.metric(aborted, default=0.0) > aborted_before and server.metric("jaxserve_kv_pages_used") == 0
    ):
        time.sleep(0.05)
    assert server.metric(aborted) > aborted_before and server.metric("jaxserve_kv_pages_used") == 0


def test_raw_events_name_their_type_on_an_event_line(server):
    # greedy: its first 3 tokens are not the end (sampled, a seed could make them so)
    request = {"input": ASK, "max_output_tokens": 3, "stream": True, "temperature": 0}
    status, headers, raw = http(server, "POST", "/v1/responses", request)
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    blocks = [block.split("\n") for block in raw.decode().split("\n\n") if block.strip()]
    payloads = [json.loads(data.removeprefix("data: ")) for _, data in blocks]
    assert [event for event, _ in blocks] == [f"event: {payload['type']}" for payload in payloads]
    assert payloads[-1]["type"] == "response.completed" and payloads[-1]["response"]["status"] == "incomplete"
    adapter = TypeAdapter(ResponseStreamEvent)  # strictly, as the openai client's types have every field
    assert [adapter.validate_python(payload).type for payload in payloads] == [p["type"] for p in payloads]
    body = {
        "input": ASK,
        "max_output_tokens": 3,
        "tools": [WEATHER_TOOL],
        "tool_choice": "none",
        "metadata": {"a": "b"},
    }
    status, _, raw = http(server, "POST", "/v1/responses", body)
    response = Response.model_validate_json(raw)
    assert status == 200 and response.tools[0].name == "get_weather" and response.metadata == {"a": "b"}


@pytest.fixture(scope="module")
def think_tokenizer():
    """test_think_reasoning.py's: Qwen3's markers as added, non-special tokens."""
    tokenizer = byte_level_tokenizer(("<|im_start|>", "<|im_end|>"), [THINKING, ANSWER] * 5)
    tokenizer.backend.add_tokens(["<think>", "</think>"])
    return tokenizer


CONTEXT = SimpleNamespace(model_name="m", system_fingerprint="fp_test", response_model=lambda name: "m")


def scripted_call(tokenizer, pieces: list[list[int]], stream: bool) -> tuple[ChatCall, ResponsesAnswer]:
    body = ResponsesRequest(input="2 + 2?", stream=stream)
    parser = reasoning_parser("qwen3", "qwen3", tokenizer)
    group = ScriptedGroup(pieces, tokenizer)
    call = ChatCall(CONTEXT, chat_request(body), group, NO_TOOLS, parser, None, prompt(tokenizer))  # type: ignore[arg-type]
    return call, ResponsesAnswer(body, "m")


def scripted_events(call: ChatCall, answer: ResponsesAnswer) -> list:
    """The events as the openai client's own types read them (every field checked)."""

    async def gather():
        return [event async for event in answer.events(call)]

    adapter = TypeAdapter(ResponseStreamEvent)
    return [adapter.validate_json(event.split("data: ", 1)[1]) for event in asyncio.run(gather())]


def test_reasoning_is_its_own_output_item_whole_and_streamed(think_tokenizer):
    token_ids = think_tokenizer.encode(f"<think>{THINKING}</think>{ANSWER}")
    call, answer = scripted_call(think_tokenizer, [token_ids], stream=False)
    response = Response.model_validate(answer.whole(asyncio.run(call.collect())))
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == THINKING and response.output_text == ANSWER

    events = scripted_events(*scripted_call(think_tokenizer, [[token] for token in token_ids], stream=True))
    text = lambda kind: "".join(e.delta for e in events if e.type == kind)  # noqa: E731
    assert text("response.reasoning_text.delta") == THINKING and text("response.output_text.delta") == ANSWER
    assert [e.item.type for e in events if e.type == "response.output_item.added"] == ["reasoning", "message"]
    final = events[-1].response
    assert [item.type for item in final.output] == ["reasoning", "message"] and final.output_text == ANSWER
    assert final.output[0].content[0].text == THINKING and final.usage.output_tokens == len(token_ids)


def tool_call(group, stream: bool) -> tuple[ChatCall, ResponsesAnswer]:
    body = ResponsesRequest(input="?", tools=[{"type": "function", "name": "lookup"}], stream=stream)
    chat = chat_request(body)
    plan = plan_tools(chat.tools, chat.tool_choice, chat.parallel_tool_calls, tool_parser("hermes"))
    return ChatCall(CONTEXT, chat, group, plan), ResponsesAnswer(body, "m")  # type: ignore[arg-type]


def test_text_before_a_call_is_a_message_then_the_function_call():
    """test_chat_tool_stream.py's scripted reply: "Checking. " and a hermes call cut across deltas."""
    call, answer = tool_call(test_chat_tool_stream.ScriptedGroup(test_chat_tool_stream.PIECES), stream=False)
    whole = Response.model_validate(answer.whole(asyncio.run(call.collect())))
    events = scripted_events(*tool_call(test_chat_tool_stream.ScriptedGroup(test_chat_tool_stream.PIECES), True))
    streamed = events[-1].response
    for response in (whole, streamed):
        message, function_call = response.output
        assert response.output_text == "Checking. " and response.status == "completed"
        assert function_call.name == "lookup" and json.loads(function_call.arguments) == {"q": "x"}
    assert [e.type for e in events if e.type.startswith("response.function_call")] == [
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
    ]


def test_an_engine_failure_mid_stream_is_an_error_event_then_a_failed_response():
    group = test_chat_tool_stream.ScriptedGroup(["boom"], finish_reason="error")
    events = scripted_events(*tool_call(group, stream=True))
    assert [e.type for e in events] == ["response.created", "response.in_progress", "error", "response.failed"]
    assert events[2].message == "boom" and events[3].response.error.message == "boom"
