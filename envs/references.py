"""Reference trajectories for reference-conditioned inverse dynamics (ActFirst-OPD Sec. 4.1, App. C.2).

Owns building one reference per training task (ALFWorld: the walkthrough; ScienceWorld: the gold path,
shortened while replay still succeeds), validating it by replay under the training environment, and
the on-disk JSON cache of its observations o_1, o_2^ref, ... from which a rollout reads o_{t+1}^ref.
The same records serve as supervised demonstrations, of either kind in ``REFERENCE_KINDS``: the environment's
own solution, or (ALFWorld) the searching expert's episode (``jaxopd_envs.alfworld_expert``) with its invalid
actions left out.
"""
from __future__ import annotations

import atexit
import concurrent.futures
import dataclasses
import hashlib
import json
import multiprocessing
import os
import pickle
import re
import threading
from collections.abc import Mapping as MappingABC
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from jaxopd_envs.base import EnvError, Observation, Task, TextEnv, require_bool, require_int
from jaxopd_envs.checks import normalize_action
from jaxopd_envs.workers import worker_init

REFERENCE_FORMAT_VERSION = 1
_FILE_SUFFIX = ".ref.json"
_FAILED_SUFFIX = ".failed.json"     # why a task has no reference (a searching expert that did not win)
# Which observation fields the App. B.5 checks read from the reference, per benchmark: ALFWorld compares
# next admissible sets (kept); ScienceWorld compares action-template sets but uses the admissible list
# (about 1,000 actions a step) only to validate the student's own action, so it is not stored.
_STORE_ADMISSIBLE = {"alfworld": True, "scienceworld": False}
_SHORTEN_BY_DEFAULT = {"alfworld": False, "scienceworld": True}
# Steps of a ScienceWorld gold path that may be no-ops (observing, waiting); never "focus on".
DROPPABLE_PREFIXES = ("look around", "look at ", "look in ", "inventory", "examine ", "read ", "wait",
                      "task")


REFERENCE_KINDS = ("solution", "searching_expert")
"""What a reference replays: ``solution`` the environment's own (walkthrough, gold path); ``searching_expert``
ALFWorld's hand-coded expert, which searches for objects from what it has seen (``jaxopd_envs.alfworld_expert``)."""


class ReferenceBuildError(RuntimeError):
    """A reference could not be built: no candidate actions, or replay did not reach success."""


@dataclasses.dataclass(frozen=True)
class ReferenceObservation:
    """What the environment showed at one point of the reference (the fields App. B.5 compares)."""

    text: str
    done: bool = False
    won: bool = False
    score: float = 0.0
    admissible_actions: tuple[str, ...] = ()
    action_templates: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # A cache file is JSON written by anyone: "done": "False" must not read as a finished episode.
        if not isinstance(self.text, str):
            raise ValueError(f"reference observation text must be a str, got {type(self.text).__name__}")
        for name in ("done", "won"):
            object.__setattr__(self, name, require_bool(getattr(self, name), f"reference observation {name!r}"))
        if isinstance(self.score, bool) or not isinstance(self.score, (int, float)):
            raise ValueError(f"reference observation 'score' must be a number, got {self.score!r}")
        object.__setattr__(self, "score", float(self.score))
        for name in ("admissible_actions", "action_templates"):
            values = getattr(self, name)
            if isinstance(values, str) or not all(isinstance(v, str) for v in values):
                raise ValueError(f"reference observation {name!r} must be a sequence of str, got {values!r}")
            object.__setattr__(self, name, tuple(values))

    @classmethod
    def from_observation(cls, obs: Observation, *, keep_admissible: bool) -> "ReferenceObservation":
        return cls(text=obs.text, done=obs.done, won=obs.won, score=float(obs.score),
                   admissible_actions=tuple(obs.admissible_actions) if keep_admissible else (),
                   action_templates=tuple(obs.action_templates))


@dataclasses.dataclass(frozen=True)
class ReferenceTrajectory:
    """A validated action sequence a_1..a_T of one task and the observations o_1..o_{T+1} of its replay.

    ``observations`` are the texts; ``records`` (same length, optional) carry done/won/score and the
    admissible actions or action templates the transition checks need.
    """

    task_id: str
    actions: tuple[str, ...]
    observations: tuple[str, ...]
    benchmark: str = ""
    task_type: str = ""
    instruction: str = ""
    records: tuple[ReferenceObservation, ...] = ()
    source: str = ""                 # "walkthrough" | "gold_path" | ...
    original_length: int = 0         # number of candidate actions before shortening
    fingerprint: str = ""            # identity of the task version the reference was built for

    def __post_init__(self) -> None:
        object.__setattr__(self, "actions", tuple(self.actions))
        object.__setattr__(self, "observations", tuple(self.observations))
        object.__setattr__(self, "records", tuple(self.records))
        if len(self.observations) != len(self.actions) + 1:
            raise ValueError(f"reference {self.task_id}: {len(self.actions)} actions need "
                             f"{len(self.actions) + 1} observations, got {len(self.observations)}")
        if self.records and [r.text for r in self.records] != list(self.observations):
            raise ValueError(f"reference {self.task_id}: records do not match the observations")

    def __len__(self) -> int:
        return len(self.actions)

    def next_observation(self, t: int) -> str | None:
        """o_{t+1}^ref for turn t (1-based as in the paper: at turn t the agent sees o_t and acts a_t).

        For a live ``Observation`` ``obs`` the turn is ``obs.turn + 1``. None once the reference is
        exhausted (t > T): the rollout then continues without reference guidance.
        """
        record = self._index(t)
        return None if record is None else self.observations[record]

    def next_record(self, t: int) -> ReferenceObservation | None:
        """The full reference outcome of turn t (text, done, admissible actions, templates), or None."""
        record = self._index(t)
        if record is None:
            return None
        if not self.records:
            raise ValueError(f"reference {self.task_id} was stored without observation records")
        return self.records[record]

    def action(self, t: int) -> str | None:
        """a_t^ref (used internally by checks, never shown to the student), or None past the end."""
        return None if self._index(t) is None else self.actions[t - 1]

    def _index(self, t: int) -> int | None:
        t = require_int(t, "turn", minimum=1)              # paper indexing: the first turn is 1
        return t if t <= len(self.actions) else None

    # -- JSON
    def to_json(self) -> dict[str, Any]:
        return {"format": REFERENCE_FORMAT_VERSION, "task_id": self.task_id, "benchmark": self.benchmark,
                "task_type": self.task_type, "instruction": self.instruction, "source": self.source,
                "original_length": self.original_length, "fingerprint": self.fingerprint,
                "actions": list(self.actions), "observations": list(self.observations),
                "records": [dataclasses.asdict(r) for r in self.records]}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "ReferenceTrajectory":
        if data.get("format") != REFERENCE_FORMAT_VERSION:
            raise ValueError(f"reference format {data.get('format')!r} is not {REFERENCE_FORMAT_VERSION}")
        records = tuple(ReferenceObservation(text=r["text"], done=r["done"], won=r["won"], score=r["score"],
                                             admissible_actions=tuple(r["admissible_actions"]),
                                             action_templates=tuple(r["action_templates"]))
                        for r in data.get("records", ()))
        return cls(task_id=data["task_id"], actions=tuple(data["actions"]),
                   observations=tuple(data["observations"]), benchmark=data.get("benchmark", ""),
                   task_type=data.get("task_type", ""), instruction=data.get("instruction", ""),
                   records=records, source=data.get("source", ""),
                   original_length=int(data.get("original_length", 0)), fingerprint=data.get("fingerprint", ""))


# --------------------------------------------------------------------------------------------- replay


@dataclasses.dataclass(frozen=True)
class Replay:
    """Observations of a replay, cut at the first success; ``succeeded`` says whether it was reached."""

    actions: tuple[str, ...]
    observations: tuple[Observation, ...]
    succeeded: bool
    invalid_turns: tuple[int, ...]       # 1-based turns whose action was not valid


def replay(env: TextEnv, task: Task, actions: Sequence[str]) -> Replay:
    """Reset ``task`` and execute ``actions``; stops at the first won observation or when done."""
    obs = env.reset(task)
    observations, executed, invalid = [obs], [], []
    if obs.won:
        return Replay((), (obs,), True, ())
    for action in actions:
        if obs.done:
            break
        obs = env.step(action)
        executed.append(action)
        observations.append(obs)
        if not obs.last_action_valid:
            invalid.append(len(executed))
        if obs.won:
            break
    return Replay(tuple(executed), tuple(observations), bool(obs.won), tuple(invalid))


def is_droppable(action: str) -> bool:
    """Whether a ScienceWorld gold-path step is worth trying to drop (observations and waits)."""
    text = normalize_action(action)
    return not text.startswith("focus") and text.startswith(DROPPABLE_PREFIXES)


def shorten_actions(env: TextEnv, task: Task, actions: Sequence[str], *,
                    droppable: Callable[[str], bool] = is_droppable, max_trials: int | None = 32) -> Replay:
    """Drop steps while replay still succeeds; returns the successful replay of the shortest sequence.

    Candidates are the steps ``droppable`` accepts plus every step that was invalid in replay ("The door
    is already open"); "focus on" steps are never dropped. First all candidates are dropped at once; if
    that fails, one at a time, first to last (early observation steps are the likeliest no-ops; late
    ones often let time pass for a process to finish), keeping each drop whose replay succeeds, for at
    most ``max_trials`` replays: each trial replays the whole episode, as ScienceWorld has no state
    snapshots. A successful replay may end earlier than its actions: the tail after success is cut too.
    """
    best = replay(env, task, actions)
    if not best.succeeded:
        raise ReferenceBuildError(f"{task.task_id}: the candidate actions do not reach success")
    invalid = set(best.invalid_turns)
    # steps keep their position in ``best`` as identity while others are dropped around them
    kept = list(range(len(best.actions)))
    drop = [i for i in kept if not normalize_action(best.actions[i]).startswith("focus")
            and (droppable(best.actions[i]) or i + 1 in invalid)]
    if not drop:
        return best
    steps = best.actions
    everything = replay(env, task, [steps[i] for i in kept if i not in set(drop)])
    trials = 1
    if everything.succeeded:
        return everything
    for index in drop:
        if max_trials is not None and trials >= max_trials:
            break
        if index not in kept:                  # cut off with the tail of an earlier, shorter success
            continue
        trial_kept = [i for i in kept if i != index]
        trial = replay(env, task, [steps[i] for i in trial_kept])
        trials += 1
        if trial.succeeded:
            best, kept = trial, trial_kept[:len(trial.actions)]
    return best


# ---------------------------------------------------------------------------------------------- build


def check_kind(kind: str) -> str:
    if kind not in REFERENCE_KINDS:
        raise ValueError(f"unknown reference kind {kind!r}; expected one of {REFERENCE_KINDS}")
    return kind


def candidate_actions(env: TextEnv, task: Task, *, kind: str = "solution",
                      expert_max_turns: int | None = None) -> tuple[list[str], str]:
    """The actions a reference of ``kind`` replays, and their source's name.

    ``solution``: the environment's own solution of ``task`` (ALFWorld's walkthrough, ScienceWorld's gold
    path). ``searching_expert``: the expert's episode within ``expert_max_turns`` actions (None: the expert's
    default; ``env.searching_expert_actions``, ALFWorld only); a game the expert does not win is a
    ``ReferenceBuildError`` naming why.
    """
    if check_kind(kind) == "searching_expert":
        if not hasattr(env, "searching_expert_actions"):
            raise ValueError(f"{type(env).__name__} has no searching expert (ALFWorld only)")
        episode = env.searching_expert_actions(task, max_turns=expert_max_turns)
        if not episode.won:
            raise ReferenceBuildError(f"{task.task_id}: the searching expert did not win ({episode.reason})")
        return list(episode.actions), "searching_expert"
    if hasattr(env, "walkthrough"):
        return list(env.walkthrough(task)), "walkthrough"
    if hasattr(env, "gold_actions"):
        return list(env.gold_actions(task)), "gold_path"
    raise ValueError(f"{type(env).__name__} offers no walkthrough or gold path for references")


def task_fingerprint(task: Task, *, shorten: bool, max_trials: int | None = None, kind: str = "solution",
                     expert_max_turns: int | None = None) -> str:
    """Everything a reference depends on: the task, its game file's bytes, engine versions, options."""
    payload = dict(task.payload)
    game_file = payload.pop("game_file", None)      # the game's bytes count, not where the tree lives
    key: dict[str, Any] = {"format": REFERENCE_FORMAT_VERSION, "task_id": task.task_id,
                           "benchmark": task.benchmark, "shorten": shorten,
                           "max_trials": max_trials if shorten else None,
                           "payload": json.loads(json.dumps(payload, sort_keys=True, default=str))}
    if check_kind(kind) != "solution":          # solution references keep the fingerprints they always had
        key["kind"], key["expert_max_turns"] = kind, expert_max_turns
    if game_file:
        if not os.path.isfile(game_file):
            raise ValueError(f"task {task.task_id}: game file {game_file!r} does not exist")
        key["game_sha256"] = hashlib.sha256(Path(game_file).read_bytes()).hexdigest()
    key["packages"] = {name: _package_version(name) for name in ("alfworld", "textworld", "scienceworld")}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def _shortens_by_default(task: Task, kind: str) -> bool:
    """ScienceWorld's gold paths are shortened unless told otherwise; nothing else is."""
    return _SHORTEN_BY_DEFAULT.get(task.benchmark, False) and kind == "solution"


def build_reference(env: TextEnv, task: Task, *, shorten: bool | None = None,
                    droppable: Callable[[str], bool] = is_droppable, max_trials: int | None = 32,
                    kind: str = "solution", expert_max_turns: int | None = None) -> ReferenceTrajectory:
    """Build and validate the reference of one task: its candidate actions of ``kind`` (shortened when
    ``shorten``, by default for ScienceWorld solutions) replayed to success; the replay's observations are the
    reference's. A searching expert's actions that the environment refused ("Nothing happens": they change
    nothing) are left out, and the rest must still win on replay."""
    if shorten is None:
        shorten = _shortens_by_default(task, kind)
    candidates, source = candidate_actions(env, task, kind=kind, expert_max_turns=expert_max_turns)
    if not candidates:
        raise ReferenceBuildError(f"{task.task_id}: the environment gave no {source}")
    if shorten:
        final = shorten_actions(env, task, candidates, droppable=droppable, max_trials=max_trials)
    else:
        final = replay(env, task, candidates)
        if kind == "searching_expert" and final.invalid_turns:
            refused = set(final.invalid_turns)
            final = replay(env, task, [a for t, a in enumerate(final.actions, start=1) if t not in refused])
    if not final.succeeded:
        raise ReferenceBuildError(f"{task.task_id}: replay of the {source} ({len(candidates)} actions) did "
                                  f"not reach success (score {final.observations[-1].score})")
    keep_admissible = _STORE_ADMISSIBLE.get(task.benchmark, True)
    records = tuple(ReferenceObservation.from_observation(o, keep_admissible=keep_admissible)
                    for o in final.observations)
    return ReferenceTrajectory(task_id=task.task_id, actions=final.actions,
                               observations=tuple(r.text for r in records), benchmark=task.benchmark,
                               task_type=task.task_type, instruction=final.observations[0].instruction,
                               records=records, source=source, original_length=len(candidates),
                               fingerprint=task_fingerprint(task, shorten=shorten, max_trials=max_trials, kind=kind,
                                                            expert_max_turns=expert_max_turns))


def reference_path(cache_dir: str | os.PathLike, task_id: str) -> Path:
    """The cache file of a task: a readable form of its id plus a short hash (ids contain '/')."""
    readable = re.sub(r"[^A-Za-z0-9._-]+", "__", task_id)[:180]
    digest = hashlib.sha256(task_id.encode()).hexdigest()[:10]
    return Path(cache_dir) / f"{readable}.{digest}{_FILE_SUFFIX}"


def save_reference(cache_dir: str | os.PathLike, reference: ReferenceTrajectory) -> Path:
    path = reference_path(cache_dir, reference.task_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(reference.to_json(), ensure_ascii=False))
    tmp.replace(path)
    return path


def load_reference(path: str | os.PathLike) -> ReferenceTrajectory:
    try:
        return ReferenceTrajectory.from_json(json.loads(Path(path).read_text()))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"unreadable reference file {str(path)!r}: {exc}") from exc


def load_references(cache_dir: str | os.PathLike, *, benchmark: str | None = None) -> dict[str, ReferenceTrajectory]:
    """Every cached reference under ``cache_dir`` (optionally of one benchmark), keyed by task id."""
    cache_dir = Path(cache_dir)
    if not cache_dir.is_dir():
        raise ValueError(f"reference cache {str(cache_dir)!r} does not exist")
    references = {}
    for path in sorted(cache_dir.glob(f"*{_FILE_SUFFIX}")):
        reference = load_reference(path)
        if benchmark is None or reference.benchmark == benchmark:
            references[reference.task_id] = reference
    return references


@dataclasses.dataclass(frozen=True)
class _Options:
    """How ``build_references`` builds each reference (one picklable value for its worker processes)."""

    shorten: bool | None
    max_trials: int | None
    kind: str = "solution"
    expert_max_turns: int | None = None

    def fingerprint(self, task: Task) -> str:
        shorten = _shortens_by_default(task, self.kind) if self.shorten is None else self.shorten
        return task_fingerprint(task, shorten=shorten, max_trials=self.max_trials, kind=self.kind,
                                expert_max_turns=self.expert_max_turns)


def _cached(cache_dir: Path, task_id: str, fingerprint: str) -> ReferenceTrajectory | None:
    path = reference_path(cache_dir, task_id)
    if not path.is_file():
        return None
    reference = load_reference(path)
    return reference if reference.fingerprint == fingerprint else None


_WORKER_ENV: TextEnv | None = None


def _init_worker(env_factory: Callable[[], TextEnv], parent: int | None = None) -> None:
    global _WORKER_ENV
    worker_init(parent)         # exits with the parent
    _WORKER_ENV = env_factory()
    atexit.register(_WORKER_ENV.close)


def _failure_path(cache_dir: str | os.PathLike, task_id: str) -> Path:
    path = reference_path(cache_dir, task_id)
    return path.with_name(path.name[:-len(_FILE_SUFFIX)] + _FAILED_SUFFIX)


def _cached_failure(cache_dir: Path, task_id: str, fingerprint: str) -> str | None:
    """The reason a reference with this fingerprint could not be built, when that was recorded (an engine error
    is never recorded: it may pass)."""
    path = _failure_path(cache_dir, task_id)
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("fingerprint") != fingerprint:
        return None
    return str(record.get("reason", "failed"))


def _build_and_save(env: TextEnv, task: Task, cache_dir: str, options: _Options) -> tuple[str, str | None]:
    failure = _failure_path(cache_dir, task.task_id)
    try:
        save_reference(cache_dir, build_reference(env, task, shorten=options.shorten, max_trials=options.max_trials,
                                                  kind=options.kind, expert_max_turns=options.expert_max_turns))
        failure.unlink(missing_ok=True)
        return task.task_id, None
    except ReferenceBuildError as exc:
        reason = f"{type(exc).__name__}: {exc}"
        tmp = failure.with_name(f".{failure.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps({"task_id": task.task_id, "fingerprint": options.fingerprint(task),
                                   "reason": reason}))
        tmp.replace(failure)
        return task.task_id, reason
    except EnvError as exc:
        return task.task_id, f"{type(exc).__name__}: {exc}"


def _worker_build(task: Task, cache_dir: str, options: _Options) -> tuple[str, str | None]:
    return _build_and_save(_WORKER_ENV, task, cache_dir, options)


def build_references(env_factory: Callable[[], TextEnv], tasks: Iterable[Task], cache_dir: str | os.PathLike,
                     *, shorten: bool | None = None, max_trials: int | None = 32, workers: int = 1,
                     rebuild: bool = False, progress: bool = False, kind: str = "solution",
                     expert_max_turns: int | None = None, allow_failures: bool = False,
                     failures: dict[str, str] | None = None) -> dict[str, ReferenceTrajectory]:
    """Build (or reuse from ``cache_dir``) the validated reference of every task.

    ``shorten`` (default: ScienceWorld solutions only), ``max_trials``, ``kind`` and ``expert_max_turns`` are
    passed to ``build_reference``. A cached reference is reused when its fingerprint (task, game file bytes,
    engine versions, options) matches. ``workers > 1`` builds in that many processes, each with its own
    environment from ``env_factory`` (which must then be picklable, e.g. a class or ``functools.partial``).
    Raises ``ReferenceBuildError`` naming every task whose reference failed, after saving the others; with
    ``allow_failures`` (a searching expert does not win every game) those tasks are left out of the result
    instead, and ``failures``, when given, receives each one's reason by task id.
    """
    tasks = list(tasks)
    if not tasks:
        raise ValueError("no tasks to build references for")
    if len({t.task_id for t in tasks}) != len(tasks):
        raise ValueError("duplicate task ids in the tasks to build references for")
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)

    options = _Options(shorten, max_trials, check_kind(kind), expert_max_turns)
    fingerprints = {t.task_id: options.fingerprint(t) for t in tasks}   # each hashes the task's game file
    todo: list[Task] = []
    errors: list[tuple[str, str | None]] = []          # (task id, why it has no reference, or None)
    for task in tasks:
        if rebuild:
            todo.append(task)
        elif _cached(cache_dir, task.task_id, fingerprints[task.task_id]) is None:
            reason = _cached_failure(cache_dir, task.task_id, fingerprints[task.task_id])
            if reason is None:
                todo.append(task)
            else:
                errors.append((task.task_id, reason))
    if todo:
        bar = None
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=len(todo), desc="references", unit="task")
        workers = min(workers, len(todo))
        if workers == 1:
            env = env_factory()
            try:
                for task in todo:
                    errors.append(_build_and_save(env, task, str(cache_dir), options))
                    if bar is not None:
                        bar.update(1)
            finally:
                env.close()
        else:
            try:
                pickle.dumps(env_factory)
            except Exception as exc:
                raise ValueError(f"workers > 1 needs a picklable env_factory: {exc}") from exc
            context = multiprocessing.get_context("spawn")   # fork is unsafe under JAX and JVM threads
            with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context, initializer=_init_worker,
                                                        initargs=(env_factory, os.getpid())) as pool:
                futures = [pool.submit(_worker_build, task, str(cache_dir), options) for task in todo]
                for future in concurrent.futures.as_completed(futures):
                    errors.append(future.result())
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
    errors = [(task_id, error) for task_id, error in errors if error is not None]
    if errors and not allow_failures:
        raise ReferenceBuildError(f"{len(errors)} of {len(tasks)} references failed: "
                                  + "; ".join(f"{task_id}: {error}" for task_id, error in sorted(errors)))
    if failures is not None:
        failures.update(errors)
    failed = {task_id for task_id, _ in errors}
    references = {}
    for task in tasks:
        if task.task_id in failed:
            continue
        reference = _cached(cache_dir, task.task_id, fingerprints[task.task_id])
        if reference is None:
            raise ReferenceBuildError(f"{task.task_id}: reference missing from {str(cache_dir)!r} after building")
        references[task.task_id] = reference
    return references


class LazyReferences(MappingABC):
    """The references of ``tasks``, each built (or read from ``cache_dir``) when first asked for: a training run
    draws a few of a split's tasks, and ScienceWorld's train split has 2,300, whose shortened gold paths take tens
    of seconds each to replay, so building every one before the first update would take many hours.

    A read-only mapping from task id to ``ReferenceTrajectory`` (the same records and cache as
    ``build_references`` with the same options). Safe to use from several threads: cached references are read
    concurrently, builds run one at a time in one environment of its own (made from ``env_factory`` on the first
    build; ``close()`` closes it). A task whose reference cannot be built raises ``ReferenceBuildError`` naming it
    (a recorded failure is not retried); an environment error raises it too, and the next build starts a fresh
    environment. ``built`` counts the references built here, ``read`` those found in the cache."""

    def __init__(self, env_factory: Callable[[], TextEnv], tasks: Iterable[Task], cache_dir: str | os.PathLike, *,
                 shorten: bool | None = None, max_trials: int | None = 32, kind: str = "solution",
                 expert_max_turns: int | None = None):
        self._tasks = {task.task_id: task for task in tasks}
        self._env_factory = env_factory
        self._cache_dir = Path(cache_dir)
        self._cache_dir.mkdir(parents=True, exist_ok=True)
        self._options = _Options(shorten, max_trials, check_kind(kind), expert_max_turns)
        self._memo: dict[str, ReferenceTrajectory] = {}
        self._building: set[str] = set()        # task ids whose build is under way (their cache file may be new)
        self._lock = threading.Lock()           # the memo and the set above
        self._build_lock = threading.Lock()     # the environment, one build at a time
        self._env: TextEnv | None = None
        self.built = 0
        self.read = 0

    def __len__(self) -> int:
        return len(self._tasks)

    def __iter__(self):
        return iter(self._tasks)

    def __contains__(self, task_id: object) -> bool:
        return task_id in self._tasks

    def __getitem__(self, task_id: str) -> ReferenceTrajectory:
        task = self._tasks[task_id]                      # KeyError: not one of this run's tasks
        with self._lock:
            if task_id in self._memo:
                return self._memo[task_id]
        fingerprint = self._options.fingerprint(task)
        reference = _cached(self._cache_dir, task_id, fingerprint)
        if reference is not None:
            with self._lock:
                if task_id in self._memo:
                    return self._memo[task_id]
                if task_id not in self._building:       # else: a file another thread is building right now; wait
                    self._memo[task_id] = reference
                    self.read += 1
                    return reference
        with self._build_lock:
            with self._lock:
                if task_id in self._memo:                # built by another thread meanwhile
                    return self._memo[task_id]
                self._building.add(task_id)
            try:
                return self._build(task, fingerprint)
            finally:
                with self._lock:
                    self._building.discard(task_id)

    def _build(self, task: Task, fingerprint: str) -> ReferenceTrajectory:
        """Build ``task``'s reference (the caller holds the build lock) and remember it as built here."""
        task_id = task.task_id
        reason = _cached_failure(self._cache_dir, task_id, fingerprint)
        if reason is None:
            if self._env is None:
                self._env = self._env_factory()
            _, reason = _build_and_save(self._env, task, str(self._cache_dir), self._options)
            if reason is not None and _cached_failure(self._cache_dir, task_id, fingerprint) is None:
                self._close_env()      # an engine error (not recorded): the environment may be unusable
        if reason is not None:
            raise ReferenceBuildError(f"no reference for {task_id}: {reason}")
        reference = _cached(self._cache_dir, task_id, fingerprint)
        if reference is None:
            raise ReferenceBuildError(f"{task_id}: reference missing from {str(self._cache_dir)!r} after building")
        with self._lock:
            self._memo[task_id] = reference
            self.built += 1
            return reference

    def _close_env(self) -> None:
        env, self._env = self._env, None
        if env is not None:
            env.close()

    def close(self) -> None:
        """Close the environment used for building (a later build makes a new one)."""
        with self._build_lock:
            self._close_env()


def _package_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "absent"
