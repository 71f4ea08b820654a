"""The gRPC Chat call's own parts: its messages and tools read from the proto, each message's text split into
reasoning and content by the reasoning parser (GenerateResponse.reasoning_content, text), and the tool calls parsed
out of each completion's content onto its last message (GenerateResponse.tool_calls, content). GPT-OSS's harmony
channels and calls are read from the token ids (the text has lost harmony's special tokens), as the HTTP chat does."""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterator

from jaxserve.host.request import SamplingParams, truncate_prompt
from jaxserve.proto import jaxserve_pb2 as pb
from jaxserve.server import limits as request_limits
from jaxserve.server.chat_prompt import chat_prompt_token_ids
from jaxserve.server.limits import RequestLimits
from jaxserve.server.reasoning_parsers import ReasoningParser, ReasoningSplit, ThinkSplit
from jaxserve.server.sampling_proto import check_sampling, sampling_params_from_proto
from jaxserve.server.tool_choice import ToolPlan, parser_for_template, plan_tools, template_messages
from jaxserve.server.tool_parsers.base import ToolCall


def messages_from_proto(messages) -> list[dict]:
    converted = []
    for message in messages:
        entry: dict = {"role": message.role, "content": message.content}
        if message.tool_calls:
            entry["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments or "{}"}}
                for c in message.tool_calls
            ]
        if message.tool_call_id:
            entry["tool_call_id"] = message.tool_call_id
        if message.name:
            entry["name"] = message.name
        converted.append(entry)
    return converted


def tools_from_proto(tools) -> list[dict] | None:
    """ChatRequest.tools: each an OpenAI tool object's JSON text."""
    parsed = []
    for position, text in enumerate(tools):
        try:
            parsed.append(json.loads(text))
        except (json.JSONDecodeError, RecursionError) as error:  # RecursionError: nested past Python's stack
            raise ValueError(f"tools[{position}] is not JSON (or is nested too deeply): {error}") from None
    return parsed or None


def tool_plan(request: pb.ChatRequest, tokenizer, chat_template: str | None, parser_name: str) -> ToolPlan:
    tools = tools_from_proto(request.tools)
    choice: str | dict | None = request.tool_choice or None
    if request.tool_choice_function:
        choice = {"type": "function", "function": {"name": request.tool_choice_function}}
    parallel = request.parallel_tool_calls if request.HasField("parallel_tool_calls") else None
    return plan_tools(tools, choice, parallel, parser_for_template(parser_name, tokenizer, chat_template, tools))


def checked_chat(
    request: pb.ChatRequest, tokenizer, limits: RequestLimits, chat_template: str | None, parser_name: str
) -> tuple[list[int], SamplingParams, ToolPlan]:
    """The rendered prompt, the sampling params and the tool plan of a Chat call; ValueError."""
    request_limits.check_ids(limits, request_id=request.request_id, session_id=request.session_id)
    check_sampling(limits, request.sampling, list(request.tools))
    plan = tool_plan(request, tokenizer, chat_template, parser_name)
    params = sampling_params_from_proto(request.sampling, plan.guided_decoding)
    add_generation_prompt = (
        request.add_generation_prompt
        if request.HasField("add_generation_prompt")
        else not request.continue_final_message
    )
    token_ids = chat_prompt_token_ids(
        tokenizer,
        limits,
        template_messages(messages_from_proto(request.messages)),
        chat_template,
        add_generation_prompt,
        request.continue_final_message,
        plan.tools,
    )
    # truncate_prompt_tokens: the rendered conversation's last tokens, as the engine (and HTTP chat) uses them
    token_ids = truncate_prompt(token_ids, params.truncate_prompt_tokens, limits.max_prompt_tokens)
    return token_ids, params, plan


def with_tool_calls(
    responses: Iterator[pb.GenerateResponse],
    plan: ToolPlan,
    harmony: ReasoningParser | None = None,
    prompt_token_ids: list[int] | tuple[int, ...] = (),
    reasoning_start: bool | None = None,
) -> Iterator[pb.GenerateResponse]:
    """The responses, with harmony each one's text split into reasoning_content and text (the final and commentary
    channels) from its token ids, and each completion's last one carrying the calls parsed from its whole content
    (with harmony, also the messages its token ids address to functions)."""
    texts: dict[int, str] = defaultdict(str)  # each completion's content so far (tools only)
    splits: dict[int, ReasoningSplit | ThinkSplit] = {}
    for response in responses:
        found: list[ToolCall] = []  # harmony's calls, known when the completion ends
        if harmony is not None:
            # a call's body is held back by the split (never text) only when the request has tools to parse
            split = splits.setdefault(
                response.index, harmony.start(plan.parser is not None, prompt_token_ids, reasoning_start)
            )
            reasoning, text = split.feed(list(response.token_ids), response.text)
            if response.finish_reason:
                more_reasoning, more_text = split.finish()
                reasoning, text = reasoning + more_reasoning, text + more_text
                found = splits.pop(response.index).tool_calls
            response.text, response.reasoning_content = text, reasoning
        if plan.parser is not None:
            texts[response.index] += response.text
            if response.finish_reason:
                text = texts.pop(response.index)
                reply = plan.parser.parse(text)
                calls = [*found, *reply.tool_calls]
                calls = calls if plan.parallel else calls[:1]
                if calls:
                    response.tool_calls.extend(pb.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in calls)
                    response.content = (reply.content if reply.tool_calls else text.strip()) or ""
                    if response.finish_reason == "stop":
                        response.finish_reason = "tool_calls"
        yield response
