"""Shape buckets of the sampler's jitted steps: pure functions of the engine's limits.

Owns which padded shapes exist (decode rows × page window, prefill rows × chunk length, and the decode half
of a mixed step, ``mixed_decode_rows``), the rounding of a batch up to its bucket (``decode_shape``,
``prefill_shape``) and the prefill budget on the padded batch (``prefill_fits``). The scheduler builds prefill
batches with ``prefill_fits`` and the executor warms up ``decode_shapes()`` / ``prefill_shapes()``, which are
the images of those same functions, so every shape a step can use is compiled by ``warmup``. Fixed at engine
construction. Plain Python.
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


def _smallest_in_each(buckets: Sequence[int]) -> list[int]:
    """The smallest n that rounds up to each bucket: 1, then one more than the previous bucket."""
    return [1] + [b + 1 for b in buckets[:-1]]


@dataclasses.dataclass(frozen=True)
class Buckets:
    """Padded shapes of the jitted functions. decode: rows × page-window; prefill: rows × chunk length.

    ``max_prefill_tokens`` bounds a prefill batch *after padding* (rows bucket × length bucket), so the
    activation memory of a prefill step never exceeds it; a single row always fits (a chunk is never split
    below ``prefill_chunk`` for padding).
    """

    decode_rows: tuple[int, ...]
    decode_pages: tuple[int, ...]
    prefill_rows: tuple[int, ...]
    prefill_lengths: tuple[int, ...]
    max_pages_per_seq: int
    max_prefill_tokens: int

    @classmethod
    def make(cls, *, max_slots: int, max_seq_len: int, page_size: int, prefill_chunk: int,
             max_prefill_tokens: int, max_prefill_rows: int, length_step: int | None = None) -> "Buckets":
        """``length_step`` None: prefill lengths are powers of two (a 600-token prompt runs as 1,024) and rows
        1, 4, 16, 64; a step: lengths are powers of two below it, then its multiples up to ``prefill_chunk``, and rows
        every power of two (more shapes to compile, less padding to compute: see ``EngineConfig.prefill_length_step``).
        """
        max_pages = math.ceil(max_seq_len / page_size)
        lengths = _powers_of_two(16, prefill_chunk) if prefill_chunk >= 16 else (prefill_chunk,)
        if length_step is not None and length_step < prefill_chunk:
            lengths = tuple(sorted({n for n in lengths if n < length_step}
                                   | set(range(length_step, prefill_chunk, length_step)) | {prefill_chunk}))
        max_rows = max(1, min(max_prefill_rows, max_slots, max_prefill_tokens // lengths[0]))
        row_choices = (1, 4, 16, 64) if length_step is None else _powers_of_two(1, max_rows)
        rows = tuple(sorted({r for r in row_choices if r < max_rows} | {max_rows}))
        return cls(decode_rows=_powers_of_two(min(8, max_slots), max_slots),
                   decode_pages=_powers_of_two(min(4, max_pages), max_pages),
                   prefill_rows=rows, prefill_lengths=lengths, max_pages_per_seq=max_pages,
                   max_prefill_tokens=max_prefill_tokens)

    # ---------------------------------------------------------------------------------------- decode
    def decode_shape(self, rows: int, pages: int) -> tuple[int, int]:
        """The padded (rows, page window) of a decode step over ``rows`` sequences holding at most ``pages``."""
        return bucket(rows, self.decode_rows), bucket(pages, self.decode_pages)

    def decode_shapes(self) -> list[tuple[int, int]]:
        """Every shape ``decode_shape`` can return."""
        return sorted({self.decode_shape(r, p) for r in _smallest_in_each(self.decode_rows)
                       for p in _smallest_in_each(self.decode_pages)})

    # ---------------------------------------------------------------------------------------- mixed
    @property
    def mixed_decode_rows(self) -> int:
        """Decode rows of a mixed (prefill + decode) step: always the largest decode bucket, with the whole page
        window, so the mixed step adds one compiled shape per prefill shape (not per prefill × decode shape).
        Padding rows are inactive: in-place kernels skip them; their token-wise layers cost ``max_slots`` tokens."""
        return self.decode_rows[-1]

    # ---------------------------------------------------------------------------------------- prefill
    def prefill_shape(self, rows: int, longest: int) -> tuple[int, int]:
        """The padded (rows, length) of a prefill step over ``rows`` chunks, the longest ``longest`` tokens."""
        return bucket(rows, self.prefill_rows), bucket(longest, self.prefill_lengths)

    def prefill_fits(self, rows: int, longest: int) -> bool:
        """Whether a prefill batch of ``rows`` chunks, the longest ``longest`` tokens, fits once padded."""
        if rows > self.prefill_rows[-1] or longest > self.prefill_lengths[-1]:
            return False
        padded_rows, padded_length = self.prefill_shape(rows, longest)
        return rows == 1 or padded_rows * padded_length <= self.max_prefill_tokens

    def prefill_shapes(self) -> list[tuple[int, int]]:
        """Every shape ``prefill_shape`` returns for a batch that ``prefill_fits``: the shapes warm-up compiles.

        ``prefill_fits`` only gets harder as rows or length grow, so a padded shape is reachable iff the
        smallest batch that pads to it fits; checking those covers every batch the scheduler can build.
        """
        return sorted({self.prefill_shape(r, n) for r in _smallest_in_each(self.prefill_rows)
                       for n in _smallest_in_each(self.prefill_lengths) if self.prefill_fits(r, n)})


__all__ = ["Buckets", "bucket"]
