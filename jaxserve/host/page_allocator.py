"""The host side of the paged KV cache: which pages are free, who holds the others, which are cached.

Plain Python, no JAX: the device pages (models/kv_pages.py) are only ever addressed through the
page ids handed out here. Page 0 is reserved: padding tokens in a bucket write their KV there.

Prefix caching: a full page is content-addressed by a key derived from its parent page's key and
its own token ids, so equal prefixes map to equal pages whatever request computed them. A page whose
last holder lets go keeps its key and stays cached until its space is needed; such pages are
evicted least-recently-released first (a sequence releases its leaf pages before their parents),
except that pages of a live session are passed over while others remain.

Host tier: with one, an evicted page is demoted (its KV copied to host memory, still findable by
key) instead of dropped, and a later hit promotes it back into a device page. The allocator only
decides; the engine moves the bytes (pending_demotions before pending_promotions, both before the
step that may overwrite or read those pages).

Events: every change to which keys a tier holds is recorded (kv_events.py) for whoever mirrors this
cache from another process, a prefix-aware router. Keys are a stable hash (blake2b), not Python's
hash(), so that such a mirror computes the same chain from token ids whatever its interpreter.
"""

from __future__ import annotations

import hashlib
import math
import struct
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from jaxserve.host.host_tier import HostTier
from jaxserve.host.kv_events import DEVICE, NO_EVENTS, RankEvents

RESERVED_PAGE = 0
ROOT_KEY = 0  # the parent key of a sequence's first page
EVICTED_KEYS_REMEMBERED = 1 << 16  # for telling "evicted" misses from "never seen" ones


# Rough (host link bytes/s, compute FLOP/s) per platform, for choosing between copying a page back
# from host memory and recomputing its tokens.
PLATFORM_RATES = {"cpu": (10e9, 1e11), "gpu": (25e9, 3e14), "tpu": (25e9, 3e14)}


def swap_in_is_cheaper(page_bytes: int, page_size: int, num_params: int, platform: str) -> bool:
    """Whether bringing a page's KV back from host memory beats recomputing its tokens' prefill."""
    bandwidth, flops = PLATFORM_RATES.get(platform, PLATFORM_RATES["gpu"])
    return page_bytes / bandwidth < 2 * num_params * page_size / flops


def num_pages_for(num_tokens: int, page_size: int) -> int:
    return math.ceil(num_tokens / page_size)


def page_key(parent_key: int, token_ids: tuple[int, ...]) -> int:
    """A signed 64-bit key (a protobuf int64) for a page: the same in every process and on every platform."""
    data = struct.pack(f"<q{len(token_ids)}q", parent_key, *token_ids)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


@dataclass
class CachedPrefix:
    pages: list[int] = field(default_factory=list)  # device pages, in order
    host_keys: list[tuple[int, tuple]] = field(default_factory=list)  # then (key, contents) in the host tier
    keys: list[int] = field(default_factory=list)  # keys of all of them
    miss_reason: str = "never_seen"

    @property
    def num_pages(self) -> int:
        return len(self.pages) + len(self.host_keys)


@dataclass
class PrefixCacheStats:
    num_queries: int = 0  # sequences looked up
    num_query_tokens: int = 0  # prompt tokens looked up
    num_hit_tokens: int = 0
    num_evictions: int = 0
    miss_tokens_never_seen: int = 0
    miss_tokens_evicted: int = 0
    miss_tokens_partial_page: int = 0
    host_tier_hit_tokens: int = 0
    num_swapped_out_pages: int = 0
    num_swapped_in_pages: int = 0

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0


class PageAllocator:
    """Reference-counted pages; with prefix caching, freed full pages stay findable by their key."""

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        enable_prefix_caching: bool = False,
        host_tier_pages: int = 0,
        session_ttl: float = 0.0,
        clock=time.monotonic,
    ):
        if num_pages < 2:
            raise ValueError(f"the KV cache needs at least 2 pages (one is reserved), got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_pages
        self.ref_counts[RESERVED_PAGE] = 1
        self.free_pages = deque(range(1, num_pages))  # free and holding nothing worth keeping
        self.cached_free_pages: OrderedDict[int, None] = OrderedDict()  # free but cached, oldest first
        self.page_keys: list[int | None] = [None] * num_pages
        self.page_contents: list[tuple[int, tuple[int, ...]] | None] = [None] * num_pages  # (parent, tokens)
        self.pages_by_key: dict[int, int] = {}
        self.evicted_keys: OrderedDict[int, None] = OrderedDict()
        self.stats = PrefixCacheStats()
        self.host_tier = HostTier(host_tier_pages) if enable_prefix_caching and host_tier_pages > 0 else None
        self.pending_demotions: list[tuple[int, int, tuple[int, tuple[int, ...]]]] = []  # (page, key, contents)
        self.pending_promotions: list[tuple[int, object]] = []  # (page, host data)
        self.session_ttl = session_ttl
        self.clock = clock
        self.kept_until: dict[int, float] = {}  # page -> when its session's preference ends
        self.events: RankEvents = NO_EVENTS

    def attach_events(self, events: RankEvents) -> None:
        """Record cache changes from now on; the cache must still be empty, so no change goes unrecorded."""
        assert not self.pages_by_key and not (self.host_tier and len(self.host_tier)), "attach before caching"
        self.events = events
        if self.host_tier is not None:
            self.host_tier.events = events

    @property
    def num_usable_pages(self) -> int:
        return self.num_pages - 1

    @property
    def max_pages_per_sequence(self) -> int:
        return self.num_usable_pages

    @property
    def num_free_pages(self) -> int:
        """Pages that an allocation can take: free ones and cached ones nobody holds."""
        return len(self.free_pages) + len(self.cached_free_pages)

    @property
    def num_cached_pages(self) -> int:
        return len(self.pages_by_key)

    def can_allocate(self, num_pages: int) -> bool:
        return num_pages <= self.num_free_pages

    def allocate(self, num_pages: int) -> list[int]:
        if not self.can_allocate(num_pages):
            raise RuntimeError(f"asked for {num_pages} pages with {self.num_free_pages} free")
        pages = []
        for _ in range(num_pages):
            if self.free_pages:
                page = self.free_pages.popleft()
            else:
                page = self._eviction_victim()
                del self.cached_free_pages[page]
                if self.host_tier is not None:
                    key, contents = self.page_keys[page], self.page_contents[page]
                    assert key is not None and contents is not None  # an evicted page was a cached one
                    self.pending_demotions.append((page, key, contents))
                    self.stats.num_swapped_out_pages += 1
                self._forget(page)
                self.stats.num_evictions += 1
            self.ref_counts[page] = 1
            pages.append(page)
        return pages

    def _eviction_victim(self) -> int:
        """The least recently released cached page, passing over those a live session keeps."""
        if self.kept_until:
            now = self.clock()
            for page in self.cached_free_pages:
                if self.kept_until.get(page, 0.0) <= now:
                    return page
        return next(iter(self.cached_free_pages))

    def keep_for_session(self, pages: list[int]) -> None:
        """Prefer keeping these pages (a conversation likely to continue) for session_ttl seconds."""
        if self.session_ttl > 0:
            until = self.clock() + self.session_ttl
            for page in pages:
                self.kept_until[page] = until

    def _forget(self, page: int) -> None:
        self.kept_until.pop(page, None)
        key = self.page_keys[page]
        if key is None:
            return
        del self.pages_by_key[key]
        self.events.removed(key, DEVICE)
        self.page_keys[page] = None
        self.page_contents[page] = None
        self.evicted_keys[key] = None
        if len(self.evicted_keys) > EVICTED_KEYS_REMEMBERED:
            self.evicted_keys.popitem(last=False)

    def share(self, pages: list[int]) -> None:
        for page in pages:
            if self.ref_counts[page] == 0:
                assert page in self.cached_free_pages, f"sharing free page {page}"
                del self.cached_free_pages[page]
            self.ref_counts[page] += 1

    def release(self, pages: list[int]) -> None:
        """Drop one reference from each page, leaves first so that they are evicted before parents."""
        for page in reversed(pages):
            assert page != RESERVED_PAGE and self.ref_counts[page] > 0, f"releasing free page {page}"
            self.ref_counts[page] -= 1
            if self.ref_counts[page] == 0:
                if self.page_keys[page] is None:
                    self.free_pages.append(page)
                else:
                    self.cached_free_pages[page] = None

    # -- prefix caching ---------------------------------------------------------------------------

    def cache_full_page(self, page: int, parent_key: int, token_ids: tuple[int, ...]) -> int:
        """Make a just-filled page findable; returns its key (the parent of the next page's key)."""
        key = page_key(parent_key, token_ids)
        if self.enable_prefix_caching and key not in self.pages_by_key and self.page_keys[page] is None:
            self.pages_by_key[key] = page
            self.page_keys[page] = key
            self.page_contents[page] = (parent_key, token_ids)
            self.evicted_keys.pop(key, None)
            self.events.stored(key, parent_key, len(token_ids), DEVICE)
        return key

    def clear_prefix_cache(self) -> bool:
        """Forget every cached page, on the device and in the host tier (as vLLM's reset_prefix_cache).
        Refused (False) while a sequence holds a cached page: its pages cannot be dropped under it."""
        if any(self.ref_counts[page] for page in self.pages_by_key.values()):
            return False
        for page in list(self.cached_free_pages):
            self.page_keys[page] = self.page_contents[page] = None
            self.free_pages.append(page)
        self.cached_free_pages.clear()
        self.pages_by_key.clear()
        self.kept_until.clear()
        self.pending_demotions.clear()  # their pages have new holders already; only the old bytes would move
        if self.host_tier is not None:
            self.host_tier.clear()
        self.events.cleared()
        return True

    def find_cached_prefix(self, token_ids: list[int], max_tokens: int, root_key: int = ROOT_KEY) -> CachedPrefix:
        """The longest run of cached full pages that starts token_ids, covering at most max_tokens:
        device pages first, then pages the host tier holds. root_key: the first page's parent key (a LoRA
        adapter's identity: its pages chain from there, apart from the base model's).

        Takes no references and counts nothing: `claim` the result once the sequence is admitted.
        """
        found = CachedPrefix()
        if not self.enable_prefix_caching:
            return found
        parent, size = root_key, self.page_size
        for start in range(0, max_tokens - size + 1, size):
            contents = (parent, tuple(token_ids[start : start + size]))
            key = page_key(*contents)
            page = self.pages_by_key.get(key)
            if page is not None and self.page_contents[page] == contents and not found.host_keys:
                found.pages.append(page)
            elif self.host_tier is not None and self.host_tier.has(key, contents):
                found.host_keys.append((key, contents))
            else:
                found.miss_reason = "evicted" if key in self.evicted_keys else "never_seen"
                return found
            found.keys.append(key)
            parent = key
        found.miss_reason = "partial_page"
        return found

    def claim(self, found: CachedPrefix) -> list[int]:
        """Hold a found prefix: share its device pages, promote its host pages into new device pages."""
        self.share(found.pages)
        promoted = self.allocate(len(found.host_keys))
        for page, (key, contents) in zip(promoted, found.host_keys):
            assert self.host_tier is not None  # only the host tier finds host keys
            self.cache_full_page(page, *contents)
            self.pending_promotions.append((page, self.host_tier.take(key)))
        self.stats.num_swapped_in_pages += len(promoted)
        self.stats.host_tier_hit_tokens += len(promoted) * self.page_size
        return found.pages + promoted

    def num_pages_to_claim(self, found: CachedPrefix) -> int:
        """Free pages that claiming would use: unheld cached ones it shares, plus one per promotion."""
        return sum(1 for page in found.pages if self.ref_counts[page] == 0) + len(found.host_keys)

    def record_query(self, num_tokens: int, num_hit_tokens: int, miss_reason: str) -> None:
        self.stats.num_queries += 1
        self.stats.num_query_tokens += num_tokens
        self.stats.num_hit_tokens += num_hit_tokens
        field = f"miss_tokens_{miss_reason}"
        setattr(self.stats, field, getattr(self.stats, field) + num_tokens - num_hit_tokens)
