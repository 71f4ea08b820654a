"""The page allocator's event stream: what a router needs to know a replica's prefix cache exactly.

Every change to the set of cached pages is one event, numbered in order: a page stored under its key
(on the device or in the host tier), a page removed from a tier, a rank's cache cleared. A demotion
is a device removal followed, once the engine has copied the bytes, by a host store; a promotion is a
host removal and a device store. Keys are the allocator's own (`page_key`), so anyone holding the
token ids computes the same chain.

The allocator records events on the engine's thread. The log applies each one to a mirror of the
cache (`CacheState`) as it records it, so a subscriber on any other thread takes a snapshot that is
consistent with a sequence number without touching the allocator, then reads the events after that
number; one that falls further behind than the log retains gets a fresh snapshot instead. The engine
loop publishes the replica's load after each step, which also wakes subscribers.

Plain Python, no JAX: the router applies the same events to the same `CacheState`.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from itertools import islice

DEVICE, HOST = "device", "host"
STORED, REMOVED, CLEARED = "stored", "removed", "cleared"
MAX_RETAINED_EVENTS = 1 << 16  # a subscriber further behind than this gets a snapshot instead


@dataclass(frozen=True, slots=True)
class KVEvent:
    kind: str  # STORED, REMOVED or CLEARED
    key: int = 0
    parent_key: int = 0  # STORED only
    num_tokens: int = 0  # STORED only: the tokens the page holds
    tier: str = DEVICE  # STORED and REMOVED
    rank: int = 0  # the data-parallel rank whose allocator it happened in


@dataclass(frozen=True, slots=True)
class CachedPage:
    parent_key: int
    num_tokens: int


@dataclass
class CacheState:
    """The keys each (rank, tier) holds. Applying a replica's events in order reproduces its cache."""

    tiers: dict[tuple[int, str], dict[int, CachedPage]] = field(default_factory=dict)

    def apply(self, event: KVEvent) -> None:
        if event.kind == STORED:
            self.tiers.setdefault((event.rank, event.tier), {})[event.key] = CachedPage(
                event.parent_key, event.num_tokens
            )
        elif event.kind == REMOVED:
            self.tiers.get((event.rank, event.tier), {}).pop(event.key, None)
        elif event.kind == CLEARED:
            for rank_tier in [rank_tier for rank_tier in self.tiers if rank_tier[0] == event.rank]:
                del self.tiers[rank_tier]
        else:
            raise ValueError(f"unknown KV event kind {event.kind!r}")

    def pages(self, rank: int, tier: str) -> dict[int, CachedPage]:
        return self.tiers.get((rank, tier), {})

    def has(self, key: int, tier: str, rank: int = 0) -> bool:
        return key in self.tiers.get((rank, tier), ())

    @property
    def ranks(self) -> list[int]:
        return sorted({rank for rank, _ in self.tiers})

    def as_events(self) -> list[KVEvent]:
        """STORED events that rebuild this state from an empty one (a snapshot)."""
        return [
            KVEvent(STORED, key, page.parent_key, page.num_tokens, tier, rank)
            for (rank, tier), pages in self.tiers.items()
            for key, page in pages.items()
        ]


class RankEvents:
    """Records one allocator's events into the shared log under its data-parallel rank."""

    def __init__(self, log: KVEventLog | None, rank: int = 0):
        self.log, self.rank = log, rank

    def stored(self, key: int, parent_key: int, num_tokens: int, tier: str) -> None:
        if self.log is not None:
            self.log.record(KVEvent(STORED, key, parent_key, num_tokens, tier, self.rank))

    def removed(self, key: int, tier: str) -> None:
        if self.log is not None:
            self.log.record(KVEvent(REMOVED, key, tier=tier, rank=self.rank))

    def cleared(self) -> None:
        if self.log is not None:
            self.log.record(KVEvent(CLEARED, rank=self.rank))


NO_EVENTS = RankEvents(None)  # an allocator nobody listens to records nothing


class KVEventLog:
    """Numbered events (the first is 1), a mirror of the cache they describe, and the latest load."""

    def __init__(self, max_retained: int = MAX_RETAINED_EVENTS):
        self._condition = threading.Condition()
        self.sequence = 0  # the number of the latest event
        self.state = CacheState()
        self._retained: deque[KVEvent] = deque(maxlen=max_retained)  # the latest events, ending at sequence
        self.load = None  # whatever the engine loop published last (a stats dict)
        self._version = 0  # bumped by every publish: subscribers wait on it

    def for_rank(self, rank: int) -> RankEvents:
        return RankEvents(self, rank)

    def record(self, event: KVEvent) -> None:
        with self._condition:
            self.state.apply(event)
            self.sequence += 1
            self._retained.append(event)

    def publish(self, load) -> None:
        """The replica's load after a step; wakes subscribers to send what changed."""
        with self._condition:
            self.load = load
            self._version += 1
            self._condition.notify_all()

    def snapshot(self) -> tuple[int, list[KVEvent], object]:
        """(sequence, STORED events that rebuild the cache as of that sequence, load)."""
        with self._condition:
            return self.sequence, self.state.as_events(), self.load

    def events_after(self, sequence: int) -> tuple[int, list[KVEvent], object] | None:
        """(latest sequence, the events numbered after `sequence`, load), or None when some of those
        events are no longer retained (the caller then takes a snapshot)."""
        with self._condition:
            missing = self.sequence - sequence
            if missing < 0 or missing > len(self._retained):
                return None
            events = list(islice(reversed(self._retained), missing))[::-1]  # O(missing), not O(retained)
            return self.sequence, events, self.load

    def wait(self, version: int, timeout: float) -> int:
        """Block until a publish after `version` or `timeout` seconds; returns the current version."""
        with self._condition:
            self._condition.wait_for(lambda: self._version != version, timeout)
            return self._version
