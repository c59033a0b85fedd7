"""Where a run's numbers go: one JSON line per record and TensorBoard event files.

Owns ``MetricsWriter``: ``write(kind, step, values)`` appends ``{"kind", "step", "time", **values}`` to
``<out>/<kind>.jsonl`` (``train``, ``eval``, ...) and writes every numeric value as a TensorBoard scalar
``<kind>/<name>`` through ``tensorboardX`` (a maintained writer of the event format; TensorBoard itself is not
needed to write). ``read_jsonl`` reads such a file back, skipping a torn last line (a killed run).
A resumed run opens its writer with ``resume_step``: records after that step (written by the killed run after
its last checkpoint, to be written again) and a torn last line are removed first, and TensorBoard purges its
events after that step, so every step appears once.
"""
from __future__ import annotations

import json
import math
import numbers
import os
import time
from pathlib import Path
from typing import Any, Mapping

__all__ = ["MetricsWriter", "read_jsonl", "rewind_jsonl"]


def _plain(value: Any) -> Any:
    if hasattr(value, "item") and getattr(value, "shape", None) == ():
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    return value


class MetricsWriter:
    """JSONL + TensorBoard writer of one run directory (see the module docstring). ``tensorboard=False`` writes
    JSONL only. Thread-safe enough for one writer thread; close it (or use it as a context manager)."""

    def __init__(self, out_dir: str | os.PathLike, *, tensorboard: bool = True, resume_step: int | None = None):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._files: dict[str, Any] = {}
        self._tb = None
        if resume_step is not None:
            for path in sorted(self.out_dir.glob("*.jsonl")):
                rewind_jsonl(path, resume_step)
        if tensorboard:
            from tensorboardX import SummaryWriter
            purge = None if resume_step is None else int(resume_step) + 1
            self._tb = SummaryWriter(str(self.out_dir / "tensorboard"), purge_step=purge)

    def write(self, kind: str, step: int, values: Mapping[str, Any]) -> dict[str, Any]:
        record = {"kind": kind, "step": int(step), "time": time.time(),
                  **{name: _plain(value) for name, value in values.items()}}
        handle = self._files.get(kind)
        if handle is None:
            handle = self._files[kind] = open(self.out_dir / f"{kind}.jsonl", "a", encoding="utf-8")
        handle.write(json.dumps(record, sort_keys=True) + "\n")
        handle.flush()
        if self._tb is not None:
            for name, value in record.items():
                if name in ("kind", "step", "time") or isinstance(value, bool):
                    continue
                if isinstance(value, numbers.Real) and math.isfinite(float(value)):
                    self._tb.add_scalar(f"{kind}/{name}", float(value), int(step))
            self._tb.flush()
        return record

    def close(self) -> None:
        for handle in self._files.values():
            handle.close()
        self._files.clear()
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def rewind_jsonl(path: str | os.PathLike, step: int) -> int:
    """Keeps the records of ``path`` up to ``step`` (and those without a step), drops a torn last line; the
    file is replaced atomically. Returns the number of records removed."""
    path = Path(path)
    records = read_jsonl(path)
    kept = [r for r in records if not isinstance(r.get("step"), int) or r["step"] <= step]
    text = "".join(json.dumps(r, sort_keys=True) + "\n" for r in kept)
    if text != path.read_text(encoding="utf-8"):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    return len(records) - len(kept)


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a JSONL file; a torn last line (the writer was killed mid-line) is skipped."""
    records = []
    path = Path(path)
    if not path.is_file():
        return records
    lines = path.read_text(encoding="utf-8").splitlines()
    for index, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if index == len(lines) - 1:
                break
            raise
    return records
