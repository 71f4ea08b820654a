"""POST /v1/chat/completions: the messages through the chat template (server/chat_prompt.py, as
LLM.chat renders them), n choices, streamed as vLLM streams them (each choice's role first, then its
content, the last content chunk carrying the finish reason) or answered whole."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from jaxserve.host.request import SamplingParams
from jaxserve.server import limits as request_limits
from jaxserve.server.chat_prompt import chat_prompt_token_ids
from jaxserve.server.openai.context import ServingContext, request_size
from jaxserve.server.openai.errors import error_body
from jaxserve.server.openai.protocol import ChatCompletionRequest
from jaxserve.server.openai.responses import (
    DONE,
    EventStreamResponse,
    TokenText,
    UsageCounter,
    chat_logprobs,
    failure,
    gather_choices,
    now,
    response_id,
    sse,
)
from jaxserve.server.openai.streams import StreamGroup, until_disconnected

router = APIRouter()


def checked_chat(
    context: ServingContext, body: ChatCompletionRequest, request_id: str
) -> tuple[list[list[int]], SamplingParams, None]:
    """The rendered prompt's token ids and the sampling params, within the server's limits; ValueError."""
    limits = context.limits
    body.check(limits, request_id)
    if body.tool_choice not in (None, "none", "auto"):
        raise ValueError("tool_choice other than 'auto' or 'none' is not supported: tool calls are not parsed")
    logprobs = body.engine_logprobs()
    token_ids = chat_prompt_token_ids(
        context.tokenizer,
        limits,
        body.messages,
        context.chat_template,
        body.add_generation_prompt,
        body.continue_final_message,
        body.tools,
        body.chat_template_kwargs,
    )
    request_limits.check_token_ids(limits, token_ids)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if max_tokens is None:  # as vLLM: whatever room the context leaves
        max_tokens = max(limits.max_prompt_tokens - len(token_ids), 0)
    return [token_ids], body.sampling_params(max_tokens, logprobs), None


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request):
    context: ServingContext = request.app.state.context
    context.ready_loop()
    context.check_model(body.model)
    request_id = body.request_id or request.headers.get("x-request-id", "")
    group, _ = await context.admit(
        request_size(request), lambda: checked_chat(context, body, request_id), request_id, body.session_id
    )
    call = ChatCall(context, body, group)
    if body.stream:
        return EventStreamResponse(call.events(), group)
    result = await until_disconnected(request.receive, call.collect())
    return JSONResponse(result) if result is not None else Response(status_code=204)


class ChatCall:
    def __init__(self, context: ServingContext, body: ChatCompletionRequest, group: StreamGroup):
        self.body = body
        self.group = group
        self.token_text = TokenText(group.engine_loop.engine.tokenizer)
        self.header = {
            "id": response_id("chatcmpl"),
            "created": now(),
            "model": context.model_name,
            "system_fingerprint": context.system_fingerprint,
        }

    def logprobs(self, token_ids: list[int], logprobs: list) -> dict | None:
        if not self.body.logprobs:
            return None
        return chat_logprobs(self.token_text, token_ids, logprobs, self.body.top_logprobs or 0)

    def chunk(self, index: int, delta: dict, logprobs=None, finish_reason=None, token_ids=None) -> str:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        if token_ids is not None and self.body.return_token_ids:
            choice["token_ids"] = token_ids
        chunk = {**self.header, "object": "chat.completion.chunk", "choices": [choice]}
        if self.body.include_usage:
            chunk["usage"] = None
        return sse(chunk)

    async def events(self):
        for index in range(self.body.n):
            yield self.chunk(index, {"role": "assistant", "content": ""})
        usage = UsageCounter()
        async for position, delta in self.group.deltas():
            if (message := failure(delta)) is not None:
                yield sse(error_body(self.group.streams[position].error_status, message))
                break
            usage.add(position, delta)
            content = {"content": delta.text} if delta.text or delta.finish_reason is None else {}
            self.group.mark_sending(True)
            yield self.chunk(
                delta.index,
                content,
                self.logprobs(delta.token_ids, delta.logprobs or []),
                delta.finish_reason,
                delta.token_ids,
            )
            self.group.mark_sending(False)
        else:
            if self.body.include_usage:
                yield sse({**self.header, "object": "chat.completion.chunk", "choices": [], "usage": usage.usage()})
        yield DONE

    async def collect(self) -> dict:
        choices, usage = await gather_choices(self.group, lambda position, delta: delta.index)
        listed = []
        for index in sorted(choices):
            gathered = choices[index]
            choice = {
                "index": index,
                "message": {"role": "assistant", "content": gathered.text, "tool_calls": []},
                "logprobs": self.logprobs(gathered.token_ids, gathered.logprobs),
                "finish_reason": gathered.finish_reason,
                "stop_reason": None,
            }
            if self.body.return_token_ids:
                choice["token_ids"] = gathered.token_ids
            listed.append(choice)
        return {**self.header, "object": "chat.completion", "choices": listed, "usage": usage.usage()}
