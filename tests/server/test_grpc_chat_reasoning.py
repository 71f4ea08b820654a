"""gRPC Chat with GPT-OSS's harmony format: each GenerateResponse carries the reasoning (analysis channel) since the
previous message in reasoning_content and only the final/commentary text in text; tool calls on the last message.
No engine: scripted token ids (a byte-level tokenizer with harmony's special tokens, as test_gpt_oss_reasoning.py)
run through GenerationService.Chat over a stand-in engine loop, gathered by the client's Completion; Generate is
left unsplit. The disaggregated router, whose decode replica answers a Generate, splits the reply itself."""

import json
from types import SimpleNamespace

import pytest

from jaxserve.client import Completion
from jaxserve.config import EngineRole
from jaxserve.loading.fast_tokenizer import FastTokenizer
from jaxserve.loading.tokenizer_config import TokenizerSettings
from jaxserve.proto import jaxserve_pb2 as pb
from jaxserve.router.disaggregated import DisaggregatedRouterService, model_reasoning_parser
from jaxserve.router.http_api import RoutedContext, RoutedLoop
from jaxserve.server.grpc_chat import with_tool_calls
from jaxserve.server.limits import RequestLimits
from jaxserve.server.reasoning_parsers import reasoning_parser
from jaxserve.server.reasoning_parsers.harmony import SPECIAL
from jaxserve.server.request_stream import Delta
from jaxserve.server.service import GenerationService
from jaxserve.server.tool_choice import NO_TOOLS
from tests.server.test_gpt_oss_reasoning import ANSWER, REPLY, THINKING, byte_level_tokenizer
from tests.server.test_gpt_oss_tool_calls import ARGUMENTS, CALL, TOOLS

TEMPLATE = (
    "{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)
TOOL_REPLY = (
    f"<|channel|>analysis<|message|>{THINKING}<|end|>{CALL}"
    "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
)


@pytest.fixture(scope="module")
def tokenizer():
    words = "assistant analysis commentary final to=functions.get_weather json"
    trained = byte_level_tokenizer((*SPECIAL, "<|constrain|>"), [words] * 20 + [THINKING, ANSWER, ARGUMENTS])
    return FastTokenizer(trained.backend, TokenizerSettings(chat_template=TEMPLATE))  # the router renders with it


class ScriptedLoop:
    """What GenerationService reads of an EngineLoop: submit() answers a stream of the scripted pieces' deltas."""

    def __init__(self, tokenizer, model_type: str = "gpt_oss"):
        self.tokenizer, self.pieces = tokenizer, []
        self.metrics = None
        self.engine = SimpleNamespace(
            tokenizer=tokenizer,
            model_config=SimpleNamespace(model_type=model_type),
            config=SimpleNamespace(disagg=SimpleNamespace(role=EngineRole.BOTH)),
        )

    def submit(self, prompt, params, request_id, session_id):
        def deltas():
            for number, token_ids in enumerate(self.pieces):
                finish = "stop" if number == len(self.pieces) - 1 else None
                text = self.tokenizer.decode(token_ids, skip_special_tokens=True)  # as the engine's detokenizer
                yield Delta(token_ids, text, None, finish, len(prompt), 0)

        return ScriptedStream(deltas(), request_id or "r")

    def release(self, stream) -> None:
        pass


class ScriptedStream:
    def __init__(self, deltas, request_id: str):
        self.deltas, self.request_id, self.on_expire = deltas, request_id, None
        self.cut_off = ""  # RequestStream's: set only when the server cut it off shutting down

    def __iter__(self):
        return self.deltas


class Context:
    def add_callback(self, callback) -> bool:
        return True

    def cancel(self) -> None:
        pass

    def abort(self, code, details):
        raise AssertionError(f"aborted: {code} {details}")


def service(tokenizer, reasoning_parser: str = "auto", model_type: str = "gpt_oss") -> GenerationService:
    served = GenerationService()
    served.attach(
        ScriptedLoop(tokenizer, model_type),  # type: ignore[arg-type]
        RequestLimits.for_engine(max_model_len=512, vocab_size=tokenizer.vocab_size),
        chat_template=TEMPLATE,
    )
    served.reasoning_parser = reasoning_parser
    return served


def run(served: GenerationService, token_ids: list[int], per_message: int, tools=()) -> list[pb.GenerateResponse]:
    served.loop.pieces = [token_ids[i : i + per_message] for i in range(0, len(token_ids), per_message)]  # type: ignore[union-attr]
    request = pb.ChatRequest(
        messages=[pb.ChatMessage(role="user", content="2 + 2?")],
        tools=[json.dumps(tool) for tool in tools],
        sampling=pb.SamplingParams(max_tokens=64),
    )
    return list(served.Chat(request, Context()))


def gathered(responses: list[pb.GenerateResponse]) -> Completion:
    completion = Completion()
    for response in responses:
        completion.add(response)
    return completion


@pytest.mark.parametrize("per_message", [1000, 1, 3])  # the whole reply in one message, then streamed
def test_chat_keeps_the_analysis_out_of_text(tokenizer, per_message):
    token_ids = tokenizer.encode(REPLY)
    responses = run(service(tokenizer), token_ids, per_message)
    completion = gathered(responses)
    assert completion.text == ANSWER  # no reasoning leaks into the text, no "\ufffd" from a cut emoji
    assert completion.reasoning_content == THINKING
    assert completion.token_ids == token_ids and completion.finish_reason == "stop"
    assert not completion.tool_calls and completion.content == ""
    if per_message == 1:  # streamed: the reasoning arrives first, message by message, then the answer
        last_reasoning = max(i for i, r in enumerate(responses) if r.reasoning_content)
        first_text = min(i for i, r in enumerate(responses) if r.text)
        assert last_reasoning < first_text and sum(bool(r.reasoning_content) for r in responses) > 5
        assert not any(r.reasoning_content and r.text for r in responses)


@pytest.mark.parametrize("per_message", [1000, 2])
def test_chat_with_tools_splits_reasoning_and_reads_the_call(tokenizer, per_message):
    responses = run(service(tokenizer), tokenizer.encode(TOOL_REPLY), per_message, TOOLS)
    completion = gathered(responses)
    assert completion.reasoning_content == THINKING
    assert completion.text == "Checking."  # neither the reasoning nor the call's arguments
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in completion.tool_calls] == [
        ("get_weather", ARGUMENTS)
    ]
    assert completion.content == "Checking." and completion.finish_reason == "tool_calls"


def test_without_a_reasoning_parser_chat_and_generate_are_unsplit(tokenizer):
    token_ids = tokenizer.encode(REPLY)
    whole_text = tokenizer.decode(token_ids, skip_special_tokens=True)
    streamed = "".join(
        tokenizer.decode(token_ids[i : i + 4], skip_special_tokens=True) for i in range(0, len(token_ids), 4)
    )
    for served in (service(tokenizer, "none"), service(tokenizer, "auto", model_type="llama")):
        completion = gathered(run(served, token_ids, 4))
        assert completion.text == streamed and completion.reasoning_content == ""  # the engine's text as it came
    served = service(tokenizer)  # a GPT-OSS server: Generate (not a chat) still returns every channel's text
    served.loop.pieces = [token_ids]  # type: ignore[union-attr]
    completion = gathered(list(served.Generate(pb.GenerateRequest(token_ids=[1, 2, 3]), Context())))
    assert completion.text == whole_text and completion.reasoning_content == ""


def test_the_disaggregated_router_splits_what_its_decode_replica_streams(tokenizer):
    limits = RequestLimits.for_engine(max_model_len=512, vocab_size=tokenizer.vocab_size)
    router = DisaggregatedRouterService([], [], None, tokenizer, limits, None, 8, 0, 1.0)
    router.reasoning = model_reasoning_parser(
        SimpleNamespace(config=SimpleNamespace(model_type="gpt_oss"), tokenizer=tokenizer)
    )
    assert (
        model_reasoning_parser(SimpleNamespace(config=SimpleNamespace(model_type="llama"), tokenizer=tokenizer)) is None
    )
    token_ids = tokenizer.encode(TOOL_REPLY)
    pieces = [token_ids[i : i + 3] for i in range(0, len(token_ids), 3)]

    def serve(method, request, route, context):  # the decode replica's Generate: every channel's text
        for number, piece in enumerate(pieces):
            text = tokenizer.decode(piece, skip_special_tokens=True)
            yield pb.GenerateResponse(
                token_ids=piece, text=text, finish_reason="stop" if number == len(pieces) - 1 else ""
            )

    router._serve = serve  # type: ignore[method-assign]
    request = pb.ChatRequest(messages=[pb.ChatMessage(role="user", content="Weather?")], tools=[json.dumps(TOOLS[0])])
    completion = gathered(list(router.Chat(request, Context())))
    assert (completion.reasoning_content, completion.text) == (THINKING, "Checking.")
    assert [c["function"]["name"] for c in completion.tool_calls] == ["get_weather"]


def test_the_router_http_chat_knows_the_model_type(tokenizer):
    """The router's OpenAI chat forwards a Generate and splits the reply itself: its loop names the model type."""
    limits = RequestLimits.for_engine(max_model_len=512, vocab_size=tokenizer.vocab_size)
    for model_type, splits in (("gpt_oss", True), ("llama", False)):
        context = RoutedContext(None, [])  # type: ignore[arg-type]
        loop = RoutedLoop(
            SimpleNamespace(max_in_flight=1, draining=False), None, tokenizer, SimpleNamespace(model_type=model_type)
        )
        context.attach(loop, limits, None, "", "auto")  # type: ignore[arg-type]
        assert (context.reasoning() is not None) == splits


def test_n_completions_are_split_each_on_its_own(tokenizer):
    """Messages of two completions interleaved (index 0 and 1): one split each, the state never shared."""
    replies = [tokenizer.encode(REPLY), tokenizer.encode(f"<|channel|>final<|message|>{ANSWER}<|return|>")]
    interleaved = []
    for start in range(0, max(map(len, replies)), 2):
        for index, token_ids in enumerate(replies):
            if start < len(token_ids):
                last = start + 2 >= len(token_ids)
                interleaved.append(
                    pb.GenerateResponse(
                        token_ids=token_ids[start : start + 2], index=index, finish_reason="stop" * last
                    )
                )
    responses = list(with_tool_calls(iter(interleaved), NO_TOOLS, reasoning_parser("auto", "gpt_oss", tokenizer)))
    for index, reasoning in ((0, THINKING), (1, "")):
        completion = gathered([r for r in responses if r.index == index])
        assert (completion.reasoning_content, completion.text) == (reasoning, ANSWER)
