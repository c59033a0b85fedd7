"""The host allocator's settings for XLA on CPU: keep freed memory for the next step instead of faulting it in again.

Owns ``tune_malloc`` and its settings. It is opt-in: a library must not retune the allocator of a process that imports
it, so only the command lines apply it (``jaxopd.cli.run_main``), and only when ``JAXOPD_MALLOC_TUNING=1`` is set; the
test session leaves glibc's defaults (the tests of this module turn it on in their own processes). XLA on CPU
allocates each step's buffers with ``malloc``, from several threads. With glibc's defaults a large block is a fresh
``mmap`` unmapped when freed, each thread's arena grows and shrinks its own heaps, and the heap top above 128 KiB is
trimmed: every step faults its working set in again, page by page, and the kernel zeroes each page. On this project's
2-core machine the SFT step of the ``tiny`` preset (16 rows of 1,152 tokens) took 3.3 million minor page faults and
more kernel than user CPU time (``bench/host_malloc.py``). ``tune_malloc`` sets, through ``mallopt``:

- ``M_ARENA_MAX`` 1: every thread allocates from the main heap, where the last step's freed blocks are;
- ``M_MMAP_MAX`` 0: no block is a private ``mmap`` (they come from the heap and go back to it);
- ``M_TRIM_THRESHOLD`` -1 (glibc reads it as the largest size: never trim) and ``M_TOP_PAD`` 256 MiB.

After the first step the heap holds the step's peak and a step faults no page. The cost is memory: freed blocks stay
resident, and with one arena that never trims, steps of changing shapes fragment the heap (an SFT run grew from 13.4
to 17.6 GiB resident over 60 steps and was killed for memory when a second job shared the machine). So a guard thread
bounds it: when the machine runs short (``MemAvailable`` below ``LOW_MEMORY_SHARE`` of its memory) or the resident set
passes ``rss_limit`` (``JAXOPD_MALLOC_RSS_LIMIT_GB``; none by default) it calls ``malloc_trim(0)``, which hands every
free page back; the next step faults them in again, as without the tuning, and nothing else changes. Every tuned
process on a machine guards itself, so two of them give memory back before either is killed. Only glibc is tuned
(elsewhere nothing happens). The settings hold for allocations made after the call, so commands call it before jax
starts its CPU client. Measured: ``results/bench/host_malloc.md`` (the tiny preset's SFT step 3.27x faster tuned).
Safety under memory pressure: ``tests/core/test_host_malloc.py`` compiles and runs a new XLA program after another
beside a guard that trims every half millisecond (60 s here: 182 compiles beside 26,006 ``malloc_trim`` calls, exit
0). The SIGSEGV seen inside XLA compilation in long test runs was not the allocator: one pytest process held every
compiled program, whose code XLA:CPU maps as a dozen memory regions each, until Linux's vm.max_map_count (65,530)
made an mmap inside LLVM fail (``tests/conftest.py`` now drops the compiled programs after each test file)."""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading

__all__ = ["MALLOC_TUNING_ENV", "RSS_LIMIT_ENV", "MALLOC_SETTINGS", "tune_malloc", "resident_bytes", "trim_count"]

MALLOC_TUNING_ENV = "JAXOPD_MALLOC_TUNING"
RSS_LIMIT_ENV = "JAXOPD_MALLOC_RSS_LIMIT_GB"
GUARD_INTERVAL_S = 0.5
LOW_MEMORY_SHARE = 0.15     # the guard trims when less than this share of the machine's memory is available
# mallopt parameters of glibc's <malloc.h>, with the values tune_malloc sets
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_MAX, M_ARENA_MAX = -1, -2, -4, -8
MALLOC_SETTINGS = ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, -1), (M_TOP_PAD, 256 * 2 ** 20))

_applied: bool | None = None
_trims = 0


def resident_bytes() -> int:
    """This process's resident set (``VmRSS``), in bytes; 0 where ``/proc`` has none."""
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def trim_count() -> int:
    """How many times the guard has handed free memory back in this process."""
    return _trims


def _meminfo(field: str) -> int | None:
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _env_rss_limit() -> int | None:
    value = os.environ.get(RSS_LIMIT_ENV, "").strip()
    if not value:
        return None
    try:
        limit = float(value)
    except ValueError:
        limit = -1.0
    if limit <= 0:
        raise ValueError(f"{RSS_LIMIT_ENV} must be a positive number of GiB, got {value!r}")
    return int(limit * 2 ** 30)


def _short_of_memory(rss_limit: int | None) -> bool:
    available, total = _meminfo("MemAvailable"), _meminfo("MemTotal")
    if available is not None and total and available < LOW_MEMORY_SHARE * total:
        return True
    return rss_limit is not None and resident_bytes() > rss_limit


def _guard(trim, rss_limit: int | None, interval: float) -> None:
    global _trims
    event = threading.Event()
    while not event.wait(interval):
        if _short_of_memory(rss_limit):
            trim(0)
            _trims += 1


def tune_malloc(*, force: bool = False, rss_limit: int | None = None, interval: float = GUARD_INTERVAL_S) -> bool:
    """Apply ``MALLOC_SETTINGS`` once per process and start the guard (a daemon thread: ``malloc_trim(0)`` whenever
    the machine's available memory falls below ``LOW_MEMORY_SHARE`` or the resident set passes ``rss_limit`` bytes;
    default ``JAXOPD_MALLOC_RSS_LIMIT_GB``, else no limit) when ``JAXOPD_MALLOC_TUNING=1`` is set or ``force``.
    True when glibc took them all; False when it was not asked for, is not glibc, or ``mallopt`` refused one (it then
    leaves the rest as they were, and starts no guard). Decided once per process."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if not force and os.environ.get(MALLOC_TUNING_ENV, "0").strip() != "1":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        version = libc.gnu_get_libc_version          # glibc only: musl and macOS have no such symbol
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    version.restype = ctypes.c_char_p
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    limit = _env_rss_limit() if rss_limit is None else int(rss_limit)
    if limit is not None and limit <= 0:
        raise ValueError(f"rss_limit must be positive, got {rss_limit}")
    libc.malloc_trim.argtypes, libc.malloc_trim.restype = (ctypes.c_size_t,), ctypes.c_int
    _applied = all(mallopt(parameter, value) == 1 for parameter, value in MALLOC_SETTINGS)
    if _applied:
        threading.Thread(target=_guard, args=(libc.malloc_trim, limit, interval), name="jaxopd-malloc-guard",
                         daemon=True).start()
    return _applied
