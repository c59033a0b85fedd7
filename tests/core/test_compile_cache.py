"""``jaxopd.compile_cache``: where the persistent compilation cache lives, and that a command's second process reads
the programs its first one compiled (JAX's own cache-hit events, in fresh processes: the test session runs with the
cache off)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from jaxopd import compile_cache

# a command (``cli.run_main``) that compiles one program and prints JAX's cache events; the threshold is lowered so
# that this small program is worth an entry
PROGRAM = """
import json, sys
import jax, jax.numpy as jnp
from jaxopd import cli, compile_cache
compile_cache.MIN_COMPILE_SECONDS = 0.0
events = []
jax.monitoring.register_event_listener(lambda name, **kw: events.append(name))
def body():
    jax.jit(lambda x: jnp.tanh(x @ x.T) * 3.0)(jnp.ones((8, 8))).block_until_ready()
    print(json.dumps(sorted({e.rsplit('/', 1)[-1] for e in events if 'compilation_cache' in e})))
sys.exit(cli.run_main(body))
"""


def run_command(env_value: str | None) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != compile_cache.COMPILE_CACHE_ENV}
    if env_value is not None:
        env[compile_cache.COMPILE_CACHE_ENV] = env_value
    out = subprocess.run([sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, timeout=300,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_folder_follows_the_variable_and_the_jaxopd_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("JAXOPD_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(compile_cache.COMPILE_CACHE_ENV, raising=False)
    assert compile_cache.compile_cache_dir() == tmp_path / "cache" / "xla"
    monkeypatch.setenv(compile_cache.COMPILE_CACHE_ENV, str(tmp_path / "elsewhere"))
    assert compile_cache.compile_cache_dir() == tmp_path / "elsewhere"
    for off in ("off", "OFF", "0", "no", "false"):
        monkeypatch.setenv(compile_cache.COMPILE_CACHE_ENV, off)
        assert compile_cache.compile_cache_dir() is None
        assert compile_cache.enable_compile_cache() is None


def test_a_folder_that_cannot_be_made_leaves_the_cache_off(monkeypatch, tmp_path, capsys):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv(compile_cache.COMPILE_CACHE_ENV, str(tmp_path / "file" / "xla"))
    assert compile_cache.enable_compile_cache() is None
    assert "no compilation cache" in capsys.readouterr().err


def test_a_second_command_reads_what_the_first_compiled(tmp_path):
    folder = tmp_path / "xla"
    first = run_command(str(folder))
    assert "cache_misses" in first and "cache_hits" not in first
    assert any(Path(folder).iterdir())                                  # the entry was written
    second = run_command(str(folder))
    assert "cache_hits" in second and "cache_misses" not in second
    off = run_command("off")
    assert not ({"cache_hits", "cache_misses"} & set(off))               # off: JAX never looked
