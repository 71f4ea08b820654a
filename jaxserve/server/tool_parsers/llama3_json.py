"""Llama 3.1+ JSON tool calls: the whole reply is `{"name": ..., "parameters": {...}}` (several separated
by "; "), optionally after `<|python_tag|>` (a special token, so usually gone from the text)."""

from __future__ import annotations

import json

from jaxserve.server.tool_parsers.base import (
    ParsedReply,
    ToolParser,
    call_from_json,
    call_schema,
    content_or_none,
    decode_json_sequence,
)

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    leading_markers = (PYTHON_TAG, "{")

    def parse(self, text: str) -> ParsedReply:
        body = text.strip()
        body = body.removeprefix(PYTHON_TAG).lstrip()
        if not body.startswith("{"):
            return ParsedReply(content_or_none(text))
        calls = [call_from_json(value, "parameters") for value in decode_json_sequence(body, ";") or [None]]
        if any(call is None for call in calls):
            return ParsedReply(content_or_none(text))
        return ParsedReply(None, tuple(call for call in calls if call is not None))

    def grammar(self, tools: list[dict], parallel: bool) -> str:
        start = 'call ("; " call)*' if parallel else "call"
        return f"start: {start}\ncall: %json {json.dumps(call_schema(tools, 'parameters'))}\n"
