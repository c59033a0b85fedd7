"""A training run's folder: one process at a time, the config it was trained with, and how a run stops on a signal.

Owns ``RunLock`` (an advisory ``flock`` on ``<out>/.lock`` that holds the owner's pid: a second process training
into the same folder is refused with ``--out X is in use by pid N``), ``check_resume`` (whether a folder's run may
be continued with a config: only a folder holding a checkpoint has a run to protect, and the checkpoint's own copy
of the config is the reference, so a lost ``config.json`` changes nothing), and ``Interruption``: SIGINT and SIGTERM
become a flag the training loops poll at safe points; they then write a checkpoint and raise ``Interrupted``, which
the command lines report as one line and exit code 128 + the signal number.
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import os
import signal
import threading
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

CONFIG_FILE = "config.json"
CHECKPOINTS = "checkpoints"
LOCK_FILE = ".lock"
# fields a resumed run may change (how long it runs and how it reports); every other field must match
RESUMABLE_CHANGES = frozenset({"updates", "eval_every", "eval_tasks", "eval_seeds", "checkpoint_every",
                               "keep_checkpoints", "eval_max_turns", "eval_max_prompt_tokens",
                               "eval_first_stage_tokens", "eval_total_tokens"})
# fields that decide the evaluation of the untrained student (update 0: its LoRA adds nothing yet) and its held-out
# reverse KL to the teacher; runs equal in all of them may share that evaluation (experiments.train --first-eval-from)
FIRST_EVALUATION_FIELDS = ("benchmark", "games", "generated_train_games", "student", "student_model_preset",
                           "student_layers", "teacher", "teacher_model_preset", "temperature", "rollout_slots",
                           "max_prompt_tokens", "second_stage_tokens", "page_size", "sft_thinking", "eval_split",
                           "eval_tasks", "eval_seeds", "eval_greedy", "eval_temperature", "eval_max_turns",
                           "eval_max_prompt_tokens", "eval_first_stage_tokens", "eval_total_tokens")
# keys a saved config carries that follow from its fields (RunConfig.departures): never compared
DERIVED_KEYS = frozenset({"departures"})
PATH_FIELDS = ("student", "teacher")        # compared as resolved paths (a trailing slash is the same folder)


class RunFolderError(ValueError):
    """A run folder that cannot take this run (in use, another config, ahead of ``--updates``)."""


# ----------------------------------------------------------------------------------------------------------
# One process per folder
# ----------------------------------------------------------------------------------------------------------
_held: dict[str, list[Any]] = {}            # resolved folder -> [open lock file, depth] in this process
_held_lock = threading.Lock()


def lock_file_name() -> str:
    """``.lock``; in a multi-process run (``JAXOPD_PROCESS_ID`` set, ``jaxopd.train.distributed``) process p > 0 holds
    ``.lock.<p>``: one process of each index per folder."""
    process = os.environ.get("JAXOPD_PROCESS_ID", "").strip()
    return LOCK_FILE if process in ("", "0") else f"{LOCK_FILE}.{process}"


class RunLock:
    """Holds ``<folder>/.lock`` for this process (re-entrant within it); ``RunFolderError`` naming the pid that
    holds it otherwise. The lock is the kernel's: it goes with the process, however that ends."""

    def __init__(self, folder: str | os.PathLike, *, flag: str = "--out"):
        self.folder = Path(folder)
        self.flag = flag
        self._key = str(self.folder.resolve())

    def __enter__(self) -> "RunLock":
        with _held_lock:
            entry = _held.get(self._key)
            if entry is not None:
                entry[1] += 1
                return self
            self.folder.mkdir(parents=True, exist_ok=True)
            handle = open(self.folder / lock_file_name(), "a+")
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    handle.close()
                    raise
                handle.seek(0)
                owner = handle.read().strip() or "another process"
                handle.close()
                raise RunFolderError(f"{self.flag} {str(self.folder)!r} is in use by pid {owner}; wait for that run "
                                     "or use another folder") from None
            handle.seek(0)
            handle.truncate()
            handle.write(str(os.getpid()))
            handle.flush()
            _held[self._key] = [handle, 1]
        return self

    def __exit__(self, *exc) -> None:
        with _held_lock:
            entry = _held.get(self._key)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] == 0:
                handle = entry[0]
                handle.seek(0)
                handle.truncate()
                fcntl.flock(handle, fcntl.LOCK_UN)
                handle.close()
                del _held[self._key]


# ----------------------------------------------------------------------------------------------------------
# The config of the run in a folder
# ----------------------------------------------------------------------------------------------------------
def checkpoint_steps(folder: str | os.PathLike) -> list[int]:
    """The steps of the checkpoints under ``<folder>/checkpoints`` (folders named by an integer), ascending. Reads
    the folder only (no orbax): a damaged checkpoint is still listed (``TrainCheckpointer.restore`` skips it)."""
    root = Path(folder) / CHECKPOINTS
    if not root.is_dir():
        return []
    return sorted(int(p.name) for p in root.iterdir() if p.is_dir() and p.name.isdigit())


def _normalised(config: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    out = {**defaults, **config}
    for name in PATH_FIELDS:
        if out.get(name):
            out[name] = str(Path(out[name]).expanduser().resolve())
    return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}


def config_differences(saved: Mapping[str, Any], mine: Mapping[str, Any], defaults: Mapping[str, Any],
                       only: Sequence[str] | None = None) -> list[str]:
    """The fields (outside ``RESUMABLE_CHANGES``; or, given ``only``, among those) in which two config dicts differ;
    a field one of them lacks counts as its default, and folders are compared as resolved paths."""
    a, b = _normalised(saved, defaults), _normalised(mine, defaults)
    if only is not None:
        return sorted(k for k in only if a.get(k) != b.get(k))
    return sorted(k for k in set(a) | set(b)
                  if a.get(k) != b.get(k) and k not in RESUMABLE_CHANGES and k not in DERIVED_KEYS)


def config_defaults(config: Any) -> dict[str, Any]:
    return {f.name: list(f.default) if isinstance(f.default, tuple) else f.default
            for f in dataclasses.fields(config) if f.default is not dataclasses.MISSING}


def saved_run_config(folder: str | os.PathLike) -> dict[str, Any] | None:
    """The config the folder's run was trained with: the copy its checkpoints carry (newest readable first), else
    its ``config.json``; None when neither exists."""
    from jaxopd.train.checkpoint import read_checkpoint_metadata

    for step in reversed(checkpoint_steps(folder)):
        metadata = read_checkpoint_metadata(Path(folder) / CHECKPOINTS, step)
        if metadata is not None and isinstance(metadata.get("config"), dict):
            return metadata["config"]
    path = Path(folder) / CONFIG_FILE
    if path.is_file():
        try:
            return json.loads(path.read_text())
        except ValueError:
            return None
    return None


def check_resume(folder: str | os.PathLike, config: Any, *, updates_field: str = "updates",
                 flag: str = "--out") -> int | None:
    """Whether ``folder`` may take a run of ``config`` (a ``RunConfig``): the newest checkpoint step it would resume
    from, or None for a fresh run (no checkpoint: nothing to protect, a stale ``config.json`` included).
    ``RunFolderError`` when its checkpoints were trained with another config, carry no record of their config, or
    are past ``config.updates``."""
    steps = checkpoint_steps(folder)
    if not steps:
        return None
    saved = saved_run_config(folder)
    if saved is None:
        raise RunFolderError(f"{flag} {str(folder)!r} holds checkpoints (steps {steps}) but no record of the config "
                             "they were trained with; use another folder")
    changed = config_differences(saved, config.to_dict(), config_defaults(config))
    if changed:
        raise RunFolderError(f"{flag} {str(folder)!r} holds a run with a different config ({', '.join(changed)} "
                             "differ); use another folder or the same settings")
    updates = getattr(config, updates_field)
    trained, what = steps[-1], "update"
    if _counts_collections(config):     # ActionOPD's steps are collection steps; checkpoints are by update
        from jaxopd.train.checkpoint import read_checkpoint_metadata
        metadata = read_checkpoint_metadata(Path(folder) / CHECKPOINTS, steps[-1]) or {}
        trained, what = int(metadata.get("collections", 0)), "collection step"
    if trained > updates:
        raise RunFolderError(f"--{updates_field} {updates} is below {what} {trained}, which {flag} "
                             f"{str(folder)!r} has already trained; give at least {trained}")
    return steps[-1]


def _counts_collections(config: Any) -> bool:
    from jaxopd.methods.registry import make_method
    try:
        return bool(make_method(config).trains_in_collections)
    except (ValueError, KeyError, TypeError):
        return False


def save_config(folder: str | os.PathLike, config: Any) -> None:
    """``<folder>/config.json``: the run's config, for people and reports (written atomically)."""
    path = Path(folder) / CONFIG_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(config.to_json() + "\n")
    os.replace(tmp, path)


def check_and_save_config(folder: str | os.PathLike, config: Any, *, write: bool = True) -> int | None:
    """``check_resume`` then ``save_config`` (unless ``write`` is False: a multi-process run's other processes only
    check); returns the step a run resumes from (None: fresh)."""
    step = check_resume(folder, config)
    if write:
        save_config(folder, config)
    return step


# ----------------------------------------------------------------------------------------------------------
# Signals
# ----------------------------------------------------------------------------------------------------------
class Interrupted(Exception):
    """A run stopped by SIGINT or SIGTERM after writing its checkpoint of ``update``."""

    def __init__(self, signum: int, update: int, checkpointed: bool = True):
        self.signum, self.update, self.checkpointed = signum, update, checkpointed
        what = "checkpoint written" if checkpointed else "no checkpoint written"
        super().__init__(f"interrupted at update {update}; {what}; rerun the same command to resume")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class Interruption:
    """While active (a context manager, main thread only), SIGINT and SIGTERM set ``signum`` instead of killing the
    process; a second signal of the same kind restores the default action (a user who presses Ctrl-C twice means
    it). Elsewhere (a worker thread) it is inert and ``signum`` stays None."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum, frame) -> None:
        if self.signum is None:
            self.signum = signum
            return
        previous = self._previous.get(signum, signal.SIG_DFL)     # the second one: what it would have done
        if callable(previous):
            previous(signum, frame)         # Python's SIGINT handler: KeyboardInterrupt, the finally blocks run
        else:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def __enter__(self) -> "Interruption":
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    @property
    def requested(self) -> bool:
        return self.signum is not None


@contextlib.contextmanager
def run_folder(folder: str | os.PathLike, *, flag: str = "--out") -> Iterator[Interruption]:
    """The lock of ``folder`` and signal handling, for the duration of a run."""
    with RunLock(folder, flag=flag), Interruption() as interruption:
        yield interruption


__all__ = ["CHECKPOINTS", "CONFIG_FILE", "Interrupted", "Interruption", "RESUMABLE_CHANGES", "RunFolderError",
           "RunLock", "check_and_save_config", "check_resume", "checkpoint_steps", "config_differences",
           "run_folder", "save_config", "saved_run_config"]
