"""The host side of the paged KV cache: which pages are free, who holds the others, which are cached.

Plain Python, no JAX: the device pages (models/kv_pages.py) are only ever addressed through the
page ids handed out here. Page 0 is reserved: padding tokens in a bucket write their KV there.

Prefix caching: a full page is content-addressed by a key derived from its parent page's key and
its own token ids, so equal prefixes map to equal pages whatever request computed them. A page whose
last holder lets go keeps its key and stays cached until its space is needed; such pages are
evicted least-recently-released first (a sequence releases its leaf pages before their parents).
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import dataclass

RESERVED_PAGE = 0
ROOT_KEY = 0  # the parent key of a sequence's first page
EVICTED_KEYS_REMEMBERED = 1 << 16  # for telling "evicted" misses from "never seen" ones


def num_pages_for(num_tokens: int, page_size: int) -> int:
    return math.ceil(num_tokens / page_size)


def page_key(parent_key: int, token_ids: tuple[int, ...]) -> int:
    return hash((parent_key, token_ids))


@dataclass
class PrefixCacheStats:
    num_queries: int = 0  # sequences looked up
    num_query_tokens: int = 0  # prompt tokens looked up
    num_hit_tokens: int = 0
    num_evictions: int = 0
    miss_tokens_never_seen: int = 0
    miss_tokens_evicted: int = 0
    miss_tokens_partial_page: int = 0

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0


class PageAllocator:
    """Reference-counted pages; with prefix caching, freed full pages stay findable by their key."""

    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = False):
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

    @property
    def num_usable_pages(self) -> int:
        return self.num_pages - 1

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
                page, _ = self.cached_free_pages.popitem(last=False)
                self._forget(page)
                self.stats.num_evictions += 1
            self.ref_counts[page] = 1
            pages.append(page)
        return pages

    def _forget(self, page: int) -> None:
        key = self.page_keys[page]
        if key is None:
            return
        del self.pages_by_key[key]
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
        return key

    def find_cached_prefix(self, token_ids: list[int], max_tokens: int) -> tuple[list[int], list[int], str]:
        """The longest run of cached full pages that starts token_ids, covering at most max_tokens.

        Returns (pages, their keys, why the run ended) without taking references or counting the
        query: `share` the pages to hold them and `record_query` once the sequence is admitted.
        """
        pages, keys, parent, size = [], [], ROOT_KEY, self.page_size
        if not self.enable_prefix_caching:
            return pages, keys, "never_seen"
        for start in range(0, max_tokens - size + 1, size):
            tokens = tuple(token_ids[start:start + size])
            key = page_key(parent, tokens)
            page = self.pages_by_key.get(key)
            if page is None or self.page_contents[page] != (parent, tokens):
                return pages, keys, "evicted" if key in self.evicted_keys else "never_seen"
            pages.append(page)
            keys.append(key)
            parent = key
        return pages, keys, "partial_page"

    def record_query(self, num_tokens: int, num_hit_tokens: int, miss_reason: str) -> None:
        self.stats.num_queries += 1
        self.stats.num_query_tokens += num_tokens
        self.stats.num_hit_tokens += num_hit_tokens
        field = f"miss_tokens_{miss_reason}"
        setattr(self.stats, field, getattr(self.stats, field) + num_tokens - num_hit_tokens)

    def num_reclaimed_by_sharing(self, pages: list[int]) -> int:
        """How many of these pages sharing would take out of the free pool (cached, unheld ones)."""
        return sum(1 for page in pages if self.ref_counts[page] == 0)
