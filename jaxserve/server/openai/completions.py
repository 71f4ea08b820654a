"""POST /v1/completions: one or more prompts (strings or token ids), n choices each, streamed as
server-sent events or answered whole. Choice i * n + j is prompt i's completion j, as in vLLM.

echo with logprobs scores the prompt too (SamplingParams.prompt_logprobs): each choice's logprobs start
with the prompt's tokens, the first one's null; with max_tokens 0 nothing is generated (OpenAI's way of
scoring a text, which lm-evaluation-harness's loglikelihood requests use)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from jaxserve.host.request import SamplingParams, truncate_prompt
from jaxserve.server import limits as request_limits
from jaxserve.server.openai.context import ServingContext, request_size, with_adapter
from jaxserve.server.openai.errors import APIError, error_body
from jaxserve.server.openai.protocol import DEFAULT_COMPLETION_MAX_TOKENS, CompletionRequest
from jaxserve.server.openai.responses import (
    DONE,
    EventStreamResponse,
    TokenText,
    UsageCounter,
    completion_logprobs,
    failure,
    gather_choices,
    now,
    response_id,
    sse,
    vllm_prompt_logprobs,
    within_top,
)
from jaxserve.server.openai.streams import StreamGroup, until_disconnected

router = APIRouter()


@dataclass
class Echo:
    """What each prompt's choices start with, under echo: its text and (with logprobs) its token ids."""

    texts: list[str]
    token_ids: list[list[int]]
    # vLLM's prompt_logprobs asked: each prompt's token ids (the entries' own tokens)
    scored_token_ids: list[list[int]] | None = None


def checked_completion(
    context: ServingContext, body: CompletionRequest, request_id: str
) -> tuple[list, SamplingParams, Echo]:
    """The prompts, sampling params and (with echo) what the choices echo, within the server's limits;
    ValueError."""
    limits = context.limits
    body.check(limits, request_id)
    if body.suffix:
        raise ValueError("suffix is not supported by this server")
    if body.max_tokens is not None and body.max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0, got {body.max_tokens}")
    # vLLM's truncate_prompt_tokens on token-id prompts (text prompts: the engine truncates what it tokenizes)
    prompts = [
        p if isinstance(p, str) else truncate_prompt(p, body.truncate_prompt_tokens, limits.max_prompt_tokens)
        for p in body.prompts()
    ]
    if len(prompts) > context.ready_loop().max_in_flight:
        raise ValueError(f"{len(prompts)} prompts in one request, more than the server runs at once")
    for position, prompt in enumerate(prompts):
        if isinstance(prompt, list) and not prompt:
            raise ValueError("a prompt is empty")  # "" is tokenized by the engine: [BOS] where one is added
        if isinstance(prompt, str):  # (not check_prompt: its "" means no text, and this "" is a prompt)
            request_limits.check_text(limits, prompt, f"prompt[{position}]" if len(prompts) > 1 else "prompt")
        else:
            request_limits.check_prompt(limits, "", prompt)
    max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    scores_prompt = body.echo and body.logprobs is not None
    # the engine scores the prompt once for echo's logprobs and vLLM's prompt_logprobs: the more alternatives
    asked = [n for n in (body.logprobs if scores_prompt else None, body.prompt_logprobs) if n is not None]
    params = body.sampling_params(limits, max_tokens, body.logprobs, prompt_logprobs=max(asked, default=None))
    echo = Echo([], [])
    if body.echo:
        echo.texts = [p if isinstance(p, str) else context.tokenizer.decode(p) for p in prompts]
    if scores_prompt or body.prompt_logprobs is not None:  # the engine's tokenizing: the scored tokens
        scored = [
            truncate_prompt(context.tokenizer.encode(p), body.truncate_prompt_tokens, limits.max_prompt_tokens)
            if isinstance(p, str)
            else list(p)
            for p in prompts
        ]
        echo.token_ids = scored if scores_prompt else []
        echo.scored_token_ids = scored if body.prompt_logprobs is not None else None
    return prompts, params, echo


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request):
    context: ServingContext = request.app.state.context
    context.ready_loop()
    adapter = context.check_model(body.model)
    request_id = body.request_id or request.headers.get("x-request-id", "")
    group, echo = await context.admit(
        request_size(request),
        lambda: with_adapter(checked_completion(context, body, request_id), adapter),
        request_id,
        body.session_id,
    )
    call = CompletionCall(context, body, group, echo)
    if body.stream:
        return EventStreamResponse(call.events(), group)
    result = await until_disconnected(request.receive, call.collect())
    return JSONResponse(result) if result is not None else Response(status_code=204)


class CompletionCall:
    def __init__(self, context: ServingContext, body: CompletionRequest, group: StreamGroup, echo: Echo):
        self.body = body
        self.group = group
        self.echo = echo
        self.echo_texts = echo.texts
        self.token_text = TokenText(group.engine_loop.engine.tokenizer)  # no `bytes` in completions' logprobs
        self.header = {
            "id": response_id("cmpl"),
            "object": "text_completion",
            "created": now(),
            "model": context.response_model(body.model),
            "system_fingerprint": context.system_fingerprint,
        }

    def choice(
        self,
        index: int,
        text: str,
        token_ids: list[int],
        logprobs: list,
        finish_reason: str | None,
        text_offset: int,
        prompt_logprobs: list | None = None,
        stop_reason: int | str | None = None,
    ) -> dict:
        """prompt_logprobs: the engine's for the choice's prompt (None first), given to the part that echoes
        the prompt when the prompt is scored; its tokens then lead the logprobs."""
        scored_token_ids = token_ids
        if self.echo.token_ids and prompt_logprobs is not None:
            scored_token_ids = self.echo.token_ids[index // self.body.n] + token_ids
            logprobs = prompt_logprobs + logprobs
        choice = {
            "index": index,
            "text": text,
            "finish_reason": finish_reason,
            "stop_reason": stop_reason,
            "logprobs": completion_logprobs(self.token_text, scored_token_ids, logprobs, text_offset)
            if self.body.logprobs is not None
            else None,
        }
        if self.body.return_token_ids:
            choice["token_ids"] = token_ids
        return choice

    def vllm_prompt_logprobs(self, index: int, prompt_logprobs: list | None) -> list | None:
        """The choice's `prompt_logprobs` (vLLM's field), when asked: one entry per prompt token, None first."""
        scored, num_top = self.echo.scored_token_ids, self.body.prompt_logprobs
        assert scored is not None and num_top is not None  # checked_completion tokenized them for it
        token_ids = scored[index // self.body.n]
        if prompt_logprobs is None and len(token_ids) == 1:  # a one-token prompt: a router's replica sends nothing
            prompt_logprobs = [None]
        if prompt_logprobs is None or len(prompt_logprobs) != len(token_ids):
            raise APIError(500, "the engine returned no logprobs for the prompt's tokens")
        return vllm_prompt_logprobs(self.token_text, prompt_logprobs, num_top, token_ids)

    def scored_prompt(self, index: int, prompt_logprobs: list | None) -> list | None:
        """What the choice's echo leads its logprobs with (None: the prompt is not scored). A one-token
        prompt's only entry is None, which a router's replica sends as nothing."""
        if not self.echo.token_ids:
            return None
        num_prompt_tokens = len(self.echo.token_ids[index // self.body.n])
        if prompt_logprobs is None and num_prompt_tokens == 1:
            return [None]
        if prompt_logprobs is None or len(prompt_logprobs) != num_prompt_tokens:
            raise APIError(500, "the engine returned no logprobs for the prompt's tokens")
        if (self.body.prompt_logprobs or 0) > (self.body.logprobs or 0):  # scored with more alternatives than echo's
            token_ids = self.echo.token_ids[index // self.body.n]
            prompt_logprobs = [
                None if entry is None else within_top(entry, self.body.logprobs or 0, token_ids[position])
                for position, entry in enumerate(prompt_logprobs)
            ]
        return prompt_logprobs

    async def events(self):
        usage, echoed, offsets = UsageCounter.of_streams(self.group.streams), set(), defaultdict(int)
        async for position, delta in self.group.deltas():
            if (message := failure(delta, self.group.streams[position])) is not None:
                yield sse(error_body(self.group.streams[position].error_status, message))
                break
            usage.add(position, delta)
            index = position * self.body.n + delta.index
            text, prompt_logprobs = delta.text, None
            if self.echo_texts and index not in echoed:  # the prompt leads each choice's first chunk
                echoed.add(index)
                text = self.echo_texts[position] + text
                prompt_logprobs = self.scored_prompt(index, delta.prompt_logprobs)
            choice = self.choice(
                index,
                text,
                delta.token_ids,
                delta.logprobs or [],
                delta.finish_reason,
                offsets[index],
                prompt_logprobs,
                delta.stop_reason,
            )
            chunk = {**self.header, "choices": [choice]}
            offsets[index] += len(text)
            if self.body.include_usage:  # vLLM's continuous_usage_stats: the usage so far in every chunk
                chunk["usage"] = usage.usage() if self.body.continuous_usage else None
            self.group.mark_sending(True)
            yield sse(chunk)
            self.group.mark_sending(False)
        else:
            if self.body.include_usage:
                yield sse({**self.header, "choices": [], "usage": usage.usage()})
        yield DONE

    async def collect(self) -> dict:
        choices, usage = await gather_choices(self.group, lambda position, delta: position * self.body.n + delta.index)
        listed = []
        for index in sorted(choices):
            echo = self.echo_texts[index // self.body.n] if self.echo_texts else ""
            gathered = choices[index]
            choice = self.choice(
                index,
                echo + gathered.text,
                gathered.token_ids,
                gathered.logprobs,
                gathered.finish_reason,
                0,
                self.scored_prompt(index, gathered.prompt_logprobs),
                gathered.stop_reason,
            )
            if self.body.prompt_logprobs is not None:
                choice["prompt_logprobs"] = self.vllm_prompt_logprobs(index, gathered.prompt_logprobs)
            listed.append(choice)
        return {**self.header, "choices": listed, "usage": usage.usage()}
