"""The host side of the paged KV cache: which pages are free and who holds the others.

Plain Python, no JAX: the device pages (models/kv_pages.py) are only ever addressed through the
page ids handed out here. Page 0 is reserved: padding tokens in a bucket write their KV there.
"""

from __future__ import annotations

import math
from collections import deque

RESERVED_PAGE = 0


def num_pages_for(num_tokens: int, page_size: int) -> int:
    return math.ceil(num_tokens / page_size)


class PageAllocator:
    """Reference-counted pages. A page returns to the free list when its last holder releases it."""

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError(f"the KV cache needs at least 2 pages (one is reserved), got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.ref_counts = [0] * num_pages
        self.ref_counts[RESERVED_PAGE] = 1
        self.free_pages = deque(range(1, num_pages))

    @property
    def num_usable_pages(self) -> int:
        return self.num_pages - 1

    @property
    def num_free_pages(self) -> int:
        return len(self.free_pages)

    def can_allocate(self, num_pages: int) -> bool:
        return num_pages <= len(self.free_pages)

    def allocate(self, num_pages: int) -> list[int]:
        if not self.can_allocate(num_pages):
            raise RuntimeError(f"asked for {num_pages} pages with {len(self.free_pages)} free")
        pages = [self.free_pages.popleft() for _ in range(num_pages)]
        for page in pages:
            self.ref_counts[page] = 1
        return pages

    def share(self, pages: list[int]) -> None:
        for page in pages:
            assert self.ref_counts[page] > 0, f"sharing free page {page}"
            self.ref_counts[page] += 1

    def release(self, pages: list[int]) -> None:
        for page in pages:
            assert page != RESERVED_PAGE and self.ref_counts[page] > 0, f"releasing free page {page}"
            self.ref_counts[page] -= 1
            if self.ref_counts[page] == 0:
                self.free_pages.append(page)
