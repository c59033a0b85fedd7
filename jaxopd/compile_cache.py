"""JAX's persistent compilation cache for the command lines: a program compiled once is read back, not compiled again.

Owns ``enable_compile_cache`` and its settings. Every engine and trainer compiles a few dozen programs at start (the
sampler's buckets, the training step's shapes); on this project's 2-core machine a 30-layer model's prefill shape takes
about 13 s to compile, so a command that is rerun, resumed after a kill, or run stage after stage by
``experiments.train_chain`` spent minutes compiling what it had compiled before. Like ``jaxopd.host_malloc`` it is
applied by ``jaxopd.cli.run_main`` only, never on import: a library must not change the JAX configuration of the
process that imports it. The cache lives in ``$JAXOPD_COMPILE_CACHE`` when set, ``off`` (or ``0``, ``no``) turns it
off, and by default it is ``<jaxopd cache>/xla`` (``jaxopd.models.pretrained.cache_dir``). JAX keys an entry by the
program, its compile options, the backend and the jax/jaxlib versions, so a stale entry is never read; the cache is
bounded (``MAX_BYTES``, least recently used out). The test session turns it off (``tests/conftest.py``) and tests it
in its own processes.
"""
from __future__ import annotations

import os
from pathlib import Path

COMPILE_CACHE_ENV = "JAXOPD_COMPILE_CACHE"
OFF_VALUES = ("off", "0", "no", "false")
MIN_COMPILE_SECONDS = 1.0        # programs that compile faster are not worth a file
MAX_BYTES = 4 * 2 ** 30          # least recently used entries go beyond this


def compile_cache_dir() -> Path | None:
    """Where the cache lives: ``$JAXOPD_COMPILE_CACHE``, None when that says off, else ``<jaxopd cache>/xla``."""
    value = os.environ.get(COMPILE_CACHE_ENV, "").strip()
    if value.lower() in OFF_VALUES:
        return None
    if value:
        return Path(value).expanduser()
    from jaxopd.models.pretrained import cache_dir
    return cache_dir() / "xla"


def enable_compile_cache() -> Path | None:
    """Point JAX's persistent compilation cache at ``compile_cache_dir()`` (nothing when it is off); the folder, or
    None. A folder that cannot be created leaves the cache off (a warning on stderr), never stops the command."""
    folder = compile_cache_dir()
    if folder is None:
        return None
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        import sys
        print(f"warning: no compilation cache ({COMPILE_CACHE_ENV}={folder}: {error})", file=sys.stderr)
        return None
    import jax
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    return folder


__all__ = ["COMPILE_CACHE_ENV", "compile_cache_dir", "enable_compile_cache"]
