"""Issue 24's request fields through the router, in front of a stand-in replica that keeps what it receives
(tests/support/fake_replica.py), on the llama_gqa fixture given a chat template that shows tools and says
"<tool_call>" (so tool_call_parser auto reads Hermes calls):

- the HTTP API forwards every sampling field (penalties, logit_bias, bad words, allowed ids, guided JSON,
  and the grammar a tool_choice "required" adds), and parses the replies' tool calls;
- a gRPC Chat goes on unchanged, its prompt rendered with the tools to route it; the router refuses a bad
  tool_choice itself;
- in disaggregated mode a Chat carries tool_choice's grammar to the decode replica and its calls are parsed
  on the router.
"""

import json
import os
import urllib.error
import urllib.request

import grpc
import pytest

from jaxserve.client import Client
from jaxserve.client_requests import build_chat_request
from jaxserve.loading.model_source import open_model
from jaxserve.proto import jaxserve_pb2 as pb
from jaxserve.router.config import parse_config
from jaxserve.router.disaggregated import DisaggregatedRouterService
from jaxserve.router.launcher import free_port
from jaxserve.router.server import RouterServer
from jaxserve.router.service import RouterService
from jaxserve.server.grpc_chat import checked_chat
from jaxserve.server.limits import RequestLimits
from tests.support.fake_replica import FakeReplica
from tests.support.fixtures import fixture_dir

TEMPLATE = (
    "{% if tools %}tools:{% for t in tools %} {{ t.function.name }}{% endfor %} <tool_call>\n{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}bot:{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
ASK = [{"role": "user", "content": "Weather in Oslo?"}]
CALL_TEXTS = ('<tool_call>{"name": "get_weather", ', '"arguments": {"city": "Oslo"}}</tool_call>')
SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """llama_gqa's files, and a chat template that renders tools."""
    directory = tmp_path_factory.mktemp("templated_model")
    source = fixture_dir("llama_gqa")
    for name in os.listdir(source):
        os.symlink(os.path.join(source, name), directory / name)
    (directory / "chat_template.jinja").write_text(TEMPLATE)
    return str(directory)


@pytest.fixture(scope="module")
def routed(model_dir):
    replica = FakeReplica(model_dir).start()
    router = RouterServer(
        parse_config(
            {
                "model": {"path": model_dir},
                "router": {"port": 0, "http_port": free_port(), "heartbeat": 0.2, "startup_timeout": 30},
                "replicas": [replica.address],
            }
        )
    )
    try:
        router.start()
        yield replica, router
    finally:
        router.stop()
        replica.stop()


@pytest.fixture
def replica(routed):
    replica, _ = routed
    replica.received.clear()
    replica.reply_texts, replica.finish_reason = ("a", "b"), "length"
    return replica


def post(router, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{router.http_server.port}{path}",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_the_http_api_forwards_every_sampling_field(routed, replica):
    _, router = routed
    body = {
        "prompt": [1, 2, 3],
        "max_tokens": 2,
        "seed": 7,
        "logit_bias": {"9": 5.5, "11": -100},
        "presence_penalty": 0.5,
        "frequency_penalty": 0.25,
        "repetition_penalty": 1.3,
        "min_tokens": 1,
        "bad_words": ["zebra"],
        "allowed_token_ids": [5, 6, 9, 11],
        "guided_json": SCHEMA,
    }
    status, answer = post(router, "/v1/completions", body)
    assert status == 200, answer
    (forwarded,) = replica.received
    sampling = forwarded.sampling
    assert dict(sampling.logit_bias) == {9: 5.5, 11: -100.0}
    assert (sampling.presence_penalty, sampling.frequency_penalty) == (0.5, 0.25)
    assert sampling.repetition_penalty == pytest.approx(1.3)
    assert (sampling.min_tokens, list(sampling.bad_words), list(sampling.allowed_token_ids)) == (
        1,
        ["zebra"],
        [5, 6, 9, 11],
    )
    assert sampling.seed == 7
    assert json.loads(sampling.guided_decoding.json_schema) == SCHEMA


def test_an_http_chat_with_required_tools_carries_the_grammar_and_comes_back_as_calls(routed, replica):
    _, router = routed
    replica.reply_texts, replica.finish_reason = CALL_TEXTS, "stop"
    body = {"messages": ASK, "tools": [WEATHER], "tool_choice": "required", "max_tokens": 32}
    status, answer = post(router, "/v1/chat/completions", body)
    assert status == 200, answer
    (forwarded,) = replica.received
    assert forwarded.sampling.guided_decoding.grammar  # the Hermes calls' grammar
    prompt = open_model(router.config.model_path).tokenizer.decode(list(forwarded.token_ids))
    assert "tools: get_weather <tool_call>" in prompt  # rendered with the tools
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Oslo"}


def test_an_http_chat_with_response_format_carries_its_schema(routed, replica):
    _, router = routed
    response_format = {"type": "json_schema", "json_schema": {"name": "reply", "schema": SCHEMA}}
    status, answer = post(
        router, "/v1/chat/completions", {"messages": ASK, "max_tokens": 4, "response_format": response_format}
    )
    assert status == 200, answer
    (forwarded,) = replica.received
    assert json.loads(forwarded.sampling.guided_decoding.json_schema) == SCHEMA


def test_a_grpc_chat_goes_on_unchanged_and_a_bad_tool_choice_stops_at_the_router(routed, replica):
    _, router = routed
    client = Client(f"127.0.0.1:{router.port}")
    try:
        request = build_chat_request(ASK, tools=[WEATHER], tool_choice="required", max_tokens=8, logit_bias={9: 2.0})
        list(client.stub.Chat(request, timeout=30))
        (forwarded,) = replica.received
        assert forwarded == request  # the replica renders, applies the grammar and parses the calls itself
        with pytest.raises(grpc.RpcError) as error:
            client.chat(ASK, tools=[WEATHER], tool_choice={"function": {"name": "get_time"}}, max_tokens=8)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "get_time" in error.value.details()
        assert len(replica.received) == 1
    finally:
        client.close()


def _service(kind, model_dir):
    source = open_model(model_dir)
    limits = RequestLimits.for_engine(128, source.config.vocab_size)
    if kind is RouterService:
        return RouterService([], None, source.tokenizer, limits, None, 8, 0)
    return DisaggregatedRouterService([], [], None, source.tokenizer, limits, None, 8, 0, 1.0)


def test_a_chat_is_routed_by_its_prompt_rendered_with_the_tools(model_dir):
    """The prefix the policy looks up is the one a replica renders (tools and all), not the chat without them."""
    service = _service(RouterService, model_dir)
    routes = []
    service._serve = lambda method, request, route, context: iter(routes.append(route) or ())
    request = build_chat_request(ASK, tools=[WEATHER], max_tokens=8)
    list(service.Chat(request, None))
    with_tools = checked_chat(request, service.tokenizer, service.limits, None, "auto")[0]
    without_tools = checked_chat(build_chat_request(ASK, max_tokens=8), service.tokenizer, service.limits, None, "auto")
    assert routes[0].token_ids == with_tools != without_tools[0]


def test_a_disaggregated_chat_sends_the_tool_grammar_and_parses_the_calls(model_dir):
    service = _service(DisaggregatedRouterService, model_dir)
    sent = []

    def serve(method, request, route, context):
        sent.append(request)
        yield pb.GenerateResponse(token_ids=[5], text=CALL_TEXTS[0])
        yield pb.GenerateResponse(token_ids=[6], text=CALL_TEXTS[1], finish_reason="stop")

    service._serve = serve
    request = build_chat_request(ASK, tools=[WEATHER], tool_choice="required", max_tokens=8)
    responses = list(service.Chat(request, None))
    assert sent[0].sampling.guided_decoding.grammar and not request.sampling.HasField("guided_decoding")
    last = responses[-1]
    assert last.finish_reason == "tool_calls"
    assert [(c.name, json.loads(c.arguments)) for c in last.tool_calls] == [("get_weather", {"city": "Oslo"})]
