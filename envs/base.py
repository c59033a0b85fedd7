"""The one small interface every text environment implements: tasks, reset, step, observation record.

Owns the data types shared by all environments (``Task``, ``Observation``) and the abstract
``TextEnv``; it knows nothing of any particular benchmark.
"""
from __future__ import annotations

import abc
import dataclasses
import operator
from typing import Any, ClassVar, Sequence

SPLITS = ("train", "valid_seen", "valid_unseen", "eval")


# ---------------------------------------------------------------------------------- argument checks
# One spelling of "an int" and "a bool" for every envs/ entry point: ``True`` is not the integer 1 and
# ``"False"`` is not a truth value, while numpy's integers and booleans (what array code hands over) are
# accepted for what they are.


def require_int(value: Any, what: str, *, minimum: int | None = None) -> int:
    """``value`` as a Python int: an int or a numpy integer (anything with ``__index__``), never a bool,
    float or string. Raises ``ValueError`` naming ``what`` otherwise, or when below ``minimum``."""
    if isinstance(value, bool) or _is_numpy_bool(value) or not hasattr(type(value), "__index__"):
        raise ValueError(f"{what} must be an int, got {value!r} ({type(value).__name__})")
    number = operator.index(value)
    if minimum is not None and number < minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {number}")
    return number


def require_bool(value: Any, what: str) -> bool:
    """``value`` as a Python bool: a bool or a numpy bool, never a string ("False"), number or None."""
    if isinstance(value, bool):
        return value
    if _is_numpy_bool(value):
        return bool(value)
    raise ValueError(f"{what} must be a bool, got {value!r} ({type(value).__name__})")


def require_text(value: Any, what: str) -> str:
    """``value`` if it is a str that can be encoded as UTF-8 (no lone surrogates), else ``ValueError``."""
    if not isinstance(value, str):
        raise ValueError(f"{what} must be a str, got {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"{what} is not valid text: {error.reason} at position {error.start} "
                         f"({value[max(error.start - 10, 0):error.end + 10]!r})") from None
    return value


def _is_numpy_bool(value: Any) -> bool:
    kind = type(value)
    return kind.__module__ == "numpy" and kind.__name__ in ("bool_", "bool")


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

    def __post_init__(self) -> None:
        # The flags steer episodes and checks: a truthy string ("False") or number must not pass for one.
        for name in ("done", "won", "last_action_valid"):
            object.__setattr__(self, name, require_bool(getattr(self, name), f"Observation.{name}"))
        object.__setattr__(self, "turn", require_int(self.turn, "Observation.turn", minimum=0))


class EnvError(RuntimeError):
    """An environment failed (crashed process, broken game); the pool rebuilds and replays it."""


class TextEnv(abc.ABC):
    """A resettable text environment. Not thread-safe: one thread steps one instance at a time.

    Two class attributes tell ``jaxopd_envs.pool.EnvPool`` how to run instances: ``pool_backend`` is the
    backend it picks by default ("thread", or "process" for an engine whose instances cannot overlap
    in one process), and ``call_lock``, when not None, is a lock that every call of every instance in
    this process holds (an engine that is not thread-safe); the pool acquires it before it starts
    timing a call, so a call's timeout never counts the wait for another instance.
    """

    benchmark: str = ""
    pool_backend: ClassVar[str] = "thread"
    call_lock: Any = None

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
