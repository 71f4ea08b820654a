"""POST /v1/chat/completions: the messages through the chat template (server/chat_prompt.py, as
LLM.chat renders them), n choices, streamed as vLLM streams them (each choice's role first, then its
content, the last content chunk carrying the finish reason) or answered whole.

With tools (server/tool_choice.py), each reply is parsed for tool calls by the server's parser
(server.tool_call_parser): message.tool_calls when answered whole; streamed, text that may begin a call
is held back (tool_parsers/stream.py) and each call follows as one delta.tool_calls chunk, then an
empty delta with finish_reason "tool_calls". GPT-OSS's harmony calls (messages to functions) are read from the
reply's tokens by the reasoning parser and join the parser's calls."""

from __future__ import annotations

import json

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from jaxserve.host.request import SamplingParams, truncate_prompt
from jaxserve.server import limits as request_limits
from jaxserve.server.chat_prompt import chat_prompt_token_ids
from jaxserve.server.openai.context import ServingContext, request_size, with_adapter
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
    vllm_prompt_logprobs,
)
from jaxserve.server.openai.streams import StreamGroup, until_disconnected
from jaxserve.server.reasoning_parsers import ReasoningParser, reply_reasoning_start, with_grammar_after_reasoning
from jaxserve.server.tool_choice import ToolPlan, plan_tools, template_messages
from jaxserve.server.tool_parsers import ParsedReply
from jaxserve.server.tool_parsers.stream import ToolCallHoldback

router = APIRouter()


def checked_chat(
    context: ServingContext, body: ChatCompletionRequest, request_id: str, reasoning: ReasoningParser | None
) -> tuple[list[list[int]], SamplingParams, ToolPlan]:
    """The rendered prompt's token ids, the sampling params and what to do with tools, within the
    server's limits (a grammar held back until the reasoning ends where `reasoning` says so); ValueError."""
    limits = context.limits
    body.check(limits, request_id)
    if body.functions is not None or body.function_call is not None:
        raise ValueError("functions and function_call (OpenAI's legacy function calling) are not supported: use tools")
    logprobs = body.engine_logprobs()
    plan = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls, context.tool_parser(body.tools))
    token_ids = chat_prompt_token_ids(
        context.tokenizer,
        limits,
        template_messages(body.messages),
        context.chat_template,
        body.add_generation_prompt,
        body.continue_final_message,
        plan.tools,
        body.chat_template_kwargs,
    )
    # vLLM's truncate_prompt_tokens: the rendered conversation's last tokens (limits.max_prompt_tokens: max_model_len)
    token_ids = truncate_prompt(token_ids, body.truncate_prompt_tokens, limits.max_prompt_tokens)
    request_limits.check_token_ids(limits, token_ids)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if max_tokens is None:  # as vLLM: whatever room the context leaves
        max_tokens = max(limits.max_prompt_tokens - len(token_ids), 0)
    if max_tokens < 1:  # only completions score a prompt without generating (echo with max_tokens 0)
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    tools_text = json.dumps(plan.tools) if plan.tools else ""
    params = body.sampling_params(
        limits, max_tokens, logprobs, plan.guided_decoding, tools_text, prompt_logprobs=body.prompt_logprobs
    )
    return [token_ids], with_grammar_after_reasoning(params, reasoning, token_ids), plan


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request):
    call = await start_chat(request.app.state.context, body, request)
    if body.stream:
        return EventStreamResponse(call.events(), call.group)
    result = await until_disconnected(request.receive, call.collect())
    return JSONResponse(result) if result is not None else Response(status_code=204)


async def start_chat(context: ServingContext, body: ChatCompletionRequest, request: Request) -> ChatCall:
    """The request checked, rendered and admitted (its refusals raised as APIErrors), ready to stream or collect;
    also what /v1/responses runs its requests through (responses_api.py)."""
    context.ready_loop()
    adapter = context.check_model(body.model)
    request_id = body.request_id or request.headers.get("x-request-id", "")
    reasoning = context.reasoning()
    checked: list[tuple[list[int], SamplingParams]] = []  # the rendered prompt and its params, for the reasoning

    def check() -> tuple[list[list[int]], SamplingParams, ToolPlan]:
        prompts, params, plan = with_adapter(checked_chat(context, body, request_id, reasoning), adapter)
        checked.append((prompts[0], params))
        return prompts, params, plan

    group, plan = await context.admit(request_size(request), check, request_id, body.session_id)
    token_text = await TokenText.for_engine(group.engine_loop.engine) if body.logprobs else None
    prompt_token_ids, params = checked[0]
    return ChatCall(context, body, group, plan, reasoning, token_text, prompt_token_ids, reply_reasoning_start(params))


class ChatCall:
    def __init__(
        self,
        context: ServingContext,
        body: ChatCompletionRequest,
        group: StreamGroup,
        plan: ToolPlan,
        reasoning: ReasoningParser | None = None,
        token_text: TokenText | None = None,
        prompt_token_ids: list[int] | tuple[int, ...] = (),
        reasoning_start: bool | None = None,
    ):
        """reasoning: the parser that keeps a reply's reasoning out of its content (server.reasoning_parser),
        returned as reasoning_content; None: a reply is all content. token_text: the tokens' text and bytes for
        logprobs (TokenText.for_engine; None: text only). prompt_token_ids: the rendered prompt (a think block may
        open there); reasoning_start: where its grammar puts the reply's start (reply_reasoning_start)."""
        self.body = body
        self.group = group
        self.plan = plan
        self.reasoning = reasoning
        self.prompt_token_ids = prompt_token_ids
        self.reasoning_start = reasoning_start
        self.token_text = token_text or TokenText(group.engine_loop.engine.tokenizer)
        self.role = body.response_role
        self.echo = body.echo_text()  # leads each choice's content (vLLM's chat echo)
        self.usage = UsageCounter.of_streams(group.streams)  # events': the usage so far
        self.header = {
            "id": response_id("chatcmpl"),
            "created": now(),
            "model": context.response_model(body.model),
            "system_fingerprint": context.system_fingerprint,
        }

    def logprobs(self, token_ids: list[int], logprobs: list) -> dict | None:
        if not self.body.logprobs:
            return None
        return chat_logprobs(self.token_text, token_ids, logprobs, self.body.top_logprobs or 0)

    def chunk(
        self, index: int, delta: dict, logprobs=None, finish_reason=None, token_ids=None, stop_reason=None
    ) -> dict:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        if finish_reason is not None:  # vLLM's, on the last chunk: the stop string or stop token that ended it
            choice["stop_reason"] = stop_reason
        if token_ids is not None and self.body.return_token_ids:
            choice["token_ids"] = token_ids
        chunk = {**self.header, "object": "chat.completion.chunk", "choices": [choice]}
        if self.body.include_usage:  # vLLM's continuous_usage_stats: the usage so far in every chunk
            chunk["usage"] = self.usage.usage() if self.body.continuous_usage else None
        return chunk

    def calls(self, reply: ParsedReply | None) -> list:
        """The reply's tool calls; without parallel_tool_calls, only its first."""
        calls = list(reply.tool_calls) if reply is not None else []
        return calls if self.plan.parallel else calls[:1]

    @staticmethod
    def finish_reason(reason: str | None, calls: list) -> str | None:
        # a reply cut off by max_tokens says so even when calls were parsed before the cut
        return "tool_calls" if calls and reason == "stop" else reason

    async def events(self):
        async for chunk in self.chunks():
            yield sse(chunk)
        yield DONE

    async def chunks(self):
        """The stream's chunks as objects: a failure's is OpenAI's error body, and ends them; the usage chunk
        (include_usage) comes last."""
        usage = self.usage = UsageCounter.of_streams(self.group.streams)
        for index in range(self.body.n):
            yield self.chunk(index, {"role": self.role, "content": ""})
        for index in range(self.body.n if self.echo else 0):  # as vLLM: after every role chunk, its own chunk
            yield self.chunk(index, {"content": self.echo})
        holdbacks, splits = {}, {}
        async for position, delta in self.group.deltas():
            if (message := failure(delta, self.group.streams[position])) is not None:
                yield error_body(self.group.streams[position].error_status, message)
                break
            usage.add(position, delta)
            text, reply, reasoning = delta.text, None, ""
            found = []  # harmony's tool calls, known when the reply ends
            if self.reasoning is not None:  # the reply's tokens say which text is reasoning
                split = splits.setdefault(
                    delta.index,
                    self.reasoning.start(self.plan.parser is not None, self.prompt_token_ids, self.reasoning_start),
                )
                reasoning, text = split.feed(delta.token_ids, delta.text)
                if delta.finish_reason is not None:
                    more_reasoning, more_text = split.finish()
                    reasoning, text = reasoning + more_reasoning, text + more_text
                    found = split.tool_calls
            if self.plan.parser is not None:
                holdback = holdbacks.setdefault(delta.index, ToolCallHoldback(self.plan.parser))
                text = holdback.feed(text)
                if delta.finish_reason is not None:
                    rest, reply = holdback.finish()
                    text += rest
            calls = self.calls(ParsedReply(None, (*found, *(reply.tool_calls if reply is not None else ()))))
            finish_reason = None if calls else delta.finish_reason
            content = {"content": text} if text or (finish_reason is None and not reasoning) else {}
            if reasoning:
                content = {"reasoning_content": reasoning, **content}
            self.group.mark_sending(True)
            yield self.chunk(
                delta.index,
                content,
                self.logprobs(delta.token_ids, delta.logprobs or []),
                finish_reason,
                delta.token_ids,
                delta.stop_reason,
            )
            for number, call in enumerate(calls):
                yield self.chunk(delta.index, {"tool_calls": [{"index": number, **call.openai()}]})
            if calls:
                finish = self.finish_reason(delta.finish_reason, calls)
                yield self.chunk(delta.index, {}, finish_reason=finish, stop_reason=delta.stop_reason)
            self.group.mark_sending(False)
        else:
            if self.body.include_usage:
                yield {**self.header, "object": "chat.completion.chunk", "choices": [], "usage": usage.usage()}

    async def collect(self) -> dict:
        choices, usage = await gather_choices(self.group, lambda position, delta: delta.index)
        listed = []
        for index in sorted(choices):
            gathered = choices[index]
            content, found, reasoning = gathered.text, [], None
            if self.reasoning is not None:
                reasoning, content, found = self.reasoning.parse(
                    gathered.token_ids,
                    self.plan.parser is not None,
                    self.prompt_token_ids,
                    self.reasoning_start,
                    gathered.text,
                )
            if self.plan.parser is not None:
                reply = self.plan.parser.parse(content)
                if reply.tool_calls:
                    found, content = [*found, *reply.tool_calls], reply.content
            calls = self.calls(ParsedReply(content, tuple(found)))
            if self.echo:
                content = self.echo + (content or "")
            elif calls and not content:
                content = None
            message = {"role": self.role, "content": content, "tool_calls": [c.openai() for c in calls]}
            if self.reasoning is not None:
                message["reasoning_content"] = reasoning
            choice = {
                "index": index,
                "message": message,
                "logprobs": self.logprobs(gathered.token_ids, gathered.logprobs),
                "finish_reason": self.finish_reason(gathered.finish_reason, calls),
                "stop_reason": gathered.stop_reason,
            }
            if self.body.return_token_ids:
                choice["token_ids"] = gathered.token_ids
            listed.append(choice)
        response = {**self.header, "object": "chat.completion", "choices": listed, "usage": usage.usage()}
        if self.body.prompt_logprobs is not None:  # vLLM's: the prompt's, once for every choice
            scored = next((c.prompt_logprobs for c in choices.values() if c.prompt_logprobs is not None), [None])
            response["prompt_logprobs"] = vllm_prompt_logprobs(self.token_text, scored, self.body.prompt_logprobs)
        return response
