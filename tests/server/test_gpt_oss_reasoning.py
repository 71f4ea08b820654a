"""GPT-OSS's harmony replies split into reasoning_content and content (server.reasoning_parser), with no
engine: token ids of a real byte-level BPE tokenizer that has harmony's special tokens, scripted into the
chat handler whole and one token at a time (characters cut between tokens included), read back with the
openai SDK's own types; and which parser each setting picks."""

import asyncio
import json
from types import SimpleNamespace

import pytest
import tokenizers
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from tokenizers import decoders, models, pre_tokenizers, trainers

from jaxserve.loading.detokenizer import DetokenizerState, detokenize_incrementally, flush_detokenizer
from jaxserve.loading.fast_tokenizer import FastTokenizer
from jaxserve.loading.tokenizer_config import TokenizerSettings
from jaxserve.server.config_file import ServerConfig
from jaxserve.server.openai.chat import ChatCall
from jaxserve.server.openai.protocol import ChatCompletionRequest
from jaxserve.server.reasoning_parsers import reasoning_parser
from jaxserve.server.reasoning_parsers.harmony import SPECIAL
from jaxserve.server.request_stream import Delta
from jaxserve.server.tool_choice import plan_tools

THINKING = "The user asks 2 + 2. Arithmetic: 4 🙂."
ANSWER = "2 + 2 = 4. Ça va?"
REPLY = (
    f"<|channel|>analysis<|message|>{THINKING}<|end|><|start|>assistant<|channel|>final<|message|>{ANSWER}<|return|>"
)


def byte_level_tokenizer(special: tuple[str, ...], texts: list[str] | None = None) -> FastTokenizer:
    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=list(special), initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(texts or ["The user asks a question and the assistant answers it.", THINKING], trainer)
    return FastTokenizer(backend, TokenizerSettings())


@pytest.fixture(scope="module")
def tokenizer():
    return byte_level_tokenizer(SPECIAL)


class ScriptedGroup:
    """What ChatCall reads of a StreamGroup: one stream's deltas, each carrying some of the reply's tokens."""

    def __init__(self, pieces: list[list[int]], tokenizer):
        self.pieces, self.tokenizer = pieces, tokenizer
        self.pieces_text: list[str] | None = None  # the deltas' text when not the pieces' decode (a stop's cut)
        self.engine_loop = SimpleNamespace(engine=SimpleNamespace(tokenizer=tokenizer))
        self.streams = [SimpleNamespace(error_status=500, num_prompt_tokens=3)]

    async def deltas(self):
        sent, state = [], DetokenizerState(0, 0)
        for number, token_ids in enumerate(self.pieces):
            finish = "stop" if number == len(self.pieces) - 1 else None
            sent += token_ids  # the text as the engine's detokenizer makes it (a character cut between tokens waits)
            text = (flush_detokenizer if finish else detokenize_incrementally)(self.tokenizer, sent, state)
            if self.pieces_text is not None:
                text = self.pieces_text[number]
            yield 0, Delta(token_ids, text, None, finish, 3, 0)

    def mark_sending(self, sending: bool) -> None:
        pass

    def release(self) -> None:
        pass


def chat_call(tokenizer, pieces: list[list[int]], stream: bool) -> ChatCall:
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "2 + 2?"}], stream=stream)
    plan = plan_tools(request.tools, request.tool_choice, request.parallel_tool_calls, None)
    context = SimpleNamespace(model_name="m", system_fingerprint="fp_test", response_model=lambda name: "m")
    group = ScriptedGroup(pieces, tokenizer)
    return ChatCall(context, request, group, plan, reasoning_parser("auto", "gpt_oss", tokenizer))  # type: ignore[arg-type]


def streamed(call: ChatCall) -> list[ChatCompletionChunk]:
    async def gather():
        return [event async for event in call.events()]

    events = asyncio.run(gather())
    assert events[-1] == "data: [DONE]\n\n"
    return [ChatCompletionChunk.model_validate(json.loads(e.removeprefix("data: "))) for e in events[:-1]]


def test_a_whole_reply_keeps_its_analysis_out_of_the_content(tokenizer):
    token_ids = tokenizer.encode(REPLY)
    assert all(tokenizer.token_to_id(marker) in token_ids for marker in ("<|channel|>", "<|message|>", "<|end|>"))
    reply = ChatCompletion.model_validate(asyncio.run(chat_call(tokenizer, [token_ids], stream=False).collect()))
    message = reply.choices[0].message
    assert message.content == ANSWER
    assert message.model_extra["reasoning_content"] == THINKING


@pytest.mark.parametrize("tokens_per_delta", [1, 3])
def test_a_streamed_reply_sends_reasoning_then_content(tokenizer, tokens_per_delta):
    token_ids = tokenizer.encode(REPLY)
    pieces = [token_ids[i : i + tokens_per_delta] for i in range(0, len(token_ids), tokens_per_delta)]
    chunks = streamed(chat_call(tokenizer, pieces, stream=True))
    deltas = [c.choices[0].delta for c in chunks]
    reasoning = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    assert reasoning == THINKING and content == ANSWER  # no "\ufffd" from the emoji's bytes cut between tokens
    first_content = next(i for i, d in enumerate(deltas) if d.content)
    last_reasoning = max(i for i, d in enumerate(deltas) if (d.model_extra or {}).get("reasoning_content"))
    assert last_reasoning < first_content
    assert [c.choices[0].finish_reason for c in chunks][-1] == "stop"


def test_a_reply_without_harmony_is_all_content(tokenizer):
    token_ids = tokenizer.encode("Just an answer, no channels at all. " * 4)
    parser = reasoning_parser("gpt_oss", "gpt_oss", tokenizer)
    assert parser is not None and parser.split(token_ids) == (None, tokenizer.decode(token_ids))
    pieces = [[token_id] for token_id in token_ids]
    chunks = streamed(chat_call(tokenizer, pieces, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == tokenizer.decode(token_ids)


def test_which_parser_each_setting_picks(tokenizer):
    assert reasoning_parser("auto", "llama", tokenizer) is None
    assert reasoning_parser("none", "gpt_oss", tokenizer) is None
    assert reasoning_parser("auto", "gpt_oss", tokenizer) is not None
    with pytest.raises(ValueError, match="harmony special tokens"):
        reasoning_parser("gpt_oss", "gpt_oss", byte_level_tokenizer(("<|start|>",)))
    with pytest.raises(ValueError, match="server.reasoning_parser"):
        reasoning_parser("granite", "gpt_oss", tokenizer)
    with pytest.raises(ValueError, match="server.reasoning_parser"):
        ServerConfig(reasoning_parser="harmony")
    assert ServerConfig(reasoning_parser="gpt_oss").reasoning_parser == "gpt_oss"
