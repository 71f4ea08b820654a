"""What one request may ask of the server, checked before any costly work (tokenizing, queueing).

Every refusal is a ValueError whose message names the limit and the config key that sets it; the
gRPC service turns it into INVALID_ARGUMENT, and the OpenAI HTTP API is to call the same functions
(and answer 400). Limits that hold for the offline API too (stop token ids inside the vocabulary,
max_model_len) are also checked by SamplingParams and Engine.validate.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from jaxserve.loading.tokenizer import check_unicode

# A token rarely spans more bytes than this; a longer text cannot fit into max_model_len tokens.
PROMPT_BYTES_PER_TOKEN = 16
# Room for a request's small fields (sampling numbers, tags and lengths) in the size bounds below.
SMALL_FIELDS_BYTES = 1024
MIN_MESSAGE_BYTES = 64 * 1024
TOKEN_ID_ENTRY_BYTES = 14  # a logit_bias map entry on the wire: tags, lengths, a varint id and a float


@dataclass(frozen=True)
class RequestLimits:
    max_prompt_bytes: int  # UTF-8 bytes of a text prompt (and of a Tokenize call)
    max_prompt_tokens: int  # token ids of a prompt (and of a Detokenize call): max_model_len
    vocab_size: int
    max_stop_strings: int = 64
    max_stop_string_bytes: int = 8192  # all of a request's stop strings together, UTF-8
    max_stop_token_ids: int = 256
    max_id_length: int = 256  # request_id and session_id, in characters
    # a guided-decoding spec (schema, regex, grammar, choices), the tools' JSON and bad_words together, UTF-8
    max_structured_bytes: int = 65536
    max_sampling_token_ids: int = 1024  # entries of logit_bias and allowed_token_ids together

    @classmethod
    def for_engine(
        cls, max_model_len: int, vocab_size: int, max_prompt_bytes: int | None = None, **caps
    ) -> RequestLimits:
        """max_prompt_bytes None: what max_model_len tokens can plausibly hold."""
        return cls(
            max_prompt_bytes=max_prompt_bytes or max_model_len * PROMPT_BYTES_PER_TOKEN,
            max_prompt_tokens=max_model_len,
            vocab_size=vocab_size,
            **caps,
        )

    @property
    def max_generate_request_bytes(self) -> int:
        """The most bytes a GenerateRequest within every limit can take on the wire: a larger one is
        refused before it is parsed. Token ids take at most 5 bytes, a stop string 4 besides its own,
        an id character 4."""
        return (
            self.max_prompt_bytes
            + 5 * self.max_prompt_tokens
            + self.max_stop_string_bytes
            + 4 * self.max_stop_strings
            + 5 * self.max_stop_token_ids
            + 8 * self.max_id_length
            + self.max_structured_bytes
            + TOKEN_ID_ENTRY_BYTES * self.max_sampling_token_ids
            + SMALL_FIELDS_BYTES
        )

    @property
    def max_tokenize_request_bytes(self) -> int:
        return self.max_prompt_bytes + SMALL_FIELDS_BYTES

    @property
    def max_detokenize_request_bytes(self) -> int:
        return 5 * self.max_prompt_tokens + SMALL_FIELDS_BYTES


def utf8_size_exceeds(text: str, limit: int) -> bool:
    """len(text.encode()) > limit, without encoding when the length alone decides (1-4 bytes a character)."""
    if len(text) > limit:
        return True
    if 4 * len(text) <= limit:
        return False
    return len(text.encode("utf-8", "surrogatepass")) > limit


def default_max_message_bytes(max_model_len: int, **caps) -> int:
    """The receive limit when server.max_message_bytes is not set: twice the largest request within
    the caps (at least 64 KiB). gRPC refuses a larger message (RESOURCE_EXHAUSTED) as soon as its
    length is known, before the server spends anything on it."""
    largest = RequestLimits.for_engine(max_model_len, vocab_size=1, **caps).max_generate_request_bytes
    return max(MIN_MESSAGE_BYTES, 2 * largest)


def check_request_size(num_bytes: int, limit: int) -> None:
    """Before parsing: a request larger than any within the limits is refused unread."""
    if num_bytes > limit:
        raise ValueError(
            f"the request is {num_bytes} bytes, more than a request within this server's limits "
            f"can take ({limit}; see server.max_prompt_bytes and the other caps)"
        )


def check_text(limits: RequestLimits, text: str, what: str = "the text") -> None:
    if utf8_size_exceeds(text, limits.max_prompt_bytes):
        raise ValueError(f"{what} is longer than {limits.max_prompt_bytes} bytes (server.max_prompt_bytes)")
    check_unicode(text, what)


def check_token_ids(limits: RequestLimits, token_ids: Sequence[int], what: str = "the prompt") -> None:
    if len(token_ids) > limits.max_prompt_tokens:
        raise ValueError(f"{what} has {len(token_ids)} token ids, more than max_model_len ({limits.max_prompt_tokens})")


def check_prompt(
    limits: RequestLimits, text: str, token_ids: Sequence[int], what: str = "the prompt"
) -> str | list[int]:
    """The prompt: exactly one of text and token ids, within the size limits."""
    if bool(text) == bool(token_ids):
        raise ValueError("set exactly one of text and token_ids")
    if text:
        check_text(limits, text, what)
        return text
    check_token_ids(limits, token_ids)
    return list(token_ids)


def check_stops(limits: RequestLimits, stop: Sequence[str], stop_token_ids: Sequence[int]) -> None:
    if len(stop) > limits.max_stop_strings:
        raise ValueError(f"{len(stop)} stop strings, more than {limits.max_stop_strings} (server.max_stop_strings)")
    budget = limits.max_stop_string_bytes
    if utf8_size_exceeds("".join(stop), budget):
        raise ValueError(f"the stop strings together are longer than {budget} bytes (server.max_stop_string_bytes)")
    for position, text in enumerate(stop):
        check_unicode(text, f"stop string {position}")
    if len(stop_token_ids) > limits.max_stop_token_ids:
        raise ValueError(
            f"{len(stop_token_ids)} stop_token_ids, more than {limits.max_stop_token_ids} (server.max_stop_token_ids)"
        )
    outside = [t for t in stop_token_ids if not 0 <= t < limits.vocab_size]
    if outside:
        raise ValueError(f"stop_token_ids {outside[:5]} are outside the vocabulary [0, {limits.vocab_size})")


def check_ids(limits: RequestLimits, **ids: str) -> None:
    """request_id=..., session_id=...: each at most max_id_length characters."""
    for name, value in ids.items():
        if len(value) > limits.max_id_length:
            raise ValueError(
                f"{name} is {len(value)} characters long, more than {limits.max_id_length} (server.max_id_length)"
            )
        check_unicode(value, name)  # ids are logged: a surrogate would fail the log line


def check_structured(limits: RequestLimits, texts: Sequence[str], num_token_ids: int) -> None:
    """texts: the request's guided-decoding spec, tools' JSON and bad words; num_token_ids: its logit_bias
    and allowed_token_ids entries."""
    if utf8_size_exceeds("".join(texts), limits.max_structured_bytes):
        raise ValueError(
            f"the guided-decoding spec, tools and bad_words together are longer than {limits.max_structured_bytes} "
            f"bytes (server.max_structured_bytes)"
        )
    if num_token_ids > limits.max_sampling_token_ids:
        raise ValueError(
            f"logit_bias and allowed_token_ids have {num_token_ids} entries, more than "
            f"{limits.max_sampling_token_ids} (server.max_sampling_token_ids)"
        )


def check_vocabulary(limits: RequestLimits, token_ids, what: str) -> None:
    """Token ids a request names (logit_bias keys, allowed_token_ids) inside the vocabulary."""
    outside = sorted(t for t in token_ids if not 0 <= t < limits.vocab_size)
    if outside:
        raise ValueError(f"{what} {outside[:5]} outside the vocabulary [0, {limits.vocab_size})")
