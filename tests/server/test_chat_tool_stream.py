"""The chat handler's tool-call output from scripted deltas, with no engine: what a model's reply turns
into (message.tool_calls whole, delta.tool_calls streamed), read back with the openai SDK's own types, so
these shapes are checked now, whatever the engine samples."""

import asyncio
import json
from types import SimpleNamespace

from openai.types.chat import ChatCompletion, ChatCompletionChunk

from jaxserve.server.openai.chat import ChatCall
from jaxserve.server.openai.protocol import ChatCompletionRequest
from jaxserve.server.request_stream import Delta
from jaxserve.server.tool_choice import plan_tools
from jaxserve.server.tool_parsers import tool_parser

TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
PIECES = ["Checking. <tool", '_call>\n{"name": "lookup", ', '"arguments": {"q": "x"}}\n</tool_call>', ""]


class ScriptedGroup:
    """What ChatCall reads of a StreamGroup: the deltas of one stream, in order."""

    def __init__(self, pieces: list[str], finish_reason: str = "stop"):
        self.pieces, self.finish_reason = pieces, finish_reason
        self.engine_loop = SimpleNamespace(engine=SimpleNamespace(tokenizer=None))
        self.streams = [SimpleNamespace(error_status=500, num_prompt_tokens=3)]

    async def deltas(self):
        for number, text in enumerate(self.pieces):
            last = number == len(self.pieces) - 1
            yield 0, Delta([number], text, None, self.finish_reason if last else None, 3, 0)

    def mark_sending(self, sending: bool) -> None:
        pass

    def release(self) -> None:
        pass


def chat_call(group: ScriptedGroup, **body) -> ChatCall:
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "?"}], tools=[TOOL], **body)
    plan = plan_tools(request.tools, request.tool_choice, request.parallel_tool_calls, tool_parser("hermes"))
    context = SimpleNamespace(model_name="m", system_fingerprint="fp_test", response_model=lambda name: "m")
    return ChatCall(context, request, group, plan)  # type: ignore[arg-type]


def streamed_chunks(call: ChatCall) -> list[ChatCompletionChunk]:
    async def gather():
        return [event async for event in call.events()]

    events = asyncio.run(gather())
    assert events[-1] == "data: [DONE]\n\n"
    return [ChatCompletionChunk.model_validate(json.loads(e.removeprefix("data: "))) for e in events[:-1]]


def test_a_whole_reply_carries_its_calls_and_finish_reason():
    reply = ChatCompletion.model_validate(asyncio.run(chat_call(ScriptedGroup(PIECES)).collect()))
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls" and message.content == "Checking. "
    [call] = message.tool_calls or []
    assert call.id.startswith("call_") and call.function.name == "lookup"
    assert json.loads(call.function.arguments) == {"q": "x"}


def test_a_streamed_reply_sends_text_then_each_call_then_the_finish():
    chunks = streamed_chunks(chat_call(ScriptedGroup(PIECES)))
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    # the marker's first half was held back; the text is the whole reply's content, space included (vLLM's)
    assert text == "Checking. " and "<tool" not in text
    calls = [c.choices[0].delta.tool_calls for c in chunks if c.choices[0].delta.tool_calls]
    assert len(calls) == 1 and calls[0][0].index == 0 and calls[0][0].function.name == "lookup"
    assert json.loads(calls[0][0].function.arguments) == {"q": "x"}
    assert [c.choices[0].finish_reason for c in chunks][-1] == "tool_calls"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_a_reply_without_calls_streams_as_text():
    pieces = ["Plain <tool", "box> answer", ""]
    chunks = streamed_chunks(chat_call(ScriptedGroup(pieces)))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Plain <toolbox> answer"
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert not any(c.choices[0].delta.tool_calls for c in chunks)


def test_tool_choice_none_and_a_cut_reply_are_not_reported_as_calls():
    none = ChatCompletion.model_validate(asyncio.run(chat_call(ScriptedGroup(PIECES), tool_choice="none").collect()))
    assert none.choices[0].message.tool_calls in (None, []) and "<tool_call>" in (none.choices[0].message.content or "")
    cut = ChatCompletion.model_validate(asyncio.run(chat_call(ScriptedGroup(PIECES, "length")).collect()))
    assert cut.choices[0].finish_reason == "length"  # calls parsed, but the client must know it was cut


def test_without_parallel_tool_calls_only_the_first_call_is_returned():
    two = '<tool_call>\n{"name": "lookup", "arguments": {}}\n</tool_call>\n' * 2
    reply = ChatCompletion.model_validate(
        asyncio.run(chat_call(ScriptedGroup([two, ""]), parallel_tool_calls=False).collect())
    )
    assert len(reply.choices[0].message.tool_calls or []) == 1
