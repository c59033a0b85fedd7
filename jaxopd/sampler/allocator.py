"""Host-side page allocator of the paged KV cache: a free list with reference counts and a prefix cache.

Page 0 is the null page (padding tokens write there; it is never handed out). Pages are reference counted, so
two requests can hold the pages of a common prefix (``share``).

Prefix cache (as vLLM's): a page whose ``page_size`` tokens are all computed can be ``register``-ed under the
chain hash of its tokens (``page_hashes``: page i's hash covers the token ids of pages 0..i, so equal hashes
mean equal prefixes). ``lookup`` finds it again. Retention: a registered page whose last holder releases it is
not wiped but parked in an LRU list of *reusable* pages; it still counts as free (``num_free``), keeps its
hash, and is revived by ``share`` while nobody has reused it. ``allocate`` takes never-registered free pages
first, then evicts the least recently released cached page (dropping its hash). ``clear_prefix_cache`` forgets
every hash (new weights or a re-created KV cache make the cached keys/values stale). Plain Python, no JAX.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from typing import Iterable, Sequence

NULL_PAGE = 0


class OutOfPages(RuntimeError):
    """Raised by ``allocate`` when the pool cannot satisfy the request (nothing is allocated then)."""


def page_hashes(tokens: Sequence[int], page_size: int, start: int = 0, parent: int | None = None) -> list[int]:
    """Chain hashes of the full pages of ``tokens`` from page ``start`` on (``parent``: the hash of page
    ``start - 1``; None for page 0). Page i's hash is ``hash((hash of page i-1, its token ids))``."""
    out, h = [], parent
    for i in range(start, len(tokens) // page_size):
        h = hash((h, tuple(tokens[i * page_size:(i + 1) * page_size])))
        out.append(h)
    return out


class PageAllocator:
    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is the null page), got {num_pages}")
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(1, num_pages))
        self._refcount = [0] * num_pages
        self._page_of_hash: dict[int, int] = {}
        self._hash_of_page: dict[int, int] = {}
        self._reusable: OrderedDict[int, None] = OrderedDict()   # cached pages nobody holds, LRU first

    @property
    def num_free(self) -> int:
        """Pages ``allocate`` can hand out: fresh ones plus cached pages nobody holds."""
        return len(self._free) + len(self._reusable)

    @property
    def num_used(self) -> int:
        return self.num_pages - 1 - self.num_free

    @property
    def num_cached(self) -> int:
        """Pages registered in the prefix cache (held or reusable)."""
        return len(self._hash_of_page)

    def refcount(self, page: int) -> int:
        return self._refcount[page]

    def allocate(self, n: int) -> list[int]:
        """``n`` fresh pages with reference count 1; all or nothing. Evicts LRU cached pages when needed."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > self.num_free:
            raise OutOfPages(f"need {n} pages, {self.num_free} free")
        pages = []
        for _ in range(n):
            if self._free:
                page = self._free.popleft()
            else:
                page, _ = self._reusable.popitem(last=False)
                self._forget(page)
            self._refcount[page] = 1
            pages.append(page)
        return pages

    def share(self, pages: Iterable[int]) -> list[int]:
        """Take another reference to pages that are allocated or cached (a shared prefix); returns them."""
        pages = list(pages)
        for p in pages:
            if p == NULL_PAGE or (self._refcount[p] <= 0 and p not in self._reusable):
                raise ValueError(f"page {p} is not allocated and cannot be shared")
        for p in pages:
            if self._refcount[p] == 0:
                del self._reusable[p]
            self._refcount[p] += 1
        return pages

    def release(self, pages: Iterable[int]) -> None:
        """Drop one reference to each page; pages nobody holds go back to the free list (cached ones to the
        reusable LRU list, keeping their hash)."""
        for p in pages:
            if p == NULL_PAGE or self._refcount[p] <= 0:
                raise ValueError(f"page {p} released more often than allocated")
            self._refcount[p] -= 1
            if self._refcount[p] == 0:
                if p in self._hash_of_page:
                    self._reusable[p] = None
                else:
                    self._free.append(p)

    # ------------------------------------------------------------------ prefix cache
    def register(self, page: int, page_hash: int) -> None:
        """Record that held ``page`` holds the computed keys/values of the prefix hashed ``page_hash``. A hash
        already cached keeps its page (the other copy stays private); a page is registered once."""
        if page == NULL_PAGE or self._refcount[page] <= 0:
            raise ValueError(f"page {page} is not allocated and cannot be registered")
        if page_hash in self._page_of_hash or page in self._hash_of_page:
            return
        self._page_of_hash[page_hash] = page
        self._hash_of_page[page] = page_hash

    def lookup(self, page_hash: int) -> int | None:
        """The cached page of ``page_hash``, or None."""
        return self._page_of_hash.get(page_hash)

    def cached_prefix(self, hashes: Iterable[int]) -> list[int]:
        """The pages of the longest cached prefix of the chain ``hashes``."""
        pages = []
        for h in hashes:
            page = self._page_of_hash.get(h)
            if page is None:
                break
            pages.append(page)
        return pages

    def clear_prefix_cache(self) -> None:
        """Forget every hash; reusable pages become plain free pages."""
        self._page_of_hash.clear()
        self._hash_of_page.clear()
        self._free.extend(self._reusable)
        self._reusable.clear()

    def _forget(self, page: int) -> None:
        h = self._hash_of_page.pop(page, None)
        if h is not None:
            del self._page_of_hash[h]
