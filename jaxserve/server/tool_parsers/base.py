"""What every family's parser shares: the call as the APIs return it, the parse result, and the pieces
of a grammar (a tool's call as one JSON schema, Lark literals)."""

from __future__ import annotations

import abc
import copy
import json
import uuid
from collections.abc import Collection
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


def call_from_json(value, arguments_key: str = "arguments", names: Collection[str] | None = None) -> ToolCall | None:
    """{"name": ..., arguments_key: {...}} (either key accepted) as a ToolCall; None for anything else, and for a
    name outside `names` (the request's functions, when given): JSON that merely has a "name" is no call."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    if names is not None and value["name"] not in names:
        return None
    arguments = value.get(arguments_key, value.get("arguments", value.get("parameters", {})))
    if isinstance(arguments, str):  # some models write the arguments as JSON text already
        try:
            arguments = json.loads(arguments)
        except (json.JSONDecodeError, RecursionError):
            return None
    if not isinstance(arguments, dict):
        return None
    try:  # strict JSON: a number past float range (1e999) reads as inf, which json.dumps would write as Infinity
        return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False, allow_nan=False))
    except (ValueError, RecursionError):
        return None


def decode_json_values(text: str, separators: str) -> tuple[list, int]:
    """The JSON values text holds one after another (separated by whitespace and `separators`), and where
    decoding stopped: len(text) when all of it is such values."""
    decoder, values, at = json.JSONDecoder(), [], 0
    while True:
        while at < len(text) and (text[at].isspace() or text[at] in separators):
            at += 1
        if at == len(text):
            return values, at
        try:
            value, end = decoder.raw_decode(text, at)
        except (json.JSONDecodeError, RecursionError):
            return values, at
        values.append(value)
        at = end


def unterminated_json(text: str) -> bool:
    """Whether text opens a JSON object or array that it never closes: a call cut by max_tokens (or an EOS)
    while it was written."""
    depth, in_string, escaped = 0, False, False
    if not text.startswith(("{", "[")):
        return False
    for char in text:
        if in_string:
            escaped, in_string = (False, True) if escaped else (char == "\\", char != '"')
        elif char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth == 0:
                return False
    return True


def lark_literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def call_schema(tools: list[dict], arguments_key: str) -> dict:
    """One call of any of `tools` (OpenAI tool objects, checked): {"name": its name, arguments_key: an
    object of its parameters' schema}. The parameters' local references ("#/$defs/...", "#" itself for a
    recursive schema, as pydantic writes them) are rewritten to where the parameters now sit in this schema."""
    options = []
    for index, tool in enumerate(tools):
        function = tool["function"]
        parameters = _rebased_refs(
            function.get("parameters") or {"type": "object"}, f"#/anyOf/{index}/properties/{arguments_key}"
        )
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": function["name"]}, arguments_key: parameters},
                "required": ["name", arguments_key],
                "additionalProperties": False,
            }
        )
    return {"anyOf": options, "x-guidance": JSON_LAYOUT}


# Keywords whose values are data, not schemas: a "$ref" key inside them is a value, left as it is.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
# keywords whose value maps names to schemas: a property may be named "default" or "enum" and hold a $ref
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def _rebased_refs(schema, base: str):
    """A copy of `schema` with every local "$ref" ("#...") prefixed by `base` (a JSON pointer to where the
    schema is embedded)."""
    if isinstance(schema, list):
        return [_rebased_refs(item, base) for item in schema]
    if not isinstance(schema, dict):
        return schema
    rebased = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            rebased[key] = base + value[1:]
        elif key in _DATA_KEYWORDS:
            rebased[key] = copy.deepcopy(value)
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            rebased[key] = {name: _rebased_refs(schema, base) for name, schema in value.items()}
        else:
            rebased[key] = _rebased_refs(value, base)
    return rebased


class ToolParser(abc.ABC):
    """One model family's tool-call format: how to read calls out of a reply, and the grammar that makes
    a reply nothing but calls (tool_choice required or named)."""

    name = ""
    markers: tuple[str, ...] = ()  # where a tool call begins, anywhere in the reply
    leading_markers: tuple[str, ...] = ()  # where one begins, only at the reply's start (after whitespace)
    names: frozenset[str] | None = None  # the request's functions (for_tools): a call of another name is text

    def for_tools(self, tools: list[dict]) -> ToolParser:
        """This parser for one request's tools: a call must name one of them."""
        bound = copy.copy(self)
        bound.names = frozenset(tool["function"]["name"] for tool in tools)
        return bound

    def call(self, value, arguments_key: str = "arguments") -> ToolCall | None:
        return call_from_json(value, arguments_key, self.names)

    @abc.abstractmethod
    def parse(self, text: str) -> ParsedReply: ...

    @abc.abstractmethod
    def grammar(self, tools: list[dict], parallel: bool) -> str:
        """A Lark grammar whose every sentence is one call (several with parallel) of these tools."""


def content_or_none(text: str) -> str | None:
    """The reply's text outside its calls, unstripped as the stream sent it (vLLM's); None if only whitespace."""
    return text if text.strip() else None
