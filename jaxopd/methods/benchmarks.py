"""Where a training or evaluation run gets its tasks: the benchmark's game source, splits, environment factory
and reference trajectories.

Owns the mapping from a benchmark name (``alfworld``, ``scienceworld``) and a game source (ALFWorld: the
official games under ``$ALFWORLD_DATA`` or games generated from the alfworld wheel's floor plans,
``jaxopd_envs.alfworld_gen``) to a picklable environment factory, the train / evaluation split names, deterministic
task subsets, and the cached reference trajectories (walkthroughs / gold paths) that ActFirst-OPD's guidance and
the teacher's supervised fine-tuning read. Nothing here downloads.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from jaxopd_envs import alfworld_gen
from jaxopd_envs.base import Task, TextEnv

if TYPE_CHECKING:
    from jaxopd_envs.references import LazyReferences

BENCHMARKS = ("alfworld", "scienceworld")
GAME_SOURCES = ("auto", "generated", "official")
TRAIN_SPLIT = {"alfworld": "train", "scienceworld": "train"}
EVAL_SPLITS = {"alfworld": ("valid_seen", "valid_unseen"), "scienceworld": ("eval",)}
ALFWORLD_DATA_ENV = "ALFWORLD_DATA"


class BenchmarkError(ValueError):
    """A benchmark cannot be set up as asked (no games, a missing folder, an unknown split)."""


@dataclasses.dataclass(frozen=True)
class GeneratedCounts:
    """How many ALFWorld games to generate per split (``jaxopd_envs.alfworld_gen``) and the generator seed; the defaults
    are ``jaxopd_envs.alfworld_gen.TRAINING_COUNTS`` (``python -m jaxopd_envs.alfworld_gen --counts training`` makes the
    same tree)."""

    train: int = alfworld_gen.TRAINING_COUNTS["train"]
    valid_seen: int = alfworld_gen.TRAINING_COUNTS["valid_seen"]
    valid_unseen: int = alfworld_gen.TRAINING_COUNTS["valid_unseen"]
    seed: int = 0

    def as_counts(self) -> dict[str, int]:
        return {"train": self.train, "valid_seen": self.valid_seen, "valid_unseen": self.valid_unseen}


@dataclasses.dataclass(frozen=True)
class BenchmarkSource:
    """A resolved task source: the benchmark, the ALFWorld game root (None for ScienceWorld), where its games
    come from (``official`` / ``generated`` / ``scienceworld``) and a picklable environment factory."""

    benchmark: str
    root: Path | None
    games: str
    env_factory: Callable[[], TextEnv]

    def describe(self) -> str:
        if self.benchmark == "scienceworld":
            return "ScienceWorld 1.2.3 (the scienceworld wheel's tasks, simplification 'easy')"
        if self.games == "official":
            return f"the official ALFWorld games under {self.root}"
        return (f"ALFWorld-format games generated from the alfworld wheel's floor plans (jaxopd_envs.alfworld_gen) "
                f"under {self.root}; not the official ALFWorld splits")

    def tasks(self, split: str) -> list[Task]:
        env = self.env_factory()
        try:
            return list(env.tasks(split))
        finally:
            env.close()

    def reference_cache_of(self, kind: str) -> Path:
        """Where this source's references of ``kind`` (``jaxopd_envs.references.REFERENCE_KINDS``) are cached: beside
        the generated games, or under the jaxopd cache."""
        prefix = "references" if kind == "solution" else f"{kind.replace('_', '-')}-references"
        if self.root is not None and self.games == "generated":
            return self.root.parent / f"{prefix}-{self.root.name}"
        base = Path(os.environ.get("JAXOPD_CACHE", Path.home() / ".cache" / "jaxopd")).expanduser()
        return base / prefix / self.benchmark


def official_games_root(games: str) -> Path | None:
    """The folder of the official ALFWorld games when ``games`` selects them (``official``, or ``auto`` with
    ``$ALFWORLD_DATA`` set), else None (generated games). ``BenchmarkError`` names an unset variable or a folder that
    does not exist."""
    data = os.environ.get(ALFWORLD_DATA_ENV)
    if not (games == "official" or (games == "auto" and data)):
        return None
    if not data:
        raise BenchmarkError(f"official ALFWorld games need ${ALFWORLD_DATA_ENV} to name their folder")
    root = Path(data).expanduser()
    if not root.is_dir():
        raise BenchmarkError(f"${ALFWORLD_DATA_ENV}={data!r} is not a folder")
    return root


def resolve_source(benchmark: str, games: str = "auto", *, counts: GeneratedCounts = GeneratedCounts(),
                   cache_dir: str | os.PathLike | None = None, progress: bool = True) -> BenchmarkSource:
    """The task source of ``benchmark``. ALFWorld ``auto``: official games when ``$ALFWORLD_DATA`` is set, else
    generated ones (generated on first use and cached). ``$ALFWORLD_DATA`` set to a folder that does not exist,
    or ``official`` without it, is a ``BenchmarkError`` naming the variable."""
    if benchmark not in BENCHMARKS:
        raise BenchmarkError(f"unknown benchmark {benchmark!r}; expected one of {BENCHMARKS}")
    if games not in GAME_SOURCES:
        raise BenchmarkError(f"unknown game source {games!r}; expected one of {GAME_SOURCES}")
    if benchmark == "scienceworld":
        from jaxopd_envs.scienceworld import ScienceWorldEnv
        return BenchmarkSource("scienceworld", None, "scienceworld", ScienceWorldEnv)
    from jaxopd_envs.alfworld import AlfWorldEnv
    root = official_games_root(games)
    if root is not None:
        from jaxopd_envs.alfworld import data_dir_of
        data = os.environ.get(ALFWORLD_DATA_ENV)
        if not any(data_dir_of(root).glob("*/")):
            raise BenchmarkError(f"${ALFWORLD_DATA_ENV}={data!r} holds no ALFWorld split folders")
        return BenchmarkSource("alfworld", root, "official", functools.partial(AlfWorldEnv, root))
    root = alfworld_gen.ensure_games(cache_dir, seed=counts.seed, counts=counts.as_counts(), progress=progress)
    return BenchmarkSource("alfworld", Path(root), "generated", functools.partial(AlfWorldEnv, root))


def subset(tasks: Sequence[Task], limit: int | None, *, seed: int = 0) -> list[Task]:
    """``limit`` tasks drawn without replacement by ``seed``, returned in task-id order (all when None)."""
    tasks = sorted(tasks, key=lambda t: t.task_id)
    if limit is None or limit >= len(tasks):
        return tasks
    if limit < 1:
        raise BenchmarkError(f"a task subset needs at least 1 task, got {limit}")
    chosen = random.Random(seed).sample(range(len(tasks)), limit)
    return [tasks[i] for i in sorted(chosen)]


def references_for(source: BenchmarkSource, tasks: Sequence[Task], *, workers: int = 1, progress: bool = True,
                   kind: str = "solution", expert_max_turns: int | None = None,
                   failures: dict[str, str] | None = None) -> Mapping[str, Any]:
    """The validated reference of every task (``jaxopd_envs.references.build_references``, cached).

    ``kind="searching_expert"``: the expert's won episodes only; the tasks it did not win are left out and, when
    ``failures`` is given, listed there with the reason."""
    from jaxopd_envs.references import build_references
    return build_references(source.env_factory, tasks, source.reference_cache_of(kind), workers=workers,
                            progress=progress, kind=kind, expert_max_turns=expert_max_turns,
                            allow_failures=kind == "searching_expert", failures=failures)


def lazy_references_for(source: BenchmarkSource, tasks: Sequence[Task], *,
                        kind: str = "solution") -> LazyReferences:
    """The references of ``tasks`` as ``jaxopd_envs.references.LazyReferences``: each built (or read from the same cache
    as ``references_for``) when a run first draws its task, instead of all of them before the first update."""
    from jaxopd_envs.references import LazyReferences
    return LazyReferences(source.env_factory, tasks, source.reference_cache_of(kind), kind=kind)


__all__ = ["BENCHMARKS", "GAME_SOURCES", "TRAIN_SPLIT", "EVAL_SPLITS", "BenchmarkError", "GeneratedCounts",
           "official_games_root", "BenchmarkSource", "resolve_source", "subset", "references_for",
           "lazy_references_for"]
