"""Reasoning in a `<think>` ... `</think>` block (Qwen3, QwQ, DeepSeek-R1 and its distills): vLLM's `qwen3` and
`deepseek_r1` reasoning parsers, read from the reply's token ids.

A reply is reasoning while a think block is open and content after it closes. The block may open in the
prompt: thinking models' templates end the generation prompt with "<think>\\n" (DeepSeek-R1, Qwen3's
Thinking-2507 releases), and Qwen3's `enable_thinking: false` closes it there ("<think>\\n\\n</think>\\n\\n"), so
the prompt's last marker says where a reply starts. With no marker in the prompt, `deepseek_r1` starts in
reasoning (R1 thinks first; vLLM reads the text before a lone </think> as reasoning) and `qwen3` in content
(Qwen3's own templates leave <think> to the model). Markers are single tokens in these vocabularies (added
tokens, not special: a reply's text shows them), so the split reads the reply's text as the engine made it
(stop strings cut, include_stop_str_in_output, text held back while it may start a stop string; a marker's
text may then arrive in pieces) and passes no marker on; a tokenizer that makes them special (its text
leaves them out) is split by token ids instead. Every block is reasoning (vLLM splits at the first only and
leaves later markers in the content). Tool calls are not this parser's: the tool-call parser reads them from
the content, as vLLM's serving layer does (a call written inside an unclosed block stays reasoning; vLLM's
newest qwen3 parser ends the reasoning at a `<tool_call><function=` there, Qwen3.5's format). A reply under a
grammar (guided decoding, tool_choice required) starts in content: the grammar governs it from its first token,
so no block opens before it; unless the grammar waits for the reasoning to end (`grammar_start_token`: the
server holds a chat's grammar back until </think>, as vLLM's structured outputs do with a reasoning parser).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxserve.loading.detokenizer import DetokenizerState, detokenize_incrementally, flush_detokenizer
from jaxserve.server.reasoning_parsers.whole_reply import WholeReplies
from jaxserve.server.tool_parsers.base import ToolCall

START, END = "<think>", "</think>"


@dataclass
class ThinkSplit:
    """One reply's state: which side its text goes to, the text that may be the start of a marker (text
    mode), or its tokens so far without the markers (token mode)."""

    parser: ThinkReasoning
    in_reasoning: bool
    pending: str = ""
    token_ids: list[int] = field(default_factory=list)
    state: DetokenizerState = field(default_factory=lambda: DetokenizerState(0, 0))
    tool_calls: list[ToolCall] = field(default_factory=list)  # always empty: calls are read from the content

    def feed(self, token_ids: list[int], text: str | None = None) -> tuple[str, str]:
        """(reasoning, content) text these tokens add; text: theirs as the engine made it (None: decoded here,
        an unfinished character waiting for its next token)."""
        if text is not None and self.parser.markers_in_text:
            return self._feed_text(text)
        reasoning, content = [], []
        for token_id in token_ids:
            if token_id in (self.parser.start_id, self.parser.end_id):
                self._emit(flush_detokenizer(self.parser.tokenizer, self.token_ids, self.state), reasoning, content)
                self.in_reasoning = token_id == self.parser.start_id
            else:
                self.token_ids.append(token_id)
        self._emit(detokenize_incrementally(self.parser.tokenizer, self.token_ids, self.state), reasoning, content)
        return "".join(reasoning), "".join(content)

    def _feed_text(self, text: str) -> tuple[str, str]:
        reasoning, content = [], []
        self.pending += text
        while (found := _first_marker(self.pending)) is not None:
            at, marker = found
            self._emit(self.pending[:at], reasoning, content)
            self.in_reasoning = marker == START
            self.pending = self.pending[at + len(marker) :]
        held = _marker_start_at_end(self.pending)  # "</th" may be the start of a marker whose rest comes next
        self._emit(self.pending[: len(self.pending) - held], reasoning, content)
        self.pending = self.pending[len(self.pending) - held :]
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """(reasoning, content) text still held when the reply ends."""
        reasoning, content = [], []
        self._emit(self.pending, reasoning, content)
        self.pending = ""
        self._emit(flush_detokenizer(self.parser.tokenizer, self.token_ids, self.state), reasoning, content)
        return "".join(reasoning), "".join(content)

    def _emit(self, text: str, reasoning: list[str], content: list[str]) -> None:
        (reasoning if self.in_reasoning else content).append(text)


def _first_marker(text: str) -> tuple[int, str] | None:
    found = [(text.find(marker), marker) for marker in (START, END) if marker in text]
    return min(found) if found else None


def _marker_start_at_end(text: str) -> int:
    """Characters at text's end that begin a marker (0: none)."""
    for length in range(min(len(END) - 1, len(text)), 0, -1):
        if START.startswith(text[-length:]) or END.startswith(text[-length:]):
            return length
    return 0


@dataclass(frozen=True)
class ThinkReasoning(WholeReplies):
    """The think markers as one tokenizer writes them. opens_by_default: where a reply starts when the prompt
    holds no marker (deepseek_r1: in reasoning; qwen3: in content)."""

    name: str
    tokenizer: object
    start_id: int
    end_id: int
    opens_by_default: bool
    markers_in_text: bool  # the tokenizer's decode writes them (added tokens, not special): split the text

    @classmethod
    def for_tokenizer(cls, name: str, tokenizer, opens_by_default: bool) -> ThinkReasoning:
        ids = {marker: tokenizer.token_to_id(marker) for marker in (START, END)}
        missing = [marker for marker, token_id in ids.items() if token_id is None]
        if missing:
            raise ValueError(
                f"reasoning_parser {name} needs {START} and {END} as tokens; the tokenizer lacks {missing}"
            )
        in_text = all(tokenizer.decode([ids[marker]], skip_special_tokens=True) == marker for marker in (START, END))
        return cls(name, tokenizer, ids[START], ids[END], opens_by_default, in_text)

    def starts_in_reasoning(self, prompt_token_ids) -> bool:
        """Whether a reply to this prompt starts inside a think block: the prompt's last marker decides."""
        for token_id in reversed(prompt_token_ids):
            if token_id in (self.start_id, self.end_id):
                return token_id == self.start_id
        return self.opens_by_default

    def grammar_start_token(self, prompt_token_ids) -> int | None:
        """The token after which a chat's grammar applies: </think>, unless the prompt closed the block already
        (Qwen3's enable_thinking false), as vLLM's is_reasoning_end reads the prompt; None: from the first."""
        for token_id in reversed(prompt_token_ids):
            if token_id in (self.start_id, self.end_id):
                return None if token_id == self.end_id else self.end_id
        return self.end_id

    def start(
        self, parse_tool_calls: bool = False, prompt_token_ids=(), reasoning_start: bool | None = None
    ) -> ThinkSplit:
        """One reply's state (parse_tool_calls: taken as the other parsers take it; calls come from the content).
        reasoning_start (reply_reasoning_start of its params): True, the reply starts in reasoning (its grammar
        waits for </think>: what comes before is reasoning, as vLLM reads it); False, in content (a grammar
        governs it from its first token); None: as the prompt leaves it."""
        if reasoning_start is None:
            reasoning_start = self.starts_in_reasoning(prompt_token_ids)
        return ThinkSplit(self, reasoning_start)
