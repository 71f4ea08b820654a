"""What every reasoning parser does with a whole reply, from its own start() and a split's feed() / finish()."""

from __future__ import annotations

from typing import Any, Protocol, cast

from jaxserve.server.tool_parsers.base import ToolCall


class StartsReplies(Protocol):
    """A parser's own part: one reply's state, with feed(token_ids, text), finish() and tool_calls."""

    def start(
        self, parse_tool_calls: bool = False, prompt_token_ids=(), reasoning_start: bool | None = None
    ) -> Any: ...


class WholeReplies:
    """split() and parse() for a parser that has start() (StartsReplies: harmony.py, think.py)."""

    def split(
        self,
        token_ids: list[int],
        prompt_token_ids=(),
        reasoning_start: bool | None = None,
        text: str | None = None,
    ) -> tuple[str | None, str]:
        """A whole reply's (reasoning or None when it has none, content)."""
        reasoning, content, _ = self.parse(token_ids, False, prompt_token_ids, reasoning_start, text)
        return reasoning, content

    def parse(
        self,
        token_ids: list[int],
        parse_tool_calls: bool = False,
        prompt_token_ids=(),
        reasoning_start: bool | None = None,
        text: str | None = None,
    ) -> tuple[str | None, str, list[ToolCall]]:
        """A whole reply's (reasoning or None, content, tool calls); text: the reply's as the engine made it (None:
        the parser decodes the token ids)."""
        state = cast(StartsReplies, self).start(parse_tool_calls, prompt_token_ids, reasoning_start)
        reasoning, content = state.feed(token_ids, text)
        more_reasoning, more_content = state.finish()
        return (reasoning + more_reasoning) or None, content + more_content, state.tool_calls
