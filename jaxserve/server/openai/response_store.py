"""The Responses API's store (vLLM's response_store and msg_store, bounded): what `store: true` keeps of a
response so that GET /v1/responses/{id} can return it and a later request can continue it by
previous_response_id.

Each entry is the response object as answered, its request's input items (GET .../input_items) and the
conversation it continued: the chat messages its input
stood for after the earlier turns it was chained to, without its instructions (they apply to one response
only, as OpenAI documents). The store is an LRU bounded by a count and by the entries' total JSON bytes
(server.responses_store_max_responses / _max_bytes): storing past either bound evicts the least recently used
(stored, retrieved or continued) first, and an entry larger than the byte bound alone is not stored. Memory
stays bounded whatever the clients do, which vLLM's unbounded dicts are not (hence its opt-in env flag).

One store per server process, used only on the HTTP server's event loop: its methods never await, so no lock
is needed. Entries are kept as JSON bytes: their size is exact, and what a caller changes in a dict it got or
gave cannot change what is stored.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass, field

from jaxserve.server.config_file import RESPONSES_STORE_MAX_BYTES, RESPONSES_STORE_MAX_RESPONSES


@dataclass(frozen=True)
class StoredResponse:
    response: dict  # the response object as answered (its output items among it)
    conversation: list[dict]  # the chat messages it continued, its instructions left out
    input_items: list[dict] = field(default_factory=list)  # its request's input as items (responses_input_items.py)


class ResponseStore:
    def __init__(self, max_responses: int = RESPONSES_STORE_MAX_RESPONSES, max_bytes: int = RESPONSES_STORE_MAX_BYTES):
        """max_responses 0 (or max_bytes 0): nothing is stored, and `store` is answered as false."""
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, bytes] = OrderedDict()
        self.total_bytes = 0

    @property
    def enabled(self) -> bool:
        return self.max_responses > 0 and self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: dict, conversation: list[dict], input_items: list[dict] | None = None) -> bool:
        """Keeps the response under its id, evicting the least recently used past the bounds; False: not kept
        (the store is off, or this entry alone is over the byte bound)."""
        stored = {"response": response, "conversation": conversation, "input_items": input_items or []}
        entry = json.dumps(stored, separators=(",", ":")).encode()
        if not self.enabled or len(entry) > self.max_bytes:
            return False
        self.delete(response["id"])
        self._entries[response["id"]] = entry
        self.total_bytes += len(entry)
        while len(self._entries) > self.max_responses or self.total_bytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.total_bytes -= len(evicted)
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        """The stored entry (a fresh copy), now the most recently used; None: never stored, deleted or evicted."""
        entry = self._entries.get(response_id)
        if entry is None:
            return None
        self._entries.move_to_end(response_id)
        stored = json.loads(entry)
        return StoredResponse(stored["response"], stored["conversation"], stored["input_items"])

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self.total_bytes -= len(entry)
        return True
