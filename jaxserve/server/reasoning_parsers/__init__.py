"""Reasoning kept out of a chat reply's content, one parser per output format, returned apart as the
message's `reasoning_content` (vLLM's field; streamed as delta.reasoning_content).

A parser reads the reply's token ids (reasoning formats mark their channels with special tokens, which
the reply's text leaves out): `start()` gives the state of one reply, fed its tokens as they come and
answering (reasoning text, content text) for each piece. server.reasoning_parser picks one: gpt_oss |
none | auto (gpt_oss for GPT-OSS checkpoints, none otherwise).
"""

from __future__ import annotations

from jaxserve.server.reasoning_parsers.harmony import HarmonyReasoning, ReasoningSplit

PARSER_NAMES = ("gpt_oss", "none", "auto")
AUTO = {"gpt_oss": "gpt_oss"}  # model_type -> the parser its checkpoints' outputs need


def reasoning_parser(name: str, model_type: str, tokenizer) -> HarmonyReasoning | None:
    """server.reasoning_parser's parser for this model (None: replies are all content). ValueError for an
    unknown name, or a format the tokenizer cannot write."""
    if name not in PARSER_NAMES:
        raise ValueError(f"server.reasoning_parser must be one of {', '.join(PARSER_NAMES)}, got {name!r}")
    if name == "auto":
        name = AUTO.get(model_type, "none")
    if name == "none" or tokenizer is None:
        return None
    return HarmonyReasoning.for_tokenizer(tokenizer)


def engine_reasoning_parser(name: str, engine) -> HarmonyReasoning | None:
    """reasoning_parser for a serving engine; "auto" gives None where the tokenizer cannot write the model's format
    (a router's loop stands in for an engine: its tokenizer and model config, which may be None)."""
    model_config = getattr(engine, "model_config", None)
    try:
        return reasoning_parser(name, model_config.model_type if model_config is not None else "", engine.tokenizer)
    except ValueError:
        if name == "auto":
            return None
        raise


__all__ = ["PARSER_NAMES", "HarmonyReasoning", "ReasoningSplit", "engine_reasoning_parser", "reasoning_parser"]
