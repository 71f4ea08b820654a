"""Request bodies of the OpenAI-compatible API, as vLLM's server accepts them (its extras included:
top_k, min_p, ignore_eos, stop_token_ids, session_id, request_id, return_token_ids, repetition_penalty,
min_tokens, bad_words, allowed_token_ids, include_stop_str_in_output, skip_special_tokens,
spaces_between_special_tokens, chat echo and the guided_* fields).

Fields the engine cannot honour are refused with the reason rather than silently ignored when a
client sets them to anything but their neutral value (best_of, suffix, the legacy functions,
UNHONOURED_FIELDS); fields that change nothing here (user) are accepted and unknown ones
ignored, as vLLM and OpenAI do.
Constrained output (response_format, guided_*, structured_outputs) is read by structured.py.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from jaxserve.host.request import GuidedDecodingParams, SamplingParams
from jaxserve.server import limits as request_limits
from jaxserve.server.limits import RequestLimits
from jaxserve.server.openai.structured import guide_text, guided_decoding

# A token id as JSON gives it: pydantic's lax int would read `true` as token 1.
TokenId = StrictInt
DEFAULT_COMPLETION_MAX_TOKENS = 16  # vLLM's and OpenAI's default for /v1/completions
# vLLM's extras that would change the output and that this server does not honour, with their neutral values:
# declared (extra="ignore" would drop them unseen) so that any other value is refused, not ignored.
UNHONOURED_FIELDS: dict[str, Any] = {
    "use_beam_search": False,
}


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingRequest(BaseModel):
    """What completions and chat completions share."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    session_id: str | None = None  # marks a conversation that will continue: its prefix stays cached
    request_id: str | None = None  # a label for logs and metrics; the X-Request-Id header works too
    return_token_ids: bool = False  # each choice (and chunk) also carries its token ids
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's extra, as transformers': over prompt and output
    logit_bias: dict[str, float] | None = None  # {token id (as a string): bias in [-100, 100]}
    min_tokens: int | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # constrained output (structured.py): OpenAI's response_format, vLLM's guided_* and structured_outputs
    response_format: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    structured_outputs: dict[str, Any] | None = None
    best_of: int | None = None  # refused unless it equals n
    # vLLM's: every prompt token's logprob (and this many top alternatives) in the response, vLLM's shape
    prompt_logprobs: StrictInt | None = None
    use_beam_search: Any = False
    # vLLM's: only the prompt's last k tokens (the rendered chat's for chat), -1: the last max_model_len
    truncate_prompt_tokens: Any = None

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """vLLM's continuous_usage_stats (with include_usage): every chunk carries the usage so far."""
        return self.include_usage and self.stream_options is not None and self.stream_options.continuous_usage_stats

    def check(self, limits: RequestLimits, request_id: str) -> None:
        """The server's caps (limits.py) and the features the engine lacks; ValueError naming the field."""
        request_limits.check_ids(limits, request_id=request_id, session_id=self.session_id or "", user=self.user or "")
        request_limits.check_stops(limits, self.stop_strings, self.stop_token_ids or [])
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported by this server (only best_of = n)")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream = true")
        for name, neutral in UNHONOURED_FIELDS.items():
            value = getattr(self, name)
            if value is not None and value != neutral:
                raise ValueError(f"{name} is not supported by this server, got {value!r}")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs are not available when stream is true (as vLLM)")

    def sampling_params(
        self,
        limits: RequestLimits,
        max_tokens: int,
        logprobs: int | None,
        tool_guide: GuidedDecodingParams | None = None,
        tools_text: str = "",
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """Raises ValueError (SamplingParams checks every value; the limits bound the rest). tool_guide: the
        grammar that tool_choice "required" or a named function imposes (tool_choice.py)."""
        guided = guided_decoding(self)
        if guided is not None and tool_guide is not None:
            raise ValueError(
                "tool_choice 'required' or a named function constrains the output already: "
                "it cannot be combined with response_format or guided decoding"
            )
        guided = guided or tool_guide
        request_limits.check_structured(
            limits,
            [*guide_text(guided), tools_text, *(self.bad_words or [])],
            len(self.logit_bias or {}) + len(self.allowed_token_ids or []),
        )
        params = SamplingParams(
            n=self.n,
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_k=self.top_k or 0,
            top_p=1.0 if self.top_p is None else self.top_p,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            stop=self.stop_strings,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=self.logit_bias,
            min_tokens=self.min_tokens or 0,
            bad_words=self.bad_words,
            allowed_token_ids=self.allowed_token_ids,
            guided_decoding=guided,
            prompt_logprobs=prompt_logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
        )
        # normalized to (token id, bias) pairs by SamplingParams
        request_limits.check_vocabulary(limits, [t for t, _ in params.logit_bias or ()], "logit_bias keys")
        request_limits.check_vocabulary(limits, params.allowed_token_ids or (), "allowed_token_ids")
        return params


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    # the prompt leads each choice's text; with logprobs, its tokens lead the logprobs too (the first
    # token's logprob is null), and max_tokens 0 scores the prompt without generating
    echo: bool = False
    logprobs: int | None = None  # top logprobs per token (the sampled token's is always given)
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a batch of strings or of token-id lists, or a single one of either."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise ValueError("prompt is empty")
        # pydantic has parsed one of the list types whole: token ids are one prompt, anything else a batch
        token_ids = [t for t in prompt if isinstance(t, int)]
        return [token_ids] if token_ids else [p for p in prompt if isinstance(p, (str, list))]


class ChatCompletionRequest(SamplingRequest):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None  # to the template; calls parsed out of the reply (tool_choice.py)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None  # OpenAI's legacy function calling: refused, use tools
    function_call: str | dict[str, Any] | None = None
    # as vLLM: continuing the final message needs add_generation_prompt false; both true is refused
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: the reply starts with the last message's text when that message has the reply's role (an assistant
    # turn being continued)
    echo: bool = False

    @property
    def response_role(self) -> str:
        """vLLM's: the assistant's, or with add_generation_prompt false the last message's role."""
        if self.add_generation_prompt or not self.messages:
            return "assistant"
        role = self.messages[-1].get("role")
        return role if isinstance(role, str) else "assistant"

    def echo_text(self) -> str:
        """What echo puts before each reply: the last message's text if it has the reply's role, else ""."""
        if not self.echo or not self.messages or self.messages[-1].get("role") != self.response_role:
            return ""
        content = self.messages[-1].get("content")
        if isinstance(content, list):  # content parts: their texts, a line each (as vLLM joins them)
            return "\n".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
        return content if isinstance(content, str) else ""

    def engine_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs = true")
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages rendered through the template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # messages rendered exactly as /v1/chat/completions renders them
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[TokenId] = Field(default_factory=list)
