"""Llama 3.1+ JSON tool calls: the whole reply is `{"name": ..., "parameters": {...}}` (several separated
by "; "), optionally after `<|python_tag|>` (a special token, so usually gone from the text)."""

from __future__ import annotations

import json

from jaxserve.server.tool_parsers.base import (
    ParsedReply,
    ToolParser,
    call_schema,
    content_or_none,
    decode_json_values,
    unterminated_json,
)

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    leading_markers = (PYTHON_TAG, "{")

    def parse(self, text: str) -> ParsedReply:
        """The whole reply as calls; a last call cut before its JSON ended (max_tokens) after complete ones is
        left out, and anything else that is not a call of the request's functions makes the reply text."""
        body = text.strip()
        body = body.removeprefix(PYTHON_TAG).lstrip()
        if not body.startswith("{"):
            return ParsedReply(content_or_none(text))
        values, end = decode_json_values(body, ";")
        calls = [self.call(value, "parameters") for value in values]
        if not calls or any(call is None for call in calls) or (end < len(body) and not unterminated_json(body[end:])):
            return ParsedReply(content_or_none(text))
        return ParsedReply(None, tuple(call for call in calls if call is not None))

    def grammar(self, tools: list[dict], parallel: bool) -> str:
        start = 'call ("; " call)*' if parallel else "call"
        return f"start: {start}\ncall: %json {json.dumps(call_schema(tools, 'parameters'))}\n"
