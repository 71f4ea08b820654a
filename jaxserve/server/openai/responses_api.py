"""POST /v1/responses, OpenAI's Responses API as vLLM serves it: the request runs as the chat completion it stands
for (responses_request.py, chat.py's start_chat), and the chat's answer is written as a response object: its
output items (a reasoning item where the reasoning parser split some off, a message with one output_text part,
a function_call item per parsed tool call), status "incomplete" when max_output_tokens cut it, and usage.

Streamed, the chat's chunks become Responses events (each with its sequence_number): response.created,
response.in_progress, then per output item output_item.added, content_part.added, the text's deltas (reasoning
as reasoning_text deltas, a call's arguments as one function_call_arguments delta), their done events,
output_item.done, and response.completed with the whole response (its status "incomplete" when cut, as vLLM).

With `store` true (the API's default) and the server's store on (server.responses_store_max_responses > 0), a
completed or incomplete response is kept with the conversation it continued (response_store.py, a bounded LRU;
streamed, as response.completed is sent; a failed or abandoned one is not): GET /v1/responses/{id} returns it,
DELETE /v1/responses/{id} removes it, GET /v1/responses/{id}/input_items lists the input it was created from
(responses_input_items.py), and a later request's previous_response_id continues it. An id not stored
(never, deleted or evicted) is a 404 naming it.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from jaxserve.server.openai import responses_input_items
from jaxserve.server.openai.chat import ChatCall, start_chat
from jaxserve.server.openai.errors import APIError
from jaxserve.server.openai.response_store import ResponseStore
from jaxserve.server.openai.responses import EventStreamResponse, now
from jaxserve.server.openai.responses_request import (
    ResponsesRequest,
    chat_request,
    check_features,
    input_messages,
    output_messages,
)
from jaxserve.server.openai.streams import until_disconnected

router = APIRouter()


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request):
    context = request.app.state.context
    store: ResponseStore = context.response_store
    check_features(body)  # a request that cannot be served is a 400 before its previous_response_id is looked up
    conversation = input_messages(body, earlier_turns(store, body.previous_response_id))
    call = await start_chat(context, chat_request(body, conversation), request)
    keep = store if body.store is not False and store.enabled else None  # store's default is true, as OpenAI's
    answer = ResponsesAnswer(body, context.response_model(body.model), conversation, keep)
    if body.stream:
        return EventStreamResponse(answer.events(call), call.group)
    result = await until_disconnected(request.receive, call.collect())
    return JSONResponse(answer.whole(result)) if result is not None else Response(status_code=204)


def earlier_turns(store: ResponseStore, previous_response_id: str | None) -> list[dict]:
    """The conversation a previous response continued, then its output as the assistant's turn."""
    if previous_response_id is None:
        return []
    stored = store.get(previous_response_id)
    if stored is None:
        raise not_stored(previous_response_id, "previous_response_id")
    return output_messages(stored.response["output"], stored.conversation)


def not_stored(response_id: str, param: str) -> APIError:
    """OpenAI's 404 for an id it does not hold (here: never stored, stored with store false, deleted or evicted)."""
    return APIError(404, f"Response with id {response_id[:100]!r} not found.", param)


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, request: Request):
    stored = request.app.state.context.response_store.get(response_id)
    if stored is None:
        raise not_stored(response_id, "response_id")
    return JSONResponse(stored.response)


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(response_id: str, request: Request):
    stored = request.app.state.context.response_store.get(response_id)
    if stored is None:
        raise not_stored(response_id, "response_id")
    query = request.query_params
    includes = query.getlist("include[]") + query.getlist("include")
    return JSONResponse(responses_input_items.page(stored.input_items, dict(query), includes))


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request):
    if not request.app.state.context.response_store.delete(response_id):
        raise not_stored(response_id, "response_id")
    return {"id": response_id, "object": "response.deleted", "deleted": True}


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage_of(chat_usage: dict | None) -> dict | None:
    if chat_usage is None:
        return None
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {
            "cached_tokens": chat_usage["prompt_tokens_details"]["cached_tokens"],
            "cache_write_tokens": 0,  # (the openai client requires it: this server writes no cache to bill)
        },
        "output_tokens": chat_usage["completion_tokens"],
        # the reasoning's tokens are not told apart from the reply's (nor are they in chat's usage)
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat_usage["total_tokens"],
    }


def reasoning_item(id_: str, text: str, status: str) -> dict:
    content = [{"type": "reasoning_text", "text": text}]
    return {"id": id_, "type": "reasoning", "summary": [], "content": content, "status": status}


def message_item(id_: str, text: str | None, status: str) -> dict:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"id": id_, "type": "message", "role": "assistant", "content": content, "status": status}


def function_call_item(id_: str, call: dict, status: str) -> dict:
    function = call["function"]
    return {
        "id": id_,
        "type": "function_call",
        "call_id": call["id"],
        "name": function["name"],
        "arguments": function["arguments"],
        "status": status,
    }


class ResponsesAnswer:
    def __init__(
        self,
        body: ResponsesRequest,
        model: str,
        conversation: list[dict] | None = None,
        store: ResponseStore | None = None,
    ):
        """conversation: the chat messages the request continued (its instructions left out); store: where the
        finished response is kept with it, None: nowhere (store false, or the server's store off)."""
        self.body = body
        self.model = model
        self.conversation = conversation or []
        self.store = store
        # the request's input as items (GET .../input_items), stored with the response
        self.input_items = responses_input_items.input_items(body.input) if store is not None else []
        self.id = item_id("resp")
        self.created_at = now()

    def kept(self, response: dict) -> dict:
        """The finished response, stored where it is to be; its `store` says whether it was (an entry over the
        store's byte bound is not)."""
        if self.store is not None:
            response["store"] = self.store.put(response, self.conversation, self.input_items)
        return response

    def response(self, status: str, output: list, usage: dict | None = None, error: dict | None = None) -> dict:
        """The response object, with the request's settings echoed as OpenAI's (and the client's model) has them."""
        body = self.body
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "model": self.model,
            "status": status,
            "output": output,
            "usage": usage,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions,
            "metadata": body.metadata,
            "max_output_tokens": body.max_output_tokens,
            "max_tool_calls": body.max_tool_calls,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": body.reasoning,
            "service_tier": body.service_tier or "auto",
            "store": self.store is not None,
            "background": False,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "text": body.text or {"format": {"type": "text"}},
            "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
            "tools": body.tools or [],
            "top_logprobs": 0,
            "truncation": "disabled",
            "user": body.user,
        }

    def whole(self, completion: dict) -> dict:
        """A chat completion (ChatCall.collect) as the response."""
        choice = completion["choices"][0]
        message, calls = choice["message"], choice["message"].get("tool_calls") or []
        status = "incomplete" if choice["finish_reason"] == "length" else "completed"
        output = []
        if message.get("reasoning_content"):
            output.append(reasoning_item(item_id("rs"), message["reasoning_content"], "completed"))
        if message.get("content") or not calls:
            output.append(message_item(item_id("msg"), message.get("content") or "", status))
        output += [function_call_item(item_id("fc"), call, "completed") for call in calls]
        return self.kept(self.response(status, output, usage_of(completion["usage"])))

    async def events(self, call: ChatCall):
        """The chat call's chunks as Responses events."""
        stream = EventStream(self)
        yield stream.event("response.created", response=self.response("in_progress", []))
        yield stream.event("response.in_progress", response=self.response("in_progress", []))
        finish_reason, usage = None, None
        async for chunk in call.chunks():
            if "error" in chunk:  # the engine failed it: OpenAI's error event, then the failed response
                error = chunk["error"]
                yield stream.event("error", code=str(error["code"]), message=error["message"], param=error["param"])
                failed = {"code": "server_error", "message": error["message"]}
                yield stream.event("response.failed", response=self.response("failed", stream.output, None, failed))
                return
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                delta = choice["delta"]
                for event in stream.text("reasoning", delta.get("reasoning_content") or ""):
                    yield event
                for event in stream.text("message", delta.get("content") or ""):
                    yield event
                for tool_call in delta.get("tool_calls") or []:
                    for event in stream.function_call(tool_call):
                        yield event
                finish_reason = choice["finish_reason"] or finish_reason
        status = "incomplete" if finish_reason == "length" else "completed"
        if not any(item["type"] in ("message", "function_call") for item in stream.output):
            for event in stream.text("message", "", opening=True):  # an empty reply is still an empty message
                yield event
        for event in stream.close(status):
            yield event
        completed = self.kept(self.response(status, stream.output, usage_of(usage)))
        yield stream.event("response.completed", response=completed)  # stored first: a retrieve after it finds it


@dataclass
class OpenText:
    """The reasoning or message item being streamed."""

    kind: str  # "reasoning" or "message"
    id: str
    index: int  # its output_index
    text: str = ""


class EventStream:
    """Numbers the events and keeps the output items, the one being streamed open until another begins."""

    def __init__(self, answer: ResponsesAnswer):
        self.answer = answer
        self.sequence_number = 0
        self.output: list[dict] = []
        self.open: OpenText | None = None

    def event(self, kind: str, **fields) -> str:
        payload = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        # OpenAI names each event's type on its own line too
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"

    def text(self, kind: str, delta: str, opening: bool = False):
        if not delta and not opening:
            return
        if self.open is None or self.open.kind != kind:
            yield from self.close("completed")
            self.open = OpenText(kind, item_id("rs" if kind == "reasoning" else "msg"), len(self.output))
            item = self.item(self.open, "in_progress", with_text=False)
            self.output.append(item)
            yield self.event("response.output_item.added", output_index=self.open.index, item=item)
            yield self.event("response.content_part.added", **self.where(), part=self.part(kind, ""))
        self.open.text += delta
        if delta:
            delta_event = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
            extra = {} if kind == "reasoning" else {"logprobs": []}
            yield self.event(delta_event, **self.where(), delta=delta, **extra)

    def function_call(self, tool_call: dict):
        """A parsed call comes whole (one chunk): its item opens, its arguments are one delta, and it is done."""
        yield from self.close("completed")
        index, id_ = len(self.output), item_id("fc")
        arguments = tool_call["function"]["arguments"]
        self.output.append(function_call_item(id_, tool_call, "completed"))
        added = {**self.output[-1], "arguments": "", "status": "in_progress"}
        yield self.event("response.output_item.added", output_index=index, item=added)
        where = {"item_id": id_, "output_index": index}
        yield self.event("response.function_call_arguments.delta", **where, delta=arguments)
        yield self.event("response.function_call_arguments.done", **where, arguments=arguments)
        yield self.event("response.output_item.done", output_index=index, item=self.output[-1])

    def close(self, status: str):
        """The open item's done events; status: the message's ("incomplete" when the reply was cut)."""
        open_, self.open = self.open, None
        if open_ is None:
            return
        where = {"item_id": open_.id, "output_index": open_.index, "content_index": 0}
        if open_.kind == "reasoning":
            yield self.event("response.reasoning_text.done", **where, text=open_.text)
        else:
            yield self.event("response.output_text.done", **where, text=open_.text, logprobs=[])
        yield self.event("response.content_part.done", **where, part=self.part(open_.kind, open_.text))
        item = self.output[open_.index] = self.item(open_, status if open_.kind == "message" else "completed")
        yield self.event("response.output_item.done", output_index=open_.index, item=item)

    def where(self) -> dict:
        assert self.open is not None
        return {"item_id": self.open.id, "output_index": self.open.index, "content_index": 0}

    @staticmethod
    def part(kind: str, text: str) -> dict:
        if kind == "reasoning":
            return {"type": "reasoning_text", "text": text}
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    @staticmethod
    def item(open_: OpenText, status: str, with_text: bool = True) -> dict:
        if open_.kind == "reasoning":
            item = reasoning_item(open_.id, open_.text, status)
            return item if with_text else {**item, "content": []}
        return message_item(open_.id, open_.text if with_text else None, status)
