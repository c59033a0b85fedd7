"""jaxopd.host_malloc: with the tuning a freed large block is reused without faulting a page; without, each reuse
faults it in again. Measured in fresh processes (allocator settings hold for a whole process)."""
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # heavier than the README's test run allows (run in CI: pytest -m slow)

PROBE = r"""
import ctypes, json, sys
from jaxopd.host_malloc import tune_malloc

tuned = tune_malloc()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
def faults():
    with open("/proc/self/stat") as handle:
        return int(handle.read().rsplit(")", 1)[1].split()[7])
size, counts = 64 * 2 ** 20, []
for _ in range(3):
    before = faults()
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)          # touch every page
    libc.free(block)
    counts.append(faults() - before)
print(json.dumps({"tuned": tuned, "faults": counts}))
"""


def probe(flag: str) -> dict:
    env = {**os.environ, "JAXOPD_MALLOC_TUNING": flag}
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc and /proc: Linux only")
def test_a_freed_block_is_reused_without_faults():
    pages = 64 * 2 ** 20 // os.sysconf("SC_PAGE_SIZE")
    default, tuned = probe("0"), probe("1")
    assert default["tuned"] is False and tuned["tuned"] is True
    # glibc's default: a 64 MiB block is a fresh mmap each time, every page faulted in again
    assert all(count >= pages * 0.9 for count in default["faults"]), default
    # tuned: the first use grows the heap; the block is then reused from it with (almost) no fault
    assert tuned["faults"][0] >= pages * 0.9 and max(tuned["faults"][1:]) < pages * 0.02, tuned


def test_tuning_is_opt_in_and_decided_once(monkeypatch):
    import jaxopd.host_malloc as host_malloc
    monkeypatch.setattr(host_malloc, "_applied", None)
    monkeypatch.delenv(host_malloc.MALLOC_TUNING_ENV, raising=False)
    assert host_malloc.tune_malloc() is False          # not asked for: the process keeps glibc's defaults
    monkeypatch.setenv(host_malloc.MALLOC_TUNING_ENV, "1")
    assert host_malloc.tune_malloc() is False          # decided once per process


def test_the_test_session_and_a_command_line_keep_the_defaults_unless_asked():
    env = {k: v for k, v in os.environ.items() if k != "JAXOPD_MALLOC_TUNING"}
    code = ("import jaxopd.host_malloc as h; from jaxopd import cli; cli.run_main(lambda: None); "
            "print(h._applied)")
    plain = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    asked = subprocess.run([sys.executable, "-c", code], env={**env, "JAXOPD_MALLOC_TUNING": "1"},
                           capture_output=True, text=True, check=True)
    assert plain.stdout.split()[-1] == "False"
    assert asked.stdout.split()[-1] == ("True" if sys.platform.startswith("linux") else "False")


COMPILES_BESIDE_TRIMS = r"""
import sys, time
from jaxopd.host_malloc import trim_count, tune_malloc
assert tune_malloc(force=True, rss_limit=1, interval=0.0005)     # the guard trims every half millisecond
import jax, jax.numpy as jnp
start, n = time.time(), 0
while time.time() - start < float(sys.argv[1]):
    n += 1
    f = jax.jit(lambda x, n=n: jnp.tanh(x @ x.T + n).sum(axis=0) * jnp.sin(x[:, :7]).mean())
    f(jnp.ones((64 + n % 50, 32 + n % 30))).block_until_ready()
print(n, trim_count())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc and /proc: Linux only")
def test_compiles_beside_a_trimming_guard_are_safe():
    """Memory pressure as the guard sees it (a 1-byte resident limit): XLA compiles and runs a new program after
    another while ``malloc_trim`` runs beside it all the time; the process must neither crash nor hang."""
    done = subprocess.run([sys.executable, "-c", COMPILES_BESIDE_TRIMS, "15"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    compiles, trims = map(int, done.stdout.split()[-2:])
    assert compiles >= 10 and trims >= 100, (compiles, trims)


GUARD_PROBE = r"""
import ctypes, json, time
from jaxopd.host_malloc import resident_bytes, trim_count, tune_malloc
assert tune_malloc(force=True, rss_limit=400 * 2 ** 20, interval=0.05)
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
base = resident_bytes()
small = libc.malloc(128 * 2 ** 20); ctypes.memset(small, 1, 128 * 2 ** 20); libc.free(small)
time.sleep(0.5)
kept, trims_small = resident_bytes() - base, trim_count()      # under the limit: kept, no trim
big = libc.malloc(640 * 2 ** 20); ctypes.memset(big, 1, 640 * 2 ** 20); libc.free(big)
time.sleep(0.5)
print(json.dumps({"kept": kept, "trims_small": trims_small, "after": resident_bytes() - base, "trims": trim_count()}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc and /proc: Linux only")
def test_the_guard_hands_memory_back_past_the_limit():
    done = subprocess.run([sys.executable, "-c", GUARD_PROBE], env={**os.environ, "JAXOPD_MALLOC_TUNING": "1"},
                          capture_output=True, text=True, check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    mib = 2 ** 20
    assert result["kept"] > 100 * mib and result["trims_small"] == 0, result     # the tuning keeps freed memory
    assert result["trims"] >= 1 and result["after"] < 100 * mib, result          # the guard gave 640 MiB back
