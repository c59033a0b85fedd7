"""Host-side page allocator of the paged KV cache: a free list with reference counts.

Page 0 is the null page (padding tokens write there; it is never handed out). A page returns to the
free list when its last holder releases it, so two requests can share the pages of a common prefix
(``share``). Plain Python, no JAX.
"""
from __future__ import annotations

from collections import deque
from typing import Iterable

NULL_PAGE = 0


class OutOfPages(RuntimeError):
    """Raised by ``allocate`` when the pool cannot satisfy the request (nothing is allocated then)."""


class PageAllocator:
    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is the null page), got {num_pages}")
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(1, num_pages))
        self._refcount = [0] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - 1 - len(self._free)

    def refcount(self, page: int) -> int:
        return self._refcount[page]

    def allocate(self, n: int) -> list[int]:
        """``n`` fresh pages with reference count 1; all or nothing."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            raise OutOfPages(f"need {n} pages, {len(self._free)} free")
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self._refcount[p] = 1
        return pages

    def share(self, pages: Iterable[int]) -> list[int]:
        """Take another reference to already-allocated pages (a shared prefix); returns them."""
        pages = list(pages)
        for p in pages:
            if p == NULL_PAGE or self._refcount[p] <= 0:
                raise ValueError(f"page {p} is not allocated and cannot be shared")
        for p in pages:
            self._refcount[p] += 1
        return pages

    def release(self, pages: Iterable[int]) -> None:
        """Drop one reference to each page; pages nobody holds go back to the free list."""
        for p in pages:
            if p == NULL_PAGE or self._refcount[p] <= 0:
                raise ValueError(f"page {p} released more often than allocated")
            self._refcount[p] -= 1
            if self._refcount[p] == 0:
                self._free.append(p)
