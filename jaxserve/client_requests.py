"""The gRPC requests jaxserve.client sends, built from keyword arguments named as SamplingParams' fields
(Generate) and as OpenAI's chat fields (Chat: messages, tools, tool_choice)."""

from __future__ import annotations

import json

from jaxserve.proto import jaxserve_pb2 as pb


def build_sampling(
    *,
    max_tokens: int = 16,
    temperature: float | None = None,
    top_k: int = 0,
    top_p: float | None = None,
    min_p: float = 0.0,
    seed: int | None = None,
    stop: list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    ignore_eos: bool = False,
    logprobs: int = 0,
    n: int = 1,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    repetition_penalty: float | None = None,
    logit_bias: dict[int, float] | None = None,
    min_tokens: int = 0,
    bad_words: list[str] | None = None,
    allowed_token_ids: list[int] | None = None,
    guided_json: dict | str | None = None,
    guided_json_object: bool = False,
    guided_regex: str | None = None,
    guided_choice: list[str] | None = None,
    guided_grammar: str | None = None,
    guided_whitespace_pattern: str | None = None,
    guided_structural_tag: dict | str | None = None,
    prompt_logprobs: int | None = None,
    prompt_only: bool = False,
    lora: str = "",
    include_stop_str_in_output: bool = False,
    skip_special_tokens: bool = True,
    spaces_between_special_tokens: bool = True,
    truncate_prompt_tokens: int | None = None,
) -> pb.SamplingParams:
    """The proto's SamplingParams; at most one guided_* constrains the output (ValueError for two: the proto's
    oneof would keep only the last)."""
    sampling = pb.SamplingParams(
        max_tokens=max_tokens,
        top_k=top_k,
        min_p=min_p,
        stop=stop or [],
        stop_token_ids=stop_token_ids or [],
        ignore_eos=ignore_eos,
        logprobs=logprobs,
        n=n,
        presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty,
        logit_bias={int(k): v for k, v in (logit_bias or {}).items()},
        min_tokens=min_tokens,
        bad_words=bad_words or [],
        allowed_token_ids=allowed_token_ids or [],
        prompt_only=prompt_only,
        lora=lora,
        include_stop_str_in_output=include_stop_str_in_output,
        keep_special_tokens=not skip_special_tokens,
        no_spaces_between_special_tokens=not spaces_between_special_tokens,
    )
    if prompt_logprobs is not None:
        sampling.prompt_logprobs = prompt_logprobs
    if truncate_prompt_tokens is not None:
        sampling.truncate_prompt_tokens = truncate_prompt_tokens
    for name, value in (("temperature", temperature), ("top_p", top_p), ("repetition_penalty", repetition_penalty)):
        if value is not None:
            setattr(sampling, name, value)
    if seed is not None:
        sampling.seed = seed
    guided = sampling.guided_decoding
    given = {
        "guided_json": guided_json is not None,
        "guided_json_object": guided_json_object,
        "guided_regex": guided_regex is not None,
        "guided_choice": guided_choice is not None,
        "guided_grammar": guided_grammar is not None,
        "guided_structural_tag": guided_structural_tag is not None,
    }
    if sum(given.values()) > 1:
        raise ValueError(
            f"at most one of {', '.join(given)} constrains the output; got {[k for k, v in given.items() if v]}"
        )
    if guided_json is not None:
        guided.json_schema = guided_json if isinstance(guided_json, str) else json.dumps(guided_json)
    if guided_json_object:
        guided.json_object = True
    if guided_regex is not None:
        guided.regex = guided_regex
    if guided_choice is not None:
        guided.choice.choices.extend(guided_choice)
    if guided_grammar is not None:
        guided.grammar = guided_grammar
    if guided_structural_tag is not None:
        guided.structural_tag = (
            guided_structural_tag if isinstance(guided_structural_tag, str) else json.dumps(guided_structural_tag)
        )
    if guided_whitespace_pattern is not None:
        guided.whitespace_pattern = guided_whitespace_pattern
    return sampling


def build_request(
    prompt: str | list[int], *, request_id: str = "", session_id: str = "", **sampling
) -> pb.GenerateRequest:
    """sampling: build_sampling's keyword arguments."""
    request = pb.GenerateRequest(request_id=request_id, sampling=build_sampling(**sampling), session_id=session_id)
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.extend(prompt)
    return request


def build_chat_request(
    messages: list[dict],
    *,
    tools: list[dict] | None = None,
    tool_choice: str | dict = "",
    parallel_tool_calls: bool | None = None,
    add_generation_prompt: bool | None = None,
    continue_final_message: bool = False,
    request_id: str = "",
    session_id: str = "",
    **sampling,
) -> pb.ChatRequest:
    """messages as OpenAI's ({"role", "content"}, an assistant's "tool_calls", a tool's "tool_call_id");
    tools as OpenAI's tool objects; tool_choice "auto", "none", "required" or {"function": {"name": ...}}."""
    request = pb.ChatRequest(
        request_id=request_id,
        messages=[_chat_message(m) for m in messages],
        sampling=build_sampling(**sampling),
        session_id=session_id,
        continue_final_message=continue_final_message,
        tools=[json.dumps(tool) for tool in tools or []],
    )
    if isinstance(tool_choice, dict):
        request.tool_choice_function = tool_choice["function"]["name"]
    else:
        request.tool_choice = tool_choice
    if parallel_tool_calls is not None:
        request.parallel_tool_calls = parallel_tool_calls
    if add_generation_prompt is not None:
        request.add_generation_prompt = add_generation_prompt
    return request


def _chat_message(message: dict) -> pb.ChatMessage:
    calls = [
        pb.ToolCall(id=c.get("id", ""), name=c["function"]["name"], arguments=c["function"].get("arguments", "{}"))
        for c in message.get("tool_calls") or []
    ]
    return pb.ChatMessage(
        role=message["role"],
        content=message.get("content") or "",
        tool_calls=calls,
        tool_call_id=message.get("tool_call_id", ""),
        name=message.get("name", ""),
    )
