"""Tools in a chat request, for both APIs: the tools checked, tool_choice read, and the plan that
follows (what the template gets, whether the reply is parsed for calls, and the grammar that makes
"required" or a named function a call for certain).

    tool_choice "none":      the template gets the tools; the reply is text
    "auto" (default):        the reply is parsed for calls (with parallel_tool_calls false, the first)
    "required" / a function: the reply is constrained to calls (one, of that function) by the parser's
                             grammar, so it is always a valid call
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxserve.host.request import GuidedDecodingParams
from jaxserve.loading.chat_template import select_chat_template, template_messages
from jaxserve.server.tool_parsers import ToolParser, tool_parser

TOOL_CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class ToolPlan:
    tools: list[dict] | None  # for the chat template
    parser: ToolParser | None  # None: the reply is not parsed for calls
    guided_decoding: GuidedDecodingParams | None  # the grammar that forces calls
    parallel: bool = True

    @property
    def parses(self) -> bool:
        return self.parser is not None


NO_TOOLS = ToolPlan(None, None, None)


def checked_tools(tools) -> list[dict]:
    """OpenAI tool objects, each {"type": "function", "function": {"name", "description"?, "parameters"?}};
    ValueError naming the first tool that is not one, or a name used twice."""
    if not isinstance(tools, list):
        raise ValueError("tools must be a list of {'type': 'function', 'function': {...}} objects")
    names: set[str] = set()
    for position, tool in enumerate(tools):
        where = f"tools[{position}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise ValueError(f"{where}: only tools of type 'function' are supported")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise ValueError(f"{where}: a tool needs a 'function' object")
        name = function.get("name")
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"{where}: a tool needs a function name")
        if name in names:
            raise ValueError(f"{where}: the function name {name!r} is used by two tools")
        names.add(name)
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise ValueError(f"{where}: function.parameters must be a JSON schema object")
    return tools


def chosen_function(tool_choice) -> str | None:
    """The function a tool_choice names ({"type": "function", "function": {"name": ...}}), else None."""
    if isinstance(tool_choice, dict):
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if tool_choice.get("type", "function") != "function" or not isinstance(name, str) or not name:
            raise ValueError(
                "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}"
            )
        return name
    return None


def plan_tools(tools, tool_choice, parallel_tool_calls: bool | None, parser: ToolParser) -> ToolPlan:
    """The plan for a request's tools; ValueError for tools or a tool_choice that cannot be served."""
    named = chosen_function(tool_choice)
    if named is None and tool_choice is not None and tool_choice not in TOOL_CHOICES:
        raise ValueError(f"tool_choice must be 'none', 'auto', 'required' or a function, got {tool_choice!r}")
    tools = checked_tools(tools) if tools else None
    if not tools:
        if tool_choice == "required" or named is not None:
            raise ValueError(f"tool_choice {tool_choice!r} needs tools, and the request has none")
        return NO_TOOLS
    parallel = parallel_tool_calls is not False
    parser = parser.for_tools(tools)
    if tool_choice == "none":
        return ToolPlan(tools, None, None, parallel)
    if named is not None:
        chosen = [tool for tool in tools if tool["function"]["name"] == named]
        if not chosen:
            known = ", ".join(repr(tool["function"]["name"]) for tool in tools)
            raise ValueError(f"tool_choice names the function {named!r}, which is not among the tools ({known})")
        return ToolPlan(tools, parser, GuidedDecodingParams(grammar=parser.grammar(chosen, parallel=False)), False)
    if tool_choice == "required":
        return ToolPlan(tools, parser, GuidedDecodingParams(grammar=parser.grammar(tools, parallel)), parallel)
    return ToolPlan(tools, parser, None, parallel)


def parser_for_template(name: str, tokenizer, chat_template: str | None, tools) -> ToolParser:
    """The parser server.tool_call_parser names; "auto": told from the template this chat renders with
    (none to read: the fallback)."""
    if name != "auto":
        return tool_parser(name)
    try:
        template_text, _ = select_chat_template(tokenizer, chat_template, tools)
    except ValueError:  # no template: rendering the chat refuses it with the reason
        template_text = ""
    return tool_parser(name, template_text)


__all__ = ["ToolPlan", "parser_for_template", "plan_tools", "template_messages"]
