"""The router's view of one replica's prefix cache: the replica's own page events applied in order,
plus the pages the router has just sent there, which the replica has not stored yet.

Plain Python, no JAX, no gRPC: events in, view out. A snapshot replaces the view; a delta whose first
number does not follow the last one applied is a gap, and the caller resubscribes.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from jaxserve.host.kv_events import DEVICE, HOST, CacheState, KVEvent
from jaxserve.host.page_allocator import ROOT_KEY, page_key

MAX_PENDING_PAGES = 4096  # beyond this, expired pending pages are swept when more are noted


def prefix_keys(token_ids: list[int], page_size: int, root_key: int = ROOT_KEY) -> list[int]:
    """The keys of the full pages a replica could find cached for this prompt, chained from `root_key` (the
    base model's, or a LoRA adapter's identity as the replica reports it). As the scheduler does, the last
    prompt token is never looked up: its logits must be computed."""
    keys, parent = [], root_key
    for start in range(0, len(token_ids) - 1 - page_size + 1, page_size):
        parent = page_key(parent, tuple(token_ids[start : start + page_size]))
        keys.append(parent)
    return keys


@dataclass(frozen=True)
class PrefixMatch:
    num_device_pages: int = 0  # cached on the device: free
    num_pending_pages: int = 0  # routed here within the blind window, not stored yet: counted as device
    num_host_pages: int = 0  # in the host tier: a swap-in each

    @property
    def num_pages(self) -> int:
        return self.num_device_pages + self.num_pending_pages + self.num_host_pages


class CacheView:
    """Thread-safe: events arrive on the replica's subscriber thread, lookups on request threads."""

    def __init__(self, blind_window: float = 2.0, clock=time.monotonic):
        self.blind_window = blind_window
        self.clock = clock
        self.state = CacheState()
        self.sequence: int | None = None  # the number of the last event applied; None before a snapshot
        self.pending: dict[int, float] = {}  # key -> until when it counts as a hit
        self._lock = threading.Lock()

    def reset(self, sequence: int, events: list[KVEvent]) -> None:
        """A snapshot: the replica's whole cache as of event `sequence`. Pending pages stay: a snapshot
        shows what is stored, and a page routed a moment ago may still be on its way."""
        state = CacheState()
        for event in events:
            state.apply(event)
        with self._lock:
            self.state, self.sequence = state, sequence

    def apply(self, sequence: int, events: list[KVEvent]) -> bool:
        """A delta ending at event `sequence`; False (nothing applied) when it does not follow on."""
        with self._lock:
            if self.sequence is None or sequence - len(events) != self.sequence:
                return False
            for event in events:
                self.state.apply(event)
                if event.tier == DEVICE:
                    self.pending.pop(event.key, None)  # stored or removed: the events know better now
            self.sequence = sequence
            return True

    def note_routed(self, keys: list[int]) -> None:
        """Pages a request just sent here will store: hits for the next blind_window seconds."""
        now = self.clock()
        until = now + self.blind_window
        with self._lock:
            if len(self.pending) > MAX_PENDING_PAGES:
                self.pending = {key: until for key, until in self.pending.items() if until > now}
            for key in keys:
                if not self.state.has(key, DEVICE):
                    self.pending[key] = until

    def match(self, keys: list[int]) -> PrefixMatch:
        """The cached run of `keys` as the replica's scheduler would find it, on its best rank: device
        pages, then host-tier pages, up to the first page in neither."""
        with self._lock:
            now = self.clock()
            return max(
                (self._match_rank(keys, rank, now) for rank in self.state.ranks or [0]),
                key=lambda m: (m.num_pages, -m.num_host_pages),
            )

    def _match_rank(self, keys: list[int], rank: int, now: float) -> PrefixMatch:
        device, host = self.state.pages(rank, DEVICE), self.state.pages(rank, HOST)
        num_device = num_pending = num_host = 0
        for key in keys:
            if not num_host and key in device:
                num_device += 1
            elif not num_host and self.pending.get(key, 0.0) > now:
                num_pending += 1
            elif key in host:
                num_host += 1
            else:
                break
        return PrefixMatch(num_device, num_pending, num_host)

    def keys(self, tier: str, rank: int = 0) -> set[int]:
        with self._lock:
            return set(self.state.pages(rank, tier))
