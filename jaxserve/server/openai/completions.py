"""POST /v1/completions: one or more prompts (strings or token ids), n choices each, streamed as
server-sent events or answered whole. Choice i * n + j is prompt i's completion j, as in vLLM."""

from __future__ import annotations

from collections import defaultdict

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from jaxserve.host.request import SamplingParams
from jaxserve.server import limits as request_limits
from jaxserve.server.openai.context import ServingContext, request_size
from jaxserve.server.openai.errors import error_body
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
)
from jaxserve.server.openai.streams import StreamGroup, until_disconnected

router = APIRouter()


def checked_completion(
    context: ServingContext, body: CompletionRequest, request_id: str
) -> tuple[list, SamplingParams, list[str]]:
    """The prompts, sampling params and (with echo) prompt texts, within the server's limits; ValueError."""
    limits = context.limits
    body.check(limits, request_id)
    if body.suffix:
        raise ValueError("suffix is not supported by this server")
    if body.echo and body.logprobs is not None:
        raise ValueError("echo with logprobs needs the prompt's logprobs, which this server does not compute")
    prompts = body.prompts()
    if len(prompts) > context.ready_loop().max_in_flight:
        raise ValueError(f"{len(prompts)} prompts in one request, more than the server runs at once")
    for position, prompt in enumerate(prompts):
        if not prompt:
            raise ValueError("a prompt is empty")
        if isinstance(prompt, str):
            request_limits.check_prompt(limits, prompt, [], f"prompt[{position}]" if len(prompts) > 1 else "prompt")
        else:
            request_limits.check_prompt(limits, "", prompt)
    max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    params = body.sampling_params(limits, max_tokens, body.logprobs)
    echo_texts = [p if isinstance(p, str) else context.tokenizer.decode(p) for p in prompts] if body.echo else []
    return prompts, params, echo_texts


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request):
    context: ServingContext = request.app.state.context
    context.ready_loop()
    context.check_model(body.model)
    request_id = body.request_id or request.headers.get("x-request-id", "")
    group, echo_texts = await context.admit(
        request_size(request), lambda: checked_completion(context, body, request_id), request_id, body.session_id
    )
    call = CompletionCall(context, body, group, echo_texts)
    if body.stream:
        return EventStreamResponse(call.events(), group)
    result = await until_disconnected(request.receive, call.collect())
    return JSONResponse(result) if result is not None else Response(status_code=204)


class CompletionCall:
    def __init__(self, context: ServingContext, body: CompletionRequest, group: StreamGroup, echo_texts: list[str]):
        self.body = body
        self.group = group
        self.echo_texts = echo_texts
        self.token_text = TokenText(group.engine_loop.engine.tokenizer)
        self.header = {
            "id": response_id("cmpl"),
            "object": "text_completion",
            "created": now(),
            "model": context.model_name,
            "system_fingerprint": context.system_fingerprint,
        }

    def choice(
        self, index: int, text: str, token_ids: list[int], logprobs: list, finish_reason: str | None, text_offset: int
    ) -> dict:
        choice = {
            "index": index,
            "text": text,
            "finish_reason": finish_reason,
            "stop_reason": None,
            "logprobs": completion_logprobs(self.token_text, token_ids, logprobs, text_offset)
            if self.body.logprobs is not None
            else None,
        }
        if self.body.return_token_ids:
            choice["token_ids"] = token_ids
        return choice

    async def events(self):
        usage, echoed, offsets = UsageCounter(), set(), defaultdict(int)
        async for position, delta in self.group.deltas():
            if (message := failure(delta)) is not None:
                yield sse(error_body(self.group.streams[position].error_status, message))
                break
            usage.add(position, delta)
            index = position * self.body.n + delta.index
            text = delta.text
            if self.echo_texts and index not in echoed:  # the prompt leads each choice's first chunk
                echoed.add(index)
                text = self.echo_texts[position] + text
            chunk = {
                **self.header,
                "choices": [
                    self.choice(index, text, delta.token_ids, delta.logprobs or [], delta.finish_reason, offsets[index])
                ],
            }
            offsets[index] += len(text)
            if self.body.include_usage:
                chunk["usage"] = None
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
            listed.append(
                self.choice(
                    index, echo + gathered.text, gathered.token_ids, gathered.logprobs, gathered.finish_reason, 0
                )
            )
        return {**self.header, "choices": listed, "usage": usage.usage()}
