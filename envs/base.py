"""The one small interface every text environment implements: tasks, reset, step, observation record.

Owns the data types shared by all environments (``Task``, ``Observation``) and the abstract
``TextEnv``; it knows nothing of any particular benchmark.
"""
from __future__ import annotations

import abc
import dataclasses
from typing import Any, Sequence

SPLITS = ("train", "valid_seen", "valid_unseen", "eval")


@dataclasses.dataclass(frozen=True)
class Task:
    """One task an environment can reset to. ``task_id`` is unique within its benchmark."""

    benchmark: str          # "alfworld" | "scienceworld"
    split: str              # one of SPLITS that the benchmark uses
    task_id: str            # stable, human-readable id, e.g. "alfworld/train/pick_and_place_simple-...-17"
    task_type: str          # ALFWorld: one of the six task types; ScienceWorld: task name, e.g. "boil"
    payload: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False, hash=False)
    # payload: benchmark-specific data needed to load the task (game file path, task index, variation).


@dataclasses.dataclass(frozen=True)
class Observation:
    """What the agent sees after reset or step."""

    text: str                                   # the observation text o_t
    instruction: str                            # the task instruction q (constant over an episode)
    admissible_actions: tuple[str, ...] = ()    # concrete valid actions (ALFWorld excludes "help")
    action_templates: tuple[str, ...] = ()      # ScienceWorld action templates ("open OBJ", ...)
    objects: tuple[str, ...] = ()               # ScienceWorld object referents for prompts
    done: bool = False
    won: bool = False
    score: float = 0.0                          # benchmark score; ScienceWorld: max reached, in [0, 100]
    reward: float = 0.0                         # reward of the last step
    turn: int = 0                               # number of actions executed since reset
    last_action_valid: bool = True              # whether the last action was admissible/valid
    info: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False, hash=False)


class EnvError(RuntimeError):
    """An environment failed (crashed process, broken game); the pool rebuilds and replays it."""


class TextEnv(abc.ABC):
    """A resettable text environment. Not thread-safe: one thread steps one instance at a time."""

    benchmark: str = ""

    @abc.abstractmethod
    def tasks(self, split: str) -> Sequence[Task]:
        """The tasks of a split, in a deterministic order."""

    @abc.abstractmethod
    def reset(self, task: Task) -> Observation:
        """Start an episode of ``task``; returns o_1 (turn 0)."""

    @abc.abstractmethod
    def step(self, action: str) -> Observation:
        """Execute one action; returns the next observation (turn + 1)."""

    def close(self) -> None:
        """Release processes and files. Idempotent."""

    def __enter__(self) -> "TextEnv":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
