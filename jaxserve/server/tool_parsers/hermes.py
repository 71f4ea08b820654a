"""Hermes / Qwen: each call is `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`."""

from __future__ import annotations

import json

from jaxserve.server.tool_parsers.base import (
    ParsedReply,
    ToolParser,
    call_schema,
    content_or_none,
    lark_literal,
    unterminated_json,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at


class HermesParser(ToolParser):
    name = "hermes"
    markers = (OPEN,)

    def parse(self, text: str) -> ParsedReply:
        """Each call's JSON is read whole (a closing tag inside one of its strings is text of the string), up to
        its closing tag, or the reply's end (an EOS before the tag). A reply with anything else after an opening
        tag is text, as the model wrote it, except a last call cut before its JSON ended (max_tokens) after
        complete ones: those are the reply's calls."""
        if OPEN not in text:
            return ParsedReply(content_or_none(text))
        decoder, calls, kept, at = json.JSONDecoder(), [], [], 0
        while (start := text.find(OPEN, at)) != -1:
            kept.append(text[at:start])
            body = _skip_space(text, start + len(OPEN))
            try:
                value, end = decoder.raw_decode(text, body)
            except (json.JSONDecodeError, RecursionError):
                value, end = None, body
            call = self.call(value)
            after = _skip_space(text, end)
            if call is not None and (text.startswith(CLOSE, after) or after == len(text)):
                calls.append(call)
                at = min(len(text), after + len(CLOSE))
                continue
            cut = body == len(text) or unterminated_json(text[body:])  # nothing, or part of a call, after the tag
            if calls and OPEN not in text[start + 1 :] and cut:
                at = len(text)  # the cut last call
                break
            return ParsedReply(content_or_none(text))
        kept.append(text[at:])
        return ParsedReply(content_or_none(_without_partial_marker("".join(kept))), tuple(calls))

    def grammar(self, tools: list[dict], parallel: bool) -> str:
        block = f"{lark_literal(OPEN + chr(10))} call {lark_literal(chr(10) + CLOSE)}"
        start = "block (" + lark_literal("\n") + " block)*" if parallel else "block"
        return f"start: {start}\nblock: {block}\ncall: %json {json.dumps(call_schema(tools, 'arguments'))}\n"


def _without_partial_marker(text: str) -> str:
    """Text after the calls without a beginning of another opening tag at its end ("<", "<tool_c": cut there)."""
    stripped = text.rstrip()
    for length in range(len(OPEN) - 1, 0, -1):
        if stripped.endswith(OPEN[:length]):
            return stripped[:-length]
    return text
