"""Tool calls in a model's reply, one parser per model family, for both APIs.

A parser knows its family's format both ways: `parse` splits a finished reply into its text and its
tool calls, and `grammar` writes the Lark grammar (llguidance's, with `%json` schemas) that makes a
reply be exactly such calls, for tool_choice "required" or a named function. `markers` tell a stream
where tool calls may begin (stream.py holds the text back from there). server.tool_call_parser picks
one: hermes | llama3_json | mistral | auto (told from the chat template's text, hermes when it cannot be).
"""

from __future__ import annotations

from jaxserve.server.tool_parsers.base import ParsedReply, ToolCall, ToolParser
from jaxserve.server.tool_parsers.hermes import HermesParser
from jaxserve.server.tool_parsers.llama3_json import Llama3JsonParser
from jaxserve.server.tool_parsers.mistral import MistralParser

PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
}
PARSER_NAMES = (*PARSERS, "auto")
# What a chat template's text shows of its family's tool-call format, checked in this order.
TEMPLATE_SIGNS = (
    ("<tool_call>", "hermes"),
    ("[TOOL_CALLS]", "mistral"),
    ("<|python_tag|>", "llama3_json"),
    ("ipython", "llama3_json"),
)
FALLBACK_PARSER = "hermes"  # the most common format (Qwen, Hermes, many fine-tunes)


def parser_name_for_template(template_text: str) -> str:
    return next((name for sign, name in TEMPLATE_SIGNS if sign in template_text), FALLBACK_PARSER)


def tool_parser(name: str, template_text: str = "") -> ToolParser:
    """server.tool_call_parser's parser; "auto" reads the chat template. ValueError for an unknown name."""
    if name == "auto":
        name = parser_name_for_template(template_text)
    if name not in PARSERS:
        raise ValueError(f"server.tool_call_parser must be one of {', '.join(PARSER_NAMES)}, got {name!r}")
    return PARSERS[name]()


__all__ = ["PARSER_NAMES", "ParsedReply", "ToolCall", "ToolParser", "parser_name_for_template", "tool_parser"]
