"""The host allocator's settings for XLA on CPU: keep freed memory for the next step instead of faulting it in again.

Owns ``tune_malloc`` (called by every command line through ``jaxopd.cli.run_main``, and by the test session) and its
settings. XLA on CPU allocates each step's buffers with ``malloc``, from several threads. With glibc's defaults a
large block is a fresh ``mmap`` unmapped when freed, each thread's arena grows and shrinks its own heaps, and the heap
top above 128 KiB is trimmed: every step faults its working set in again, page by page, and the kernel zeroes each
page. On this project's 2-core machine the SFT step of the ``tiny`` preset (16 rows of 1,152 tokens) took 3.3 million
minor page faults and more kernel than user CPU time (``bench/host_malloc.py``). ``tune_malloc`` sets, through
``mallopt``:

- ``M_ARENA_MAX`` 1: every thread allocates from the main heap, where the last step's freed blocks are;
- ``M_MMAP_MAX`` 0: no block is a private ``mmap`` (they come from the heap and go back to it);
- ``M_TRIM_THRESHOLD`` -1 (glibc reads it as the largest size: never trim) and ``M_TOP_PAD`` 256 MiB.

After the first step the heap holds the step's peak and a step faults no page. The cost: the process keeps its peak
host memory until it exits (the same peak it reached before), and threads share one arena's lock (nothing on 2
cores). Only glibc is tuned (elsewhere nothing happens); ``JAXOPD_MALLOC_TUNING=0`` turns it off. The settings hold
for allocations made after the call, so commands call it before jax starts its CPU client.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os

__all__ = ["MALLOC_TUNING_ENV", "MALLOC_SETTINGS", "tune_malloc"]

MALLOC_TUNING_ENV = "JAXOPD_MALLOC_TUNING"
# mallopt parameters of glibc's <malloc.h>, with the values tune_malloc sets
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_MAX, M_ARENA_MAX = -1, -2, -4, -8
MALLOC_SETTINGS = ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, -1), (M_TOP_PAD, 256 * 2 ** 20))

_applied: bool | None = None


def tune_malloc() -> bool:
    """Apply ``MALLOC_SETTINGS`` once per process; True when glibc took them all, False when it is not glibc, when
    ``JAXOPD_MALLOC_TUNING=0`` or when ``mallopt`` refused one (it then leaves the rest as they were)."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if os.environ.get(MALLOC_TUNING_ENV, "1").strip() == "0":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        version = libc.gnu_get_libc_version          # glibc only: musl and macOS have no such symbol
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    version.restype = ctypes.c_char_p
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    _applied = all(mallopt(parameter, value) == 1 for parameter, value in MALLOC_SETTINGS)
    return _applied
