"""The prefix cache's host tier: KV of pages evicted from the device, kept in host memory by key so that
a later hit brings them back instead of recomputing them (the engine moves the bytes: device/page_copies.py)."""

from __future__ import annotations

from collections import OrderedDict

from jaxserve.host.kv_events import HOST, NO_EVENTS, RankEvents


class HostTier:
    """KV of demoted pages in host memory, by key; the least recently stored is dropped when full."""

    def __init__(self, capacity_pages: int):
        self.capacity_pages = capacity_pages
        self.entries: OrderedDict[int, tuple[tuple[int, tuple[int, ...]], object]] = OrderedDict()
        self.events: RankEvents = NO_EVENTS

    def __len__(self) -> int:
        return len(self.entries)

    def store(self, key: int, contents: tuple[int, tuple[int, ...]], data) -> None:
        if key not in self.entries:  # a key demoted again (recomputed meanwhile) is one page, one event
            self.events.stored(key, contents[0], len(contents[1]), HOST)
        self.entries[key] = (contents, data)
        self.entries.move_to_end(key)
        while len(self.entries) > self.capacity_pages:
            self.events.removed(self.entries.popitem(last=False)[0], HOST)

    def has(self, key: int, contents: tuple[int, tuple[int, ...]]) -> bool:
        entry = self.entries.get(key)
        return entry is not None and entry[0] == contents

    def take(self, key: int):
        self.events.removed(key, HOST)
        return self.entries.pop(key)[1]

    def clear(self) -> None:
        self.entries.clear()
