"""Tool calling end to end, through the real openai client and the gRPC client, on a random tiny model:
its text is noise, so where a call must come back (tool_choice "required" or a named function) the
grammar alone makes it one, and the test checks that it parses and fits the tool's schema."""

import json

import openai
import pytest

from jaxserve.client import Client
from tests.support.openai_harness import error_of, http, openai_client
from tests.support.server_harness import ServerProcess

# Says "<tool_call>" (so server.tool_call_parser auto picks hermes) and refuses arguments left as JSON text:
# templates write a call's arguments as an object.
TOOLS_TEMPLATE = (
    "{% if tools %}tools:{% for t in tools %} {{ t.function.name }}{% endfor %} <tool_call>\n{% endif %}"
    "{% for m in messages %}{{ m.role }}: "
    "{% for c in m.tool_calls or [] %}{% if c.function.arguments is string %}"
    "{{ raise_exception('arguments as text') }}{% endif %}{{ c.function.name }}{{ c.function.arguments | tojson }}"
    "{% endfor %}{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}bot:{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Oslo", "Lima"]}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}},
}
ASK = [{"role": "user", "content": "Weather in Oslo?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    process = ServerProcess(
        tmp_path_factory.mktemp("tools"),
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


def check_weather_call(call) -> None:
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    assert arguments["city"] in ("Oslo", "Lima") and arguments["unit"] in ("c", "f") and len(arguments) == 2


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_required_tool_choice_always_returns_a_valid_call(client, seed):
    reply = client.chat.completions.create(
        model="llama_gqa",
        messages=ASK,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=1.0,
        seed=seed,
        max_tokens=120,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls
    check_weather_call(call)


def test_a_named_function_streams_as_delta_tool_calls(client):
    chunks = list(
        client.chat.completions.create(
            model="llama_gqa",
            messages=ASK,
            tools=[WEATHER, CLOCK],
            tool_choice={"type": "function", "function": {"name": "get_time"}},
            temperature=1.0,
            seed=5,
            max_tokens=60,
            stream=True,
        )
    )
    deltas = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert deltas, chunks
    first = deltas[0][0]
    assert first.index == 0 and first.id.startswith("call_") and first.function.name == "get_time"
    arguments = "".join(d[0].function.arguments or "" for d in deltas)  # as the SDK accumulates them
    assert json.loads(arguments) == {}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_tools_and_tool_results_render_through_the_template(client):
    def prompt_tokens(**options) -> int:
        reply = client.chat.completions.create(model="llama_gqa", max_tokens=1, temperature=0.0, **options)
        return reply.usage.prompt_tokens

    plain = prompt_tokens(messages=ASK)
    with_tools = prompt_tokens(messages=ASK, tools=[WEATHER], tool_choice="none")
    assert with_tools > plain  # the template got the tools even though no call may come back
    assert prompt_tokens(messages=ASK, tools=[WEATHER], tool_choice="auto") == with_tools
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    conversation = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12 C"},
    ]
    # the template raises on arguments left as text: 200 means they arrived as an object
    assert prompt_tokens(messages=conversation, tools=[WEATHER]) > with_tools


@pytest.mark.parametrize(
    "body,reason",
    [
        ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools[0]: a tool needs a function name"),
        ({"tools": [WEATHER, WEATHER]}, "'get_weather' is used by two tools"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "'nope', which is not among the tools",
        ),
        ({"tool_choice": "required"}, "needs tools"),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "combined"),
        ({"functions": [{"name": "f"}]}, "use tools"),
    ],
)
def test_bad_tools_are_400_before_anything_runs(server, body, reason):
    status, _, answer = http(server, "POST", "/v1/chat/completions", {"model": "llama_gqa", "messages": ASK, **body})
    assert status == 400 and reason in error_of(answer)["message"], answer


def test_the_openai_client_sees_the_refusal(client):
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        client.chat.completions.create(
            model="llama_gqa",
            messages=ASK,
            tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "get_time"}},
        )


def test_grpc_chat_returns_the_calls_on_the_last_message(server):
    client = Client(server.target)
    try:
        completion = client.chat(
            ASK, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, seed=7, max_tokens=120
        )
    finally:
        client.close()
    assert completion.finish_reason == "tool_calls", completion
    [call] = completion.tool_calls
    assert call["id"].startswith("call_") and call["function"]["name"] == "get_weather"
    assert set(json.loads(call["function"]["arguments"])) == {"city", "unit"}
