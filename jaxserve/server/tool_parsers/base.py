"""What every family's parser shares: the call as the APIs return it, the parse result, and the pieces
of a grammar (a tool's call as one JSON schema, Lark literals)."""

from __future__ import annotations

import abc
import json
import uuid
from dataclasses import dataclass, field

# The separators json.dumps writes and models are trained on; fixed, so that a constrained reply cannot
# run on in whitespace.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text, as OpenAI's function.arguments
    id: str = field(default_factory=new_call_id)

    def openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ParsedReply:
    content: str | None  # the reply's text outside its tool calls; None when there is none
    tool_calls: tuple[ToolCall, ...] = ()


def call_from_json(value, arguments_key: str = "arguments") -> ToolCall | None:
    """{"name": ..., arguments_key: {...}} (either key accepted) as a ToolCall; None for anything else."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get(arguments_key, value.get("arguments", value.get("parameters", {})))
    if isinstance(arguments, str):  # some models write the arguments as JSON text already
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def decode_json_sequence(text: str, separators: str) -> list | None:
    """The JSON values text holds one after another (separated by whitespace and `separators`); None
    unless all of it is such values."""
    decoder, values, at = json.JSONDecoder(), [], 0
    while True:
        while at < len(text) and (text[at].isspace() or text[at] in separators):
            at += 1
        if at == len(text):
            return values or None
        try:
            value, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return None
        values.append(value)


def lark_literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def call_schema(tools: list[dict], arguments_key: str) -> dict:
    """One call of any of `tools` (OpenAI tool objects, checked): {"name": its name, arguments_key: an
    object of its parameters' schema}."""
    options = []
    for tool in tools:
        function = tool["function"]
        options.append(
            {
                "type": "object",
                "properties": {
                    "name": {"const": function["name"]},
                    arguments_key: function.get("parameters") or {"type": "object"},
                },
                "required": ["name", arguments_key],
                "additionalProperties": False,
            }
        )
    return {"anyOf": options, "x-guidance": JSON_LAYOUT}


class ToolParser(abc.ABC):
    """One model family's tool-call format: how to read calls out of a reply, and the grammar that makes
    a reply nothing but calls (tool_choice required or named)."""

    name = ""
    markers: tuple[str, ...] = ()  # where a tool call begins, anywhere in the reply
    leading_markers: tuple[str, ...] = ()  # where one begins, only at the reply's start (after whitespace)

    @abc.abstractmethod
    def parse(self, text: str) -> ParsedReply: ...

    @abc.abstractmethod
    def grammar(self, tools: list[dict], parallel: bool) -> str:
        """A Lark grammar whose every sentence is one call (several with parallel) of these tools."""


def content_or_none(text: str) -> str | None:
    return text.strip() or None
