"""GPT-OSS's harmony format (o200k_harmony): a reply is a run of messages, each
`<|start|>{role}<|channel|>{channel}<|message|>{text}<|end|>` (the last one ending in <|return|>, or
<|call|> for a tool call; the first one's `<|start|>assistant` is the generation prompt's). Text on the
"final" channel (and "commentary", a user-visible preamble) is content; "analysis" is reasoning.

A reply that never opens a message (no <|message|> within its first MAX_HEADER_TOKENS tokens: a model
not writing harmony at all) is all content.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SPECIAL = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>")
REASONING_CHANNELS = ("analysis",)
MAX_HEADER_TOKENS = 32  # a header is a role, a channel and maybe a recipient: a few tokens


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

    def feed(self, token_ids: list[int]) -> tuple[str, str]:
        """(reasoning, content) text these tokens add."""
        reasoning, content = [], []
        for token_id in token_ids:
            self._step(token_id, reasoning, content)
        self._flush_body(reasoning, content, final=False)
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """(reasoning, content) text still held when the reply ends (an unfinished header is content)."""
        reasoning, content = [], []
        self._flush_body(reasoning, content, final=True)
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
                self.mode, self.header_ids, self.body_ids, self.body_sent = "body", [], [], 0
            else:
                self.header_ids.append(token_id)
                if len(self.header_ids) > MAX_HEADER_TOKENS:  # not harmony: all content from the start
                    self.plain, self.mode, self.body_ids, self.header_ids = True, "body", self.header_ids, []
            return
        if self.mode == "body":
            if token_id in (ids["<|end|>"], ids["<|return|>"], ids["<|call|>"]):
                self._flush_body(reasoning, content, final=True)
                self.mode = "between"
            else:
                self.body_ids.append(token_id)
            return
        if token_id == ids["<|start|>"]:  # between messages: the next one's header begins
            self.mode, self.header_ids = "header", []

    def _flush_body(self, reasoning: list[str], content: list[str], final: bool) -> None:
        if self.mode != "body" or not self.body_ids:
            return
        text = self.parser.text(self.body_ids)
        if not final and text.endswith("\ufffd"):  # a character cut between tokens: wait for the rest
            return
        piece, self.body_sent = text[self.body_sent :], len(text)
        (reasoning if self.channel in REASONING_CHANNELS and not self.plain else content).append(piece)


@dataclass(frozen=True)
class HarmonyReasoning:
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

    def start(self) -> ReasoningSplit:
        return ReasoningSplit(self)

    def split(self, token_ids: list[int]) -> tuple[str | None, str]:
        """A whole reply's (reasoning or None when it has none, content)."""
        state = self.start()
        reasoning, content = state.feed(token_ids)
        more_reasoning, more_content = state.finish()
        return (reasoning + more_reasoning) or None, content + more_content

    def text(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)  # type: ignore[attr-defined]

    def channel_of(self, header_ids: list[int]) -> str | None:
        """The channel a message header names: the first word after <|channel|> (None: no channel)."""
        if self.ids["<|channel|>"] not in header_ids:
            return None
        after = header_ids[header_ids.index(self.ids["<|channel|>"]) + 1 :]
        words = self.text(after).split()
        return words[0] if words else None
