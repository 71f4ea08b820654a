"""Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`. [TOOL_CALLS] is a special token in
Mistral's tokenizers, dropped from the detokenized text, so a reply that is such a list from its start is
read as calls too."""

from __future__ import annotations

import json

from jaxserve.server.tool_parsers.base import (
    ParsedReply,
    ToolParser,
    call_schema,
    content_or_none,
    decode_json_values,
    lark_literal,
    unterminated_json,
)

MARKER = "[TOOL_CALLS]"


class MistralParser(ToolParser):
    name = "mistral"
    markers = (MARKER,)
    leading_markers = ("[",)

    def parse(self, text: str) -> ParsedReply:
        before, marked, after = text.partition(MARKER)
        if not marked:
            before, after = "", text
        try:
            value, end = json.JSONDecoder().raw_decode(after.strip())
        except (json.JSONDecodeError, RecursionError):
            return self._cut_list(text, before, after.strip())
        calls = [self.call(v) for v in value] if isinstance(value, list) and value else [None]
        if any(call is None for call in calls) or after.strip()[end:].strip():
            return ParsedReply(content_or_none(text))
        return ParsedReply(content_or_none(before), tuple(call for call in calls if call is not None))

    def _cut_list(self, text: str, before: str, listed: str) -> ParsedReply:
        """A list of calls cut by max_tokens (or an EOS) after complete ones: those are the reply's calls, as
        llama3_json and hermes keep them; anything else is text."""
        if listed.startswith("["):
            values, end = decode_json_values(listed[1:], ",")
            calls = [self.call(v) for v in values]
            rest = listed[1 + end :].strip()
            if calls and None not in calls and (not rest or unterminated_json(rest)):
                return ParsedReply(content_or_none(before), tuple(c for c in calls if c is not None))
        return ParsedReply(content_or_none(text))

    def grammar(self, tools: list[dict], parallel: bool) -> str:
        calls = 'call (", " call)*' if parallel else "call"
        schema = json.dumps(call_schema(tools, "arguments"))
        return f'start: {lark_literal(MARKER)} "[" {calls} "]"\ncall: %json {schema}\n'
