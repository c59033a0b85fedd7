"""Shape buckets of the sampler's jitted steps: pure functions of the engine's limits.

Owns which padded shapes exist (decode rows × page window, prefill rows × chunk length) and the rounding of
a batch up to its bucket. Fixed at engine construction, so after ``warmup`` nothing compiles. Plain Python.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence


def _powers_of_two(lo: int, hi: int) -> tuple[int, ...]:
    """``lo, 2lo, 4lo, ...`` up to and including ``hi`` (``hi`` itself is always the last bucket)."""
    out, b = [], max(1, lo)
    while b < hi:
        out.append(b)
        b *= 2
    out.append(hi)
    return tuple(sorted(set(out)))


def bucket(n: int, buckets: Sequence[int]) -> int:
    """The smallest bucket >= n."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


@dataclasses.dataclass(frozen=True)
class Buckets:
    """Padded shapes of the jitted functions. decode: rows × page-window; prefill: rows × chunk length."""

    decode_rows: tuple[int, ...]
    decode_pages: tuple[int, ...]
    prefill_rows: tuple[int, ...]
    prefill_lengths: tuple[int, ...]
    max_pages_per_seq: int

    @classmethod
    def make(cls, *, max_slots: int, max_seq_len: int, page_size: int, prefill_chunk: int,
             max_prefill_tokens: int, max_prefill_rows: int) -> "Buckets":
        max_pages = math.ceil(max_seq_len / page_size)
        lengths = _powers_of_two(16, prefill_chunk) if prefill_chunk >= 16 else (prefill_chunk,)
        max_rows = max(1, min(max_prefill_rows, max_slots, max_prefill_tokens // lengths[0]))
        rows = tuple(sorted({r for r in (1, 4, 16, 64) if r < max_rows} | {max_rows}))
        return cls(decode_rows=_powers_of_two(min(8, max_slots), max_slots),
                   decode_pages=_powers_of_two(min(4, max_pages), max_pages),
                   prefill_rows=rows, prefill_lengths=lengths, max_pages_per_seq=max_pages)

    def prefill_shapes(self, max_prefill_tokens: int) -> list[tuple[int, int]]:
        """(rows, length) pairs that fit the prefill token budget (one row always fits)."""
        return [(r, n) for n in self.prefill_lengths for r in self.prefill_rows
                if r == 1 or r * n <= max_prefill_tokens]


__all__ = ["Buckets", "bucket"]
