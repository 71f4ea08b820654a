"""GPT-OSS's harmony format (o200k_harmony): a reply is a run of messages, each
`<|start|>{role}<|channel|>{channel}<|message|>{text}<|end|>` (the last one ending in <|return|>, or
<|call|> for a tool call; the first one's `<|start|>assistant` is the generation prompt's). Text on the
"final" channel (and "commentary", a user-visible preamble) is content; "analysis" is reasoning.

A message addressed to a function, `<|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json
<|message|>{...}<|call|>` (the recipient may also follow the role: `assistant to=functions.NAME<|channel|>...`),
is a tool call: NAME and the body's text as its arguments, never content (when the request's tools are
parsed; otherwise its body is text as before). A recipient that is no function (a built-in tool, python or
browser) changes nothing: its channel decides.

A reply that never opens a message (no <|message|> within its first MAX_HEADER_TOKENS tokens: a model
not writing harmony at all) is all content.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from jaxserve.server.reasoning_parsers.whole_reply import WholeReplies
from jaxserve.server.tool_parsers.base import ToolCall

SPECIAL = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>")
REASONING_CHANNELS = ("analysis",)
MAX_HEADER_TOKENS = 32  # a header is a role, a channel and maybe a recipient: a few tokens
FUNCTION_RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")


@dataclass
class ReasoningSplit:
    """One reply's state: where in the harmony structure its tokens so far stand."""

    parser: HarmonyReasoning
    mode: str = "header"  # header (role / channel, up to <|message|>) | body | between (after <|end|>)
    header_ids: list[int] = field(default_factory=list)
    channel: str | None = None
    body_ids: list[int] = field(default_factory=list)
    body_sent: int = 0  # characters of the body's text passed on
    plain: bool = False  # no harmony here: every token is content
    parse_tool_calls: bool = False  # messages to functions become tool_calls (the request has tools)
    function: str | None = None  # the function the current message calls
    tool_calls: list[ToolCall] = field(default_factory=list)

    def feed(self, token_ids: list[int], text: str | None = None) -> tuple[str, str]:
        """(reasoning, content) text these tokens add (read from the ids: harmony's markers are special tokens,
        which the engine's text leaves out; `text` is not used)."""
        reasoning, content = [], []
        for token_id in token_ids:
            self._step(token_id, reasoning, content)
        self._flush_body(reasoning, content, final=False)
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """(reasoning, content) text still held when the reply ends (an unfinished header is content)."""
        reasoning, content = [], []
        self._flush_body(reasoning, content, final=True)
        if self.mode == "body" and self.function is not None:  # cut off inside a call: what it has so far
            self._end_call()
        if self.mode == "header" and self.header_ids:
            content.append(self.parser.text(self.header_ids))
            self.header_ids = []
        return "".join(reasoning), "".join(content)

    def _step(self, token_id: int, reasoning: list[str], content: list[str]) -> None:
        ids = self.parser.ids
        if self.plain:
            self.body_ids.append(token_id)
            return
        if self.mode == "header":
            if token_id == ids["<|message|>"]:
                self.channel = self.parser.channel_of(self.header_ids)
                self.function = self.parser.function_of(self.header_ids) if self.parse_tool_calls else None
                self.mode, self.header_ids, self.body_ids, self.body_sent = "body", [], [], 0
            else:
                self.header_ids.append(token_id)
                # not harmony: all content from the start (only the first header decides: later ones follow
                # a message, so the reply is harmony, and a long function name may take many tokens)
                if len(self.header_ids) > MAX_HEADER_TOKENS and not self.tool_calls and self.channel is None:
                    self.plain, self.mode, self.body_ids, self.header_ids = True, "body", self.header_ids, []
            return
        if self.mode == "body":
            if token_id in (ids["<|end|>"], ids["<|return|>"], ids["<|call|>"]):
                if self.function is not None:
                    self._end_call()
                self._flush_body(reasoning, content, final=True)
                self.mode = "between"
            else:
                self.body_ids.append(token_id)
            return
        if token_id == ids["<|start|>"]:  # between messages: the next one's header begins
            self.mode, self.header_ids = "header", []

    def _end_call(self) -> None:
        assert self.function is not None
        self.tool_calls.append(ToolCall(self.function, self.parser.text(self.body_ids).strip()))
        self.function, self.body_ids = None, []

    def _flush_body(self, reasoning: list[str], content: list[str], final: bool) -> None:
        if self.mode != "body" or not self.body_ids or self.function is not None:  # a call's body is held
            return
        text = self.parser.text(self.body_ids)
        if not final and text.endswith("\ufffd"):  # a character cut between tokens: wait for the rest
            return
        piece, self.body_sent = text[self.body_sent :], len(text)
        (reasoning if self.channel in REASONING_CHANNELS and not self.plain else content).append(piece)


@dataclass(frozen=True)
class HarmonyReasoning(WholeReplies):
    """The harmony format as one tokenizer writes it: its special tokens' ids."""

    tokenizer: object
    ids: dict

    @classmethod
    def for_tokenizer(cls, tokenizer) -> HarmonyReasoning:
        ids = {token: tokenizer.token_to_id(token) for token in SPECIAL}  # type: ignore[attr-defined]
        missing = [token for token, token_id in ids.items() if token_id is None]
        if missing:
            raise ValueError(
                f"reasoning_parser gpt_oss needs the harmony special tokens; the tokenizer lacks {missing}"
            )
        return cls(tokenizer, ids)

    def start(
        self, parse_tool_calls: bool = False, prompt_token_ids=(), reasoning_start: bool | None = None
    ) -> ReasoningSplit:
        """One reply's state; parse_tool_calls: messages to functions become its tool_calls (a reply's first
        header is its own: the prompt does not matter here)."""
        return ReasoningSplit(self, parse_tool_calls=parse_tool_calls)

    def text(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)  # type: ignore[attr-defined]

    def function_of(self, header_ids: list[int]) -> str | None:
        """The function a message header addresses (`to=functions.NAME`, after the role or the channel)."""
        # special tokens (<|channel|>, <|constrain|>) decode to nothing: a space keeps the words apart
        match = FUNCTION_RECIPIENT.search("".join(self.text([token_id]) or " " for token_id in header_ids))
        return match.group(1) if match else None

    def channel_of(self, header_ids: list[int]) -> str | None:
        """The channel a message header names: the first word after <|channel|> (None: no channel)."""
        if self.ids["<|channel|>"] not in header_ids:
            return None
        after = header_ids[header_ids.index(self.ids["<|channel|>"]) + 1 :]
        words = self.text(after).split()
        return words[0] if words else None
