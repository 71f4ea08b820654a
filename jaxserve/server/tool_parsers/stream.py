"""A streamed reply's text split from its tool calls: text is passed on as it comes until a tool call
may have begun (a parser's marker, or the start of one); from there it is held back, and parsed when
the reply ends. The calls are then sent whole (one chunk each, as the openai SDK accumulates them);
held text that is no call after all is sent as text then."""

from __future__ import annotations

from jaxserve.server.tool_parsers.base import ParsedReply, ToolParser


class ToolCallHoldback:
    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.sent = ""  # text passed on so far
        self.held = ""  # text not passed on yet
        self.in_call = False  # a marker was seen: everything from it waits for the end

    def feed(self, text: str) -> str:
        """The part of the text so far that can be passed on now."""
        self.held += text
        if self.in_call:
            return ""
        at = self._call_start()
        if at is not None:
            self.in_call = True
            return self._pass_on(at)
        return self._pass_on(len(self.held) - self._possible_marker_length())

    def finish(self) -> tuple[str, ParsedReply]:
        """(text still to pass on, the whole reply parsed) once the reply has ended."""
        reply = self.parser.parse(self.sent + self.held)
        if not reply.tool_calls:
            rest, self.held = self.held, ""
            return rest, reply
        # the calls replace the held text; any text around them (which parse gives) follows the calls' text
        sent = self.sent.strip()
        content = (reply.content or "").strip()
        rest = content[len(sent) :] if content.startswith(sent) else ""
        self.held = ""
        return rest, reply

    def _pass_on(self, end: int) -> str:
        passed, self.held = self.held[:end], self.held[end:]
        self.sent += passed
        return passed

    def _call_start(self) -> int | None:
        starts = [self.held.find(m) for m in self.parser.markers if m in self.held]
        if self.parser.leading_markers and not self.sent.strip():
            leading = self.held.lstrip()
            if any(leading.startswith(m) for m in self.parser.leading_markers):
                starts.append(len(self.held) - len(leading))
        return min(starts) if starts else None

    def _possible_marker_length(self) -> int:
        """How much of the held text's end could be the beginning of a marker still to come."""
        longest = 0
        for marker in self.parser.markers:
            for length in range(min(len(marker) - 1, len(self.held)), longest, -1):
                if self.held.endswith(marker[:length]):
                    longest = length
                    break
        if self.parser.leading_markers and not self.sent.strip():
            leading = self.held.lstrip()
            if not leading or any(m.startswith(leading) for m in self.parser.leading_markers):
                return len(self.held)  # only whitespace, or a leading marker's beginning, so far
        return longest
