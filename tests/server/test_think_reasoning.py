"""<think> ... </think> replies (Qwen3, DeepSeek-R1) split into reasoning_content and content by
server.reasoning_parser qwen3 / deepseek_r1, with no engine: token ids of a byte-level BPE tokenizer with the
markers as added, non-special tokens (as Qwen3's and R1's vocabularies have them: a plain decode shows them),
scripted into the chat handler whole and one token at a time; the prompt's last marker decides where a reply
starts; tool calls after the reasoning are parsed from the content."""

import asyncio
import json
from types import SimpleNamespace

import pytest
from openai.types.chat import ChatCompletion

from jaxserve.proto import jaxserve_pb2 as pb
from jaxserve.router.config import parse_config
from jaxserve.server.config_file import ServerConfig
from jaxserve.server.grpc_chat import with_tool_calls
from jaxserve.server.openai.chat import ChatCall
from jaxserve.server.openai.protocol import ChatCompletionRequest
from jaxserve.server.reasoning_parsers import reasoning_parser
from jaxserve.server.tool_choice import NO_TOOLS, plan_tools
from jaxserve.server.tool_parsers import tool_parser
from tests.server.test_gpt_oss_reasoning import ScriptedGroup, byte_level_tokenizer, streamed
from tests.server.test_gpt_oss_tool_calls import TOOLS

THINKING = "\nThe user asks 2 + 2. Arithmetic: 4 🙂.\n"
ANSWER = "\n\n2 + 2 = 4. Ça va?"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer():
    tokenizer = byte_level_tokenizer(("<|im_start|>", "<|im_end|>"), [THINKING, ANSWER, CALL] * 5)
    tokenizer.backend.add_tokens(["<think>", "</think>"])  # added, not special: a plain decode shows them
    return tokenizer


def prompt(tokenizer, tail: str = "") -> list[int]:
    return tokenizer.encode(f"<|im_start|>user\n2 + 2?<|im_end|>\n<|im_start|>assistant\n{tail}")


def chat_call(tokenizer, pieces, prompt_ids, name="qwen3", stream=False, tools=None) -> ChatCall:
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "2 + 2?"}], stream=stream, tools=tools)
    plan = plan_tools(request.tools, request.tool_choice, request.parallel_tool_calls, tool_parser("hermes"))
    context = SimpleNamespace(model_name="m", system_fingerprint="fp_test", response_model=lambda name: "m")
    parser = reasoning_parser(name, "qwen3", tokenizer)
    return ChatCall(context, request, ScriptedGroup(pieces, tokenizer), plan, parser, None, prompt_ids)  # type: ignore[arg-type]


def whole(call: ChatCall):
    return ChatCompletion.model_validate(asyncio.run(call.collect())).choices[0].message


def streamed_parts(call: ChatCall) -> tuple[str, str, list]:
    deltas = [chunk.choices[0].delta for chunk in streamed(call)]
    reasoning = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    return reasoning, "".join(d.content or "" for d in deltas), [c for d in deltas for c in d.tool_calls or []]


@pytest.mark.parametrize(
    "name, prompt_tail, reply",
    [
        ("qwen3", "", f"<think>{THINKING}</think>{ANSWER}"),  # Qwen3's model opens the block itself
        ("qwen3", "<think>", f"{THINKING}</think>{ANSWER}"),  # Thinking-2507 / Qwen3.5 templates open it
        ("deepseek_r1", "<think>", f"{THINKING}</think>{ANSWER}"),  # R1's template opens it
        ("deepseek_r1", "", f"{THINKING}</think>{ANSWER}"),  # R1 with no marker anywhere: reasoning first
        ("deepseek_r1", "", f"<think>{THINKING}</think>{ANSWER}"),
    ],
)
def test_reasoning_and_content_whole_and_streamed(tokenizer, name, prompt_tail, reply):
    token_ids, prompt_ids = tokenizer.encode(reply), prompt(tokenizer, prompt_tail)
    assert tokenizer.token_to_id("</think>") in token_ids and "</think>" in tokenizer.decode(token_ids)
    message = whole(chat_call(tokenizer, [token_ids], prompt_ids, name))
    assert message.model_extra["reasoning_content"] == THINKING and message.content == ANSWER
    for tokens_per_delta in (1, 3):
        pieces = [token_ids[i : i + tokens_per_delta] for i in range(0, len(token_ids), tokens_per_delta)]
        # no "\ufffd" from the emoji's bytes cut between tokens, no marker text on either side
        assert streamed_parts(chat_call(tokenizer, pieces, prompt_ids, name, stream=True))[:2] == (THINKING, ANSWER)


def test_a_prompt_that_closes_the_block_gets_all_content(tokenizer):
    # Qwen3's enable_thinking false: the template writes an empty block into the prompt
    prompt_ids = prompt(tokenizer, "<think>\n\n</think>\n\n")
    for name in ("qwen3", "deepseek_r1"):
        message = whole(chat_call(tokenizer, [tokenizer.encode(ANSWER)], prompt_ids, name))
        assert message.content == ANSWER and message.model_extra["reasoning_content"] is None
    # and Qwen3 with no marker and no thinking in the reply: content, as the model wrote it
    message = whole(chat_call(tokenizer, [tokenizer.encode(ANSWER)], prompt(tokenizer), "qwen3"))
    assert message.content == ANSWER and message.model_extra["reasoning_content"] is None


def test_a_reply_cut_inside_its_reasoning_is_all_reasoning(tokenizer):
    token_ids = tokenizer.encode(f"<think>{THINKING}")
    message = whole(chat_call(tokenizer, [token_ids], prompt(tokenizer)))
    assert message.model_extra["reasoning_content"] == THINKING and not message.content


def test_tool_calls_after_the_reasoning_are_parsed_from_the_content(tokenizer):
    token_ids = tokenizer.encode(f"<think>{THINKING}</think>\n\n{CALL}")
    message = whole(chat_call(tokenizer, [token_ids], prompt(tokenizer), tools=TOOLS))
    assert message.model_extra["reasoning_content"] == THINKING and not message.content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    pieces = [[token_id] for token_id in token_ids]
    reasoning, content, calls = streamed_parts(
        chat_call(tokenizer, pieces, prompt(tokenizer), stream=True, tools=TOOLS)
    )
    assert reasoning == THINKING and not content.strip() and [c.function.name for c in calls] == ["get_weather"]


def test_grpc_chat_splits_from_the_prompts_marker(tokenizer):
    token_ids = tokenizer.encode(f"{THINKING}</think>{ANSWER}")
    first = tokenizer.decode(token_ids[:5])  # (plain text: no character cut there)
    rest = f"{THINKING}</think>{ANSWER}"[len(first) :]
    responses = [
        pb.GenerateResponse(index=0, token_ids=token_ids[:5], text=first),
        pb.GenerateResponse(index=0, token_ids=token_ids[5:], text=rest, finish_reason="stop"),
    ]
    parser = reasoning_parser("qwen3", "qwen3", tokenizer)
    split = list(with_tool_calls(iter(responses), NO_TOOLS, parser, prompt(tokenizer, "<think>")))
    assert "".join(r.reasoning_content for r in split) == THINKING and "".join(r.text for r in split) == ANSWER


def test_which_think_parser_each_setting_picks(tokenizer):
    assert reasoning_parser("auto", "qwen3", tokenizer) is None  # as vLLM: the block stays in the content
    assert reasoning_parser("qwen3", "llama", tokenizer) is not None
    with pytest.raises(
        ValueError, match=r"reasoning_parser deepseek_r1 needs <think> and </think>.*\['<think>', '</think>'\]"
    ):
        reasoning_parser("deepseek_r1", "llama", byte_level_tokenizer(("<|im_start|>",)))
    assert ServerConfig(reasoning_parser="deepseek_r1").reasoning_parser == "deepseek_r1"
    router = {"model": {"path": "default"}, "replicas": ["127.0.0.1:1"]}
    assert parse_config({**router, "router": {"reasoning_parser": "qwen3"}}).router.reasoning_parser == "qwen3"
    with pytest.raises(ValueError, match="router.reasoning_parser must be one of"):
        parse_config({**router, "router": {"reasoning_parser": "think"}})


def test_a_reply_under_a_grammar_is_content_even_where_the_prompt_opened_a_block(tokenizer):
    """The grammar (response_format, tool_choice required) governs the reply from its first token: its JSON is the
    content, not reasoning, though R1's template opened the block."""
    reply = tokenizer.encode('{"answer": 4}')
    prompt_ids = prompt(tokenizer, "<think>")
    parser = reasoning_parser("deepseek_r1", "deepseek_v3", tokenizer)
    assert parser is not None and parser.split(reply, prompt_ids) == ('{"answer": 4}', "")
    assert parser.split(reply, prompt_ids, reasoning_start=False) == (None, '{"answer": 4}')
    call = chat_call(tokenizer, [reply], prompt_ids, "deepseek_r1")
    call.reasoning_start = False
    assert whole(call).content == '{"answer": 4}'


def test_the_split_reads_the_engines_text_stop_strings_cut_and_markers_in_pieces(tokenizer):
    """The engine's text is the reply's (a stop string cut off, text held back while it may start one and sent
    later in other pieces): the split takes it as sent, markers arriving in pieces included."""
    parser = reasoning_parser("qwen3", "qwen3", tokenizer)
    assert parser is not None and parser.markers_in_text
    token_ids = tokenizer.encode(f"<think>{THINKING}</think>{ANSWER}")
    # the stop string "Ça" ended the reply: the engine's text stops before it
    cut = f"<think>{THINKING}</think>{ANSWER}".split("Ça")[0]
    assert parser.split(token_ids, text=cut) == (THINKING, ANSWER.split("Ça")[0])
    state = parser.start()
    pieces = ["<thi", "nk>", THINKING[:5], THINKING[5:] + "</", "think", ">", ANSWER[:3], ANSWER[3:]]
    sides = [state.feed([], piece) for piece in pieces] + [state.finish()]
    assert "".join(r for r, _ in sides) == THINKING and "".join(c for _, c in sides) == ANSWER
    call = chat_call(tokenizer, [token_ids], prompt(tokenizer))
    call.group.pieces_text = [cut]  # what ScriptedGroup sends as the deltas' text (the engine's)
    message = whole(call)
    assert message.model_extra["reasoning_content"] == THINKING and message.content == ANSWER.split("Ça")[0]


def test_a_chats_grammar_waits_for_the_reasoning_to_end(tokenizer):
    """As vLLM's structured outputs with a reasoning parser: the grammar starts after </think> unless the prompt
    closed the block; the reply then splits as any other (its reasoning is not under the grammar), and the field
    travels over gRPC (the router's Generate, a disaggregated decode replica)."""
    from jaxserve.host.request import GuidedDecodingParams, SamplingParams
    from jaxserve.server.reasoning_parsers import reply_reasoning_start, with_grammar_after_reasoning
    from jaxserve.server.sampling_proto import sampling_params_from_proto, sampling_params_to_proto

    parser = reasoning_parser("qwen3", "qwen3", tokenizer)
    end_id = tokenizer.token_to_id("</think>")
    guided = SamplingParams(max_tokens=8, guided_decoding=GuidedDecodingParams(choice=["yes", "no"]))
    for tail, after in (("", end_id), ("<think>", end_id), ("<think>\n\n</think>\n\n", None)):
        params = with_grammar_after_reasoning(guided, parser, prompt(tokenizer, tail))
        assert params.guided_decoding_after_token == after and reply_reasoning_start(params) == (after is not None)
        assert sampling_params_from_proto(sampling_params_to_proto(params)).guided_decoding_after_token == after
    free = SamplingParams(max_tokens=8)
    assert with_grammar_after_reasoning(free, parser, prompt(tokenizer, "<think>")) is free
    assert with_grammar_after_reasoning(guided, None, prompt(tokenizer, "<think>")) is guided


def test_a_grammar_start_the_request_holds_is_kept(tokenizer):
    """A gRPC Chat's own guided_decoding_after_token is not replaced by the parser's </think> (the engine then refuses
    one outside the vocabulary, as Generate does, instead of the server serving the request as if it were unset)."""
    from jaxserve.host.request import GuidedDecodingParams, SamplingParams
    from jaxserve.server.reasoning_parsers import with_grammar_after_reasoning

    parser = reasoning_parser("qwen3", "qwen3", tokenizer)
    choice = GuidedDecodingParams(choice=["yes", "no"])
    for after in (10**6, 7):
        params = SamplingParams(max_tokens=8, guided_decoding=choice, guided_decoding_after_token=after)
        assert with_grammar_after_reasoning(params, parser, prompt(tokenizer, "<think>")) is params


def test_a_reply_whose_grammar_waits_starts_in_reasoning(tokenizer):
    """Qwen3 with no marker in the prompt: its grammar waits for </think> (as vLLM's), so the free text before a
    lone </think> is reasoning, not content that the grammar never saw."""
    reply = tokenizer.encode("free text</think>no")
    parser = reasoning_parser("qwen3", "qwen3", tokenizer)
    assert parser is not None and parser.split(reply, prompt(tokenizer)) == (None, "free textno")
    assert parser.split(reply, prompt(tokenizer), reasoning_start=True) == ("free text", "no")
