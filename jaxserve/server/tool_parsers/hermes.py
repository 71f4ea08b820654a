"""Hermes / Qwen: each call is `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`."""

from __future__ import annotations

import json
import re

from jaxserve.server.tool_parsers.base import (
    ParsedReply,
    ToolParser,
    call_from_json,
    call_schema,
    content_or_none,
    lark_literal,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# a last call left open: the model stopped (EOS) before writing the closing tag
CALL = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|$)", re.DOTALL)


class HermesParser(ToolParser):
    name = "hermes"
    markers = (OPEN,)

    def parse(self, text: str) -> ParsedReply:
        if OPEN not in text:
            return ParsedReply(content_or_none(text))
        calls = []
        for body in CALL.findall(text):
            try:
                call = call_from_json(json.loads(body))
            except json.JSONDecodeError:
                call = None
            if call is None:  # not a call after all: the reply is text, as the model wrote it
                return ParsedReply(content_or_none(text))
            calls.append(call)
        return ParsedReply(content_or_none(CALL.sub("", text)), tuple(calls))

    def grammar(self, tools: list[dict], parallel: bool) -> str:
        block = f"{lark_literal(OPEN + chr(10))} call {lark_literal(chr(10) + CLOSE)}"
        start = "block (" + lark_literal("\n") + " block)*" if parallel else "block"
        return f"start: {start}\nblock: {block}\ncall: %json {json.dumps(call_schema(tools, 'arguments'))}\n"
