"""GET /v1/responses/{id}/input_items: the input a stored response was created from, as OpenAI lists it.

What is listed is the request's own input (not the earlier turns a previous_response_id chained it to), each
item an object with an id: the client's where it gave one, else a new one (msg_ / fc_ / fco_ / rs_); a message's
string content as one input_text part (output_text for the assistant's). The list is a cursor page as OpenAI's:
`order` desc (the default: the last input item first) or asc, `limit` 1-100 (default 20), `after` an item id
from which the page continues, and first_id / last_id / has_more for the next page (the openai client's
auto-pagination follows them). Items are recorded when the response is stored (response_store.py), after the
input was read as chat messages, so every item here is one that input_messages accepted.
"""

from __future__ import annotations

import uuid
from typing import Any

from jaxserve.server.openai.errors import APIError

DEFAULT_LIMIT = 20
MAX_LIMIT = 100
ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def input_items(raw_input: str | list[Any]) -> list[dict]:
    """A request's `input` as the item objects input_items lists."""
    items = [{"type": "message", "role": "user", "content": raw_input}] if isinstance(raw_input, str) else raw_input
    return [listed_item(item) for item in items]


def listed_item(item: dict) -> dict:
    kind = item.get("type", "message")
    listed = {key: value for key, value in item.items() if value is not None}
    listed["type"] = kind
    listed["id"] = item.get("id") or f"{ID_PREFIXES.get(kind, 'item')}_{uuid.uuid4().hex}"
    if kind == "message":
        text_kind = "output_text" if item["role"] == "assistant" else "input_text"
        content = item["content"]
        parts = [{"type": text_kind, "text": content}] if isinstance(content, str) else content
        listed["content"] = [
            {**part, "annotations": part.get("annotations", [])} if part["type"] == "output_text" else part
            for part in parts
        ]
    if kind != "reasoning":
        listed.setdefault("status", "completed")
    return listed


def page(items: list[dict], query: dict[str, str], includes: list[str]) -> dict:
    """The cursor page of `items` the query asks for (after, limit, order; include refused: text items only)."""
    if includes:
        raise APIError(400, f"include {includes!r} is not supported on input items (text only)", "include")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise APIError(400, f"order must be 'asc' or 'desc', got {order[:50]!r}", "order")
    try:
        limit = int(query.get("limit", DEFAULT_LIMIT))
    except ValueError:
        raise APIError(400, f"limit must be an integer, got {query['limit'][:50]!r}", "limit") from None
    if not 1 <= limit <= MAX_LIMIT:
        raise APIError(400, f"limit must be between 1 and {MAX_LIMIT}, got {limit}", "limit")
    ordered = items if order == "asc" else items[::-1]
    start = 0
    if (after := query.get("after")) is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise APIError(400, f"after {after[:100]!r} is not an input item of this response", "after")
        start = ids.index(after) + 1
    data = ordered[start : start + limit]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": start + limit < len(ordered),
    }
