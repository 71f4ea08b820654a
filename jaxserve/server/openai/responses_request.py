"""POST /v1/responses' request body, read as vLLM's serving_responses reads it: turned into the chat completion
request it stands for, so that it renders, samples, constrains and parses tool calls exactly as
/v1/chat/completions does (chat.py).

    input                 a string (one user message) or items: messages (role user, system, developer or
                          assistant; content a string or input_text / output_text parts), function_call and
                          function_call_output items of an earlier turn (the assistant's tool_calls and the tool
                          messages), reasoning items (dropped: templates drop past reasoning too)
    instructions          a system message before the input
    max_output_tokens     max_completion_tokens
    text.format           response_format (json_schema / json_object)
    tools, tool_choice    Responses' flat function tools, as chat's {"type": "function", "function": {...}}

    previous_response_id  the stored response's conversation (response_store.py) first, then its output items as
                          the assistant's turn (tool calls included, reasoning dropped), then the input; its
                          instructions are not carried over (they apply to one response only, as OpenAI's)

What the server cannot do is refused (400 naming the field) rather than ignored: conversation (no conversations
are stored), background, prompt templates, built-in tools, non-text input parts, logprobs and truncation "auto".
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from jaxserve.server.openai.errors import APIError
from jaxserve.server.openai.protocol import ChatCompletionRequest, StreamOptions, TokenId

TEXT_PARTS = ("input_text", "output_text", "text")
# vLLM's sampling extras a Responses request may carry (extra_body), handed to the chat request as they are
SAMPLING_EXTRAS = (
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "request_id",
    "session_id",
    "chat_template_kwargs",
)
# include values that ask for nothing this server has: reasoning is returned in plain text, never encrypted
HARMLESS_INCLUDES = ("reasoning.encrypted_content",)


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: str | None = None
    previous_response_id: str | None = None
    # refused unless neutral (checked_features)
    conversation: Any = None
    background: bool | None = None
    prompt: Any = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    truncation: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    request_id: str | None = None
    session_id: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


def refuse(message: str, param: str) -> APIError:
    return APIError(400, message, param)


def check_features(body: ResponsesRequest) -> None:
    """APIError for what this server does not serve."""
    if body.conversation is not None:
        raise refuse("conversation is not supported: this server stores no conversations", "conversation")
    if body.background:
        raise refuse("background is not supported: responses are answered (or streamed) as they run", "background")
    if body.prompt is not None:
        raise refuse("prompt (stored prompt templates) is not supported: send the input itself", "prompt")
    unsupported = [name for name in body.include or () if name not in HARMLESS_INCLUDES]
    if unsupported:
        raise refuse(f"include {unsupported!r} is not supported", "include")
    if body.top_logprobs:
        raise refuse("top_logprobs is not supported on /v1/responses: use /v1/chat/completions", "top_logprobs")
    if body.truncation not in (None, "disabled"):
        raise refuse(f"truncation {body.truncation!r} is not supported (only 'disabled')", "truncation")
    if body.max_output_tokens is not None and body.max_output_tokens < 1:
        raise refuse(f"max_output_tokens must be >= 1, got {body.max_output_tokens}", "max_output_tokens")


def part_text(part: Any, where: str) -> dict:
    """An input_text / output_text part as chat's text part."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
        shown = kind if kind is not None else type(part).__name__
        raise refuse(
            f"{where}: only input_text and output_text parts are supported (a text model), got {shown!r}", where
        )
    return {"type": "text", "text": part["text"]}


def message(item: dict, where: str) -> dict:
    role, content = item.get("role"), item.get("content")
    if role not in ("user", "system", "developer", "assistant"):
        raise refuse(
            f"{where}.role must be 'user', 'system', 'developer' or 'assistant', got {role!r}", f"{where}.role"
        )
    if isinstance(content, list):
        return {"role": role, "content": [part_text(part, f"{where}.content[{n}]") for n, part in enumerate(content)]}
    if not isinstance(content, str):
        raise refuse(f"{where}.content must be a string or a list of text parts", f"{where}.content")
    return {"role": role, "content": content}


def text_of(value: Any, where: str) -> str:
    """A function_call_output's output: its text, or its text parts joined."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(part_text(part, f"{where}[{n}]")["text"] for n, part in enumerate(value))
    raise refuse(f"{where} must be a string or a list of text parts", where)


def input_messages(body: ResponsesRequest, history: list[dict] | None = None) -> list[dict]:
    """The conversation the request continues: the earlier turns (a stored response's, by previous_response_id)
    then the chat messages its input stands for (as vLLM's construct_input_messages); not its instructions."""
    items = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    messages = item_messages(items, list(history or ()), "input")
    if not messages:
        raise refuse("input is empty", "input")
    return messages


def output_messages(output: list[dict], messages: list[dict]) -> list[dict]:
    """A stored response's output items, as the assistant's turn after `messages` (the conversation it continued)."""
    return item_messages(output, messages, "previous response's output")


def item_messages(items: list, messages: list[dict], name: str) -> list[dict]:
    """`messages` with the chat messages `items` stand for appended; name: where the items are, for refusals."""
    for number, item in enumerate(items):
        where = f"{name}[{number}]"
        if not isinstance(item, dict):
            raise refuse(f"{where} must be an object (a message or a function_call / function_call_output item)", where)
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(message(item, where))
        elif kind == "function_call":
            call_id, name_, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
            if not all(isinstance(value, str) for value in (call_id, name_, arguments)):
                raise refuse(f"{where}: a function_call needs call_id, name and arguments as strings", where)
            call = {"id": call_id, "type": "function", "function": {"name": name_, "arguments": arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)  # parallel calls: one assistant turn, as chat sends them
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise refuse(f"{where}: a function_call_output needs the call_id of its function_call", where)
            output = text_of(item.get("output"), f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind != "reasoning":  # an earlier turn's reasoning is left out, as templates leave it out
            raise refuse(
                f"{where}: input items of type {kind!r} are not supported (only message, function_call, "
                "function_call_output and reasoning)",
                f"{where}.type",
            )
    return messages


def chat_tools(tools: list[dict] | None) -> list[dict] | None:
    """Responses' function tools ({"type", "name", "description", "parameters", "strict"}) in chat's shape."""
    if not tools:
        return None
    converted = []
    for number, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            raise refuse(
                f"tools[{number}]: tools of type {kind!r} are not supported (no built-in tools: only 'function')",
                f"tools[{number}].type",
            )
        function = {key: tool[key] for key in ("name", "description", "parameters") if tool.get(key) is not None}
        converted.append({"type": "function", "function": function})
    return converted


def chat_tool_choice(tool_choice: str | dict | None) -> str | dict | None:
    if not isinstance(tool_choice, dict):
        return tool_choice  # "none", "auto", "required" (anything else is refused by plan_tools)
    if tool_choice.get("type") != "function" or not isinstance(tool_choice.get("name"), str):
        raise refuse(
            "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}, "
            f"got {tool_choice!r}"[:300],
            "tool_choice",
        )
    return {"type": "function", "function": {"name": tool_choice["name"]}}


def response_format(text: dict | None) -> dict | None:
    """text.format as chat's response_format."""
    spec = (text or {}).get("format")
    if spec is None:
        return None
    kind = spec.get("type") if isinstance(spec, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        schema = {key: spec[key] for key in ("name", "schema", "strict", "description") if key in spec}
        return {"type": "json_schema", "json_schema": schema}
    raise refuse(f"text.format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}", "text.format")


def chat_request(body: ResponsesRequest, conversation: list[dict] | None = None) -> ChatCompletionRequest:
    """The chat completion request `body` stands for; APIError (400) for what cannot be served.
    conversation: input_messages' (the earlier turns first); None: the input's alone."""
    check_features(body)
    conversation = input_messages(body) if conversation is None else conversation
    instructions = [{"role": "system", "content": body.instructions}] if body.instructions else []
    extras = {name: value for name in SAMPLING_EXTRAS if (value := getattr(body, name)) is not None}
    try:
        return ChatCompletionRequest(
            model=body.model,
            messages=[*instructions, *conversation],
            max_completion_tokens=body.max_output_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            stream=body.stream,
            # a streamed response ends with its usage, as the chat stream's last chunk carries it
            stream_options=StreamOptions(include_usage=True) if body.stream else None,
            tools=chat_tools(body.tools),
            tool_choice=chat_tool_choice(body.tool_choice),
            parallel_tool_calls=body.parallel_tool_calls,
            response_format=response_format(body.text),
            user=body.user,
            **extras,
        )
    except ValidationError as error:
        raise refuse(f"the request cannot be read as a chat: {error.errors()[0].get('msg')}", "input") from None
