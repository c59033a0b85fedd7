"""What a result records about the machine and the software that made it: the one ``machine_info`` every command
line and benchmark writes into its JSON (``"machine"``).

Why the CPU's model and features. XLA compiles CPU code for the host it runs on (its vector extensions: AVX2,
AVX-512, AMX), so the same jitted training step rounds differently on another CPU model: a chain of training runs
repeats bit for bit on one machine and drifts apart on another (2026-11: the same 200 SFT steps gave the same loss to
the last digit twice on an AVX-512 EPYC, and another loss on a different EPYC, both with jax 0.10.2). The versions
of the numeric packages are recorded for the same reason.

Nothing heavy is imported unless asked: ``machine_info(devices=False)`` reads no jax state (a ``--dry-run``), and the
package versions come from the installed distributions' metadata.
"""
from __future__ import annotations

import importlib.metadata
import os
import platform
from pathlib import Path
from typing import Any

PACKAGES = ("jax", "jaxlib", "flax", "optax", "numpy", "transformers")
"""The distributions whose versions a result records (those that change a number)."""

CPU_FEATURE_PREFIXES = ("avx", "amx", "fma", "f16c", "sse4")
"""The ``/proc/cpuinfo`` flags that change the code XLA's CPU backend emits (vector width, fused multiply-add,
half-precision conversions)."""


def _cpuinfo(path: str | os.PathLike = "/proc/cpuinfo") -> dict[str, str]:
    """The first processor's ``key: value`` lines of ``path``; empty where there is none (not Linux)."""
    fields: dict[str, str] = {}
    try:
        text = Path(path).read_text()
    except OSError:
        return fields
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    return fields


def cpu_model(cpuinfo: str | os.PathLike = "/proc/cpuinfo") -> str:
    """The CPU's model name (``/proc/cpuinfo``), else ``platform.processor()`` or the architecture."""
    return _cpuinfo(cpuinfo).get("model name") or platform.processor() or platform.machine()


def cpu_features(cpuinfo: str | os.PathLike = "/proc/cpuinfo") -> list[str]:
    """The CPU's flags that change XLA's CPU code (``CPU_FEATURE_PREFIXES``), sorted: ``["avx", "avx2",
    "avx512f", ..., "fma"]``; empty where ``/proc/cpuinfo`` has none (not Linux)."""
    flags = _cpuinfo(cpuinfo).get("flags", "").split()
    return sorted({flag for flag in flags if flag.startswith(CPU_FEATURE_PREFIXES)})


def package_versions(names: tuple[str, ...] = PACKAGES) -> dict[str, str | None]:
    """The installed version of each distribution in ``names``; None for one not installed."""
    versions: dict[str, str | None] = {}
    for name in names:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def memory_gib() -> float | None:
    """The machine's memory (``MemTotal`` of ``/proc/meminfo``) in GiB; None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("MemTotal:")) / 1024 / 1024
    except (OSError, StopIteration, ValueError, IndexError):
        return None


def machine_info(*, devices: bool = True) -> dict[str, Any]:
    """The machine a result was made on: ``platform``, ``python``, ``cpu`` (model name), ``cpu_features``,
    ``cpu_count``, ``memory_gib``, ``packages`` (versions of ``PACKAGES``), ``jax`` (its version, also under
    ``packages``); with ``devices`` (the default; imports jax and starts its backend) also ``backend``,
    ``device_kind``, ``num_devices`` and ``devices`` (their names)."""
    packages = package_versions()
    info: dict[str, Any] = {"platform": platform.platform(), "python": platform.python_version(),
                            "cpu": cpu_model(), "cpu_features": cpu_features(), "cpu_count": os.cpu_count(),
                            "memory_gib": memory_gib(), "packages": packages, "jax": packages.get("jax")}
    if devices:
        import jax
        found = jax.devices()
        info.update(backend=jax.default_backend(), device_kind=found[0].device_kind, num_devices=len(found),
                    devices=[str(d) for d in found])
    return info


NUMERIC_KEYS = ("cpu", "cpu_features", "packages")
"""The fields of a ``machine_info`` record that decide a CPU program's floats."""


def numerics(info: dict[str, Any]) -> dict[str, Any]:
    """The ``NUMERIC_KEYS`` of a ``machine_info`` record: what a result keeps to be compared by
    :func:`same_numerics` later."""
    return {key: info.get(key) for key in NUMERIC_KEYS}


def same_numerics(a: dict[str, Any], b: dict[str, Any]) -> bool | None:
    """Whether two ``machine_info`` records (or their :func:`numerics`) should give the same floats for the same
    jitted program: the same ``NUMERIC_KEYS`` (and backend, where both name one). None where either record lacks
    the CPU's features (made before they were recorded)."""
    if not a.get("cpu_features") or not b.get("cpu_features"):
        return None
    keys = NUMERIC_KEYS + (("backend",) if "backend" in a and "backend" in b else ())
    return all(a.get(key) == b.get(key) for key in keys)
