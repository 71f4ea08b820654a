"""Reasoning kept out of a chat reply's content, one parser per output format, returned apart as the
message's `reasoning_content` (vLLM's field; streamed as delta.reasoning_content).

A parser reads the reply's token ids (reasoning formats mark their channels with special tokens, which
the reply's text leaves out): `start()` gives the state of one reply, fed its tokens as they come and
answering (reasoning text, content text) for each piece; it is told the prompt's token ids (a think block may
open there). server.reasoning_parser picks one, with vLLM's names: gpt_oss (harmony.py) | deepseek_r1 | qwen3
(think.py) | none | auto (gpt_oss for GPT-OSS checkpoints, none otherwise: as in vLLM, a thinking model's
<think> block stays in the content unless a parser is named).
"""

from __future__ import annotations

import dataclasses

from jaxserve.host.request import SamplingParams
from jaxserve.server.reasoning_parsers.harmony import HarmonyReasoning, ReasoningSplit
from jaxserve.server.reasoning_parsers.think import ThinkReasoning, ThinkSplit

PARSER_NAMES = ("gpt_oss", "deepseek_r1", "qwen3", "none", "auto")
AUTO = {"gpt_oss": "gpt_oss"}  # model_type -> the parser its checkpoints' outputs need
THINK_OPENS_BY_DEFAULT = {"deepseek_r1": True, "qwen3": False}  # a reply to a prompt with no think marker

ReasoningParser = HarmonyReasoning | ThinkReasoning


def reasoning_parser(name: str, model_type: str, tokenizer) -> ReasoningParser | None:
    """server.reasoning_parser's parser for this model (None: replies are all content). ValueError for an
    unknown name, or a format the tokenizer cannot write."""
    if name not in PARSER_NAMES:
        raise ValueError(f"server.reasoning_parser must be one of {', '.join(PARSER_NAMES)}, got {name!r}")
    if name == "auto":
        name = AUTO.get(model_type, "none")
    if name == "none" or tokenizer is None:
        return None
    if name in THINK_OPENS_BY_DEFAULT:
        return ThinkReasoning.for_tokenizer(name, tokenizer, THINK_OPENS_BY_DEFAULT[name])
    return HarmonyReasoning.for_tokenizer(tokenizer)


def with_grammar_after_reasoning(
    params: SamplingParams, parser: ReasoningParser | None, prompt_token_ids
) -> SamplingParams:
    """A chat's params with its grammar (response_format, guided_*, tool_choice required) held back until the
    reply's reasoning ends, where the parser says where that is (a think block the prompt leaves open); the
    reasoning runs free and the grammar governs the answer, as vLLM's structured outputs with a reasoning
    parser. GPT-OSS's harmony keeps its grammar from the first token. A value the request already holds (a gRPC
    client's, or a router's forwarding it) is kept, so that the engine checks it (a token outside the vocabulary
    is refused, not replaced)."""
    if params.guided_decoding is None or params.guided_decoding_after_token is not None:
        return params
    if not isinstance(parser, ThinkReasoning):
        return params
    after = parser.grammar_start_token(prompt_token_ids)
    return params if after is None else dataclasses.replace(params, guided_decoding_after_token=after)


def reply_reasoning_start(params: SamplingParams) -> bool | None:
    """Where a reply's grammar puts its start: True, in reasoning (the grammar waits for the reasoning's end);
    False, in content (the grammar governs it from its first token: no think block opens before it); None, no
    grammar (the prompt decides)."""
    if params.guided_decoding is None:
        return None
    return params.guided_decoding_after_token is not None


def engine_reasoning_parser(name: str, engine) -> ReasoningParser | None:
    """reasoning_parser for a serving engine; "auto" gives None where the tokenizer cannot write the model's format
    (a router's loop stands in for an engine: its tokenizer and model config, which may be None)."""
    model_config = getattr(engine, "model_config", None)
    try:
        return reasoning_parser(name, model_config.model_type if model_config is not None else "", engine.tokenizer)
    except ValueError:
        if name == "auto":
            return None
        raise


__all__ = [
    "PARSER_NAMES",
    "HarmonyReasoning",
    "ReasoningParser",
    "ReasoningSplit",
    "ThinkReasoning",
    "ThinkSplit",
    "engine_reasoning_parser",
    "reply_reasoning_start",
    "reasoning_parser",
    "with_grammar_after_reasoning",
]
