"""Orbax checkpoints of a training run: train state (parameters, optimizer state, step) and sample buffer.

Owns the on-disk layout (one orbax ``CheckpointManager`` step per saved update with the items
``train_state``, ``buffer_arrays`` and ``metadata``) and restoring it straight into given shardings. A damaged
checkpoint (a truncated data or metadata file, an empty step folder) is skipped with a warning naming its step,
and the newest readable one is restored, as verl and Tunix do.
"""
from __future__ import annotations

import dataclasses
import json
import os
import warnings
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxopd.train.buffer import SampleBuffer
from jaxopd.train.state import TrainState

_STATE = "train_state"
_BUFFER_ARRAYS = "buffer_arrays"
_METADATA = "metadata"


def read_checkpoint_metadata(directory: str | os.PathLike, step: int) -> dict[str, Any] | None:
    """The user metadata of checkpoint ``step`` under ``directory`` read from its JSON file (no orbax, no arrays);
    None when it is missing or unreadable."""
    try:
        data = json.loads((Path(directory) / str(int(step)) / _METADATA / "metadata").read_text())
    except (OSError, ValueError):
        return None
    return data.get("user") if isinstance(data, dict) else None


class CheckpointDamaged(RuntimeError):
    """No checkpoint under a folder could be read (each failure is named)."""


@dataclasses.dataclass(frozen=True)
class RestoredRun:
    step: int
    state: TrainState
    buffer: SampleBuffer | None
    metadata: dict[str, Any]


class TrainCheckpointer:
    """Saves and restores ``(TrainState, SampleBuffer, metadata)`` under ``directory`` by update step.

    ``max_to_keep`` newest checkpoints are kept. ``metadata`` is any JSON-serialisable dict (seeds,
    configs, counters) returned as is on restore. Use as a context manager or call :meth:`close`.
    """

    def __init__(self, directory: str | os.PathLike, *, max_to_keep: int | None = 3):
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"max_to_keep must be positive or None, got {max_to_keep}")
        self.directory = os.path.abspath(os.fspath(directory))
        self._manager = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep))

    def __enter__(self) -> "TrainCheckpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, state: TrainState, buffer: SampleBuffer | None = None, metadata: dict[str, Any] | None = None,
             *, step: int | None = None, wait: bool = True) -> int:
        """Writes a checkpoint at ``step`` (default: the state's own step) and returns the step.

        With ``wait=False`` the arrays are written in the background; call :meth:`wait` or :meth:`close`
        before relying on the files.
        """
        step = int(jax.device_get(state.step)) if step is None else int(step)
        buffer_metadata, buffer_arrays = buffer.state() if buffer is not None else (None, {})
        items = {
            _STATE: ocp.args.StandardSave(state),
            _METADATA: ocp.args.JsonSave({"step": step, "buffer": buffer_metadata,
                                          "buffer_arrays": sorted(buffer_arrays), "user": metadata or {}}),
        }
        if buffer_arrays:
            items[_BUFFER_ARRAYS] = ocp.args.StandardSave(buffer_arrays)
        self._manager.save(step, args=ocp.args.Composite(**items), force=True)
        if wait:
            self.wait()
        return step

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def candidate_steps(self) -> list[int]:
        """Every step folder under the directory, newest first: orbax's list and any integer-named folder it skips
        (an empty or unfinished step), so that ``restore_latest`` can name what it passes over."""
        listed = set(self.all_steps())
        root = Path(self.directory)
        if root.is_dir():
            listed |= {int(p.name) for p in root.iterdir() if p.is_dir() and p.name.isdigit()}
        return sorted(listed, reverse=True)

    def restore_latest(self, abstract_state: TrainState,
                       warn: Callable[[str], None] | None = None) -> RestoredRun | None:
        """The newest checkpoint that restores; each newer damaged one is reported through ``warn`` (default
        ``warnings.warn``) with its step and the error, and set aside (renamed ``<step>.damaged``) so it is never
        listed again. None when the directory holds no checkpoint; ``CheckpointDamaged`` when none restores."""
        failures = []
        for step in self.candidate_steps():
            try:
                return self.restore(abstract_state, step)
            except Exception as error:    # orbax/tensorstore raise many kinds on a damaged file
                reason = " ".join(f"{type(error).__name__}: {error}".split())[:300]
                failures.append(f"step {step}: {reason}")
                message = (f"checkpoint of step {step} under {self.directory} is damaged ({reason}); "
                           "resuming from an earlier one")
                (warn or (lambda text: warnings.warn(text, RuntimeWarning, stacklevel=3)))(message)
                self._set_aside(step)
        if failures:
            raise CheckpointDamaged(f"no checkpoint under {self.directory} can be read: {'; '.join(failures)}")
        return None

    def _set_aside(self, step: int) -> None:
        path = Path(self.directory) / str(step)
        if path.exists():
            target = path.with_name(f"{step}.damaged")
            suffix = 1
            while target.exists():
                target, suffix = path.with_name(f"{step}.damaged{suffix}"), suffix + 1
            os.replace(path, target)
        self._manager.reload()

    def restore(self, abstract_state: TrainState, step: int | None = None) -> RestoredRun:
        """Restores ``step`` (default: the latest) into ``abstract_state``'s shapes, dtypes and shardings
        (see ``jaxopd.train.state.abstract_train_state``)."""
        step = self.latest_step() if step is None else int(step)
        if step is None:
            raise FileNotFoundError(f"no checkpoint under {self.directory!r}")
        if step not in self.all_steps():
            raise FileNotFoundError(f"no checkpoint of step {step} under {self.directory!r} "
                                    f"(steps: {self.all_steps()})")
        metadata = self._manager.restore(step, args=ocp.args.Composite(
            **{_METADATA: ocp.args.JsonRestore()}))[_METADATA]
        items = {_STATE: ocp.args.StandardRestore(abstract_state)}
        if metadata["buffer_arrays"]:
            items[_BUFFER_ARRAYS] = ocp.args.StandardRestore()
        restored = self._manager.restore(step, args=ocp.args.Composite(**items))
        buffer = None
        if metadata["buffer"] is not None:
            arrays = ({name: np.asarray(value) for name, value in restored[_BUFFER_ARRAYS].items()}
                      if metadata["buffer_arrays"] else {})
            buffer = SampleBuffer.from_state(metadata["buffer"], arrays)
        return RestoredRun(step=step, state=restored[_STATE], buffer=buffer, metadata=metadata["user"])


__all__ = ["CheckpointDamaged", "RestoredRun", "TrainCheckpointer", "read_checkpoint_metadata"]
