"""Environment chaos: a rollout of real ALFWorld and ScienceWorld episodes while a chaos thread kills ScienceWorld
JVMs and makes ALFWorld steps raise (and, once, hang past the pool's timeout).

What it runs: ``--episodes`` tasks (half ALFWorld games generated from the alfworld wheel's floor plans by
``jaxopd_envs.alfworld_gen``, not the official ALFWorld splits; half ScienceWorld 1.2.3 train tasks, simplification
"easy") through a real ``VanillaStrategy`` and ``RolloutStrategy.play`` on one ``jaxopd_envs.pool.EnvPool`` ("thread"
backend) whose slots each hold a ``ChaosEnv``: a real ``AlfWorldEnv`` and a real ``ScienceWorldEnv`` (its own
JVM), each task played by its benchmark's environment. The generation engine is ``ScriptedAgentEngine``: no
model; it reads the rendered prompt and picks, from the request's seed, an admissible ALFWorld action or a
ScienceWorld action (a teleport, "look around", or a safe template applied to a common object the observation
names); it is deterministic, so the same task and seed give the same actions, hence the same observations.

The faults, at seeded random moments from a chaos thread (exponential gaps, ``--mean-gap``):
``jvm_kill``: SIGKILL of the JVM of a ScienceWorld environment that is in an episode (checked to be a java child
of this process); ``ScienceWorldEnv`` restarts it and replays the episode. ``alfworld_raise``: armed at a moment an
ALFWorld episode is under way, the next ALFWorld step of any environment raises ``RuntimeError``, before or after
the engine executed it; the pool discards the environment, rebuilds it and replays the episode; besides, one raise
is scheduled at a seeded ALFWorld step (counted over all environments) in case the thread found no moment for one.
``hang``: the ALFWorld step of a seeded number (counted the same way) sleeps past the pool's ``call_timeout_s``; the
pool abandons it, rebuilds and replays. The scheduled faults do not depend on how fast the machine plays: on CI's
machine a hang armed by the thread at a moment met no ALFWorld step after it, twice.

What it checks (``ChaosReport.checks``): exactly one outcome per task, in task order, none duplicated; every
completed trajectory equal to a fault-free run of the same task and seed (same actions, responses, end reason,
and observations equal in the benchmark's normal form, with the same flags, score and admissible actions; for
ScienceWorld the action templates only: it names objects that share a name differently from one reset to the
next, in its object list and its valid combinations, even without faults); every failed episode
reported with a reason; the pool's recoveries explained by the faults its environments raised; and after
``pool.close()`` no thread started by the two runs and no JVM child process left (counted with psutil and
``threading.enumerate()``, with a short wait).

    python -m bench.env_chaos [--episodes 32] [--seed 0] [--out results/reliability]
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import json
import logging
import os
import random
import re
import signal
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run as a script from anywhere

from bench.common import write_result  # noqa: E402

from jaxopd_envs.base import Observation, Task, TextEnv  # noqa: E402
from jaxopd_envs.checks import observation_texts_equivalent  # noqa: E402
from jaxopd_envs.pool import EnvPool  # noqa: E402
from jaxopd.rollout.strategies import RolloutConfig, VanillaStrategy  # noqa: E402
from jaxopd.rollout.trajectory import EpisodeOutcome, Trajectory  # noqa: E402
from jaxopd.sampler.types import Request, Result, Timings  # noqa: E402

logger = logging.getLogger(__name__)

__all__ = ["FAULT_KINDS", "ChaosEnv", "ChaosMonkey", "ChaosReport", "ScriptedAgentEngine", "choose_action",
           "chaos_tasks", "compare_trajectories", "java_children", "run_env_chaos", "main"]

FAULT_KINDS = ("jvm_kill", "alfworld_raise", "hang")
DEFAULT_WEIGHTS = {"jvm_kill": 0.5, "alfworld_raise": 0.5}      # the hang: at a seeded ALFWorld step
SCIENCEWORLD_TYPES = ("boil", "melt", "freeze", "change-the-state-of-matter-of", "find-living-thing",
                      "find-non-living-thing", "find-plant", "find-animal")
_ROOMS = ("art studio", "bathroom", "bedroom", "foundry", "greenhouse", "hallway", "kitchen", "living room",
          "outside", "workshop")
# Common ScienceWorld objects the scripted agent refers to when the observation names them
_NOUNS = ("bed", "book", "chair", "counter", "cup", "cupboard", "desk", "door", "drawer", "fireplace", "flower",
          "freezer", "fridge", "lighter", "oven", "painting", "pot", "seed", "shelf", "sink", "soap", "stove",
          "table", "thermometer", "toilet", "water")
# ScienceWorld templates the scripted agent uses: none ends or resets the task ("focus on" a wrong object fails it)
_SAFE_TEMPLATES = ("look at OBJ", "look in OBJ", "open OBJ", "close OBJ", "pick up OBJ", "activate OBJ",
                   "deactivate OBJ")


# ------------------------------------------------------------------------------------------------ scripted agent
def _section(text: str, header: str, end: str = "\n\n") -> list[str] | None:
    start = text.rfind(header)
    if start < 0:
        return None
    body = text[start + len(header):]
    stop = body.find(end)
    return [line.strip() for line in (body if stop < 0 else body[:stop]).split("\n") if line.strip()]


def choose_action(prompt_text: str, seed: int) -> str:
    """A plausible action for the prompt's current state, a function of the state and ``seed`` only.

    ALFWorld: one of the listed admissible actions. ScienceWorld: "look around", "inventory", "wait1", a teleport
    to a room, or a safe template ("look at OBJ", "open OBJ", ...) applied to a common object named in the current
    observation. Not the listed objects: ScienceWorld names ambiguous objects differently from one reset (or JVM
    restart) to the next, while its observation is the same up to the order of its lines and enumerations."""
    admissible = _section(prompt_text, "Admissible actions in the current situation:\n")
    if admissible:
        candidates = sorted(admissible)
    else:
        start = prompt_text.rfind("Current observation:\n")
        end = prompt_text.find("Action templates (", start)
        words = set(re.findall(r"[a-z]+", prompt_text[start:end].lower())) if start >= 0 else set()
        nouns = [noun for noun in _NOUNS if noun in words]
        candidates = ["look around", "inventory", "wait1"] + [f"teleport to {room}" for room in _ROOMS]
        candidates += [template.replace("OBJ", noun) for template in _SAFE_TEMPLATES for noun in nouns]
    return candidates[random.Random(seed).randrange(len(candidates))]


class ScriptedAgentEngine:
    """``submit(Request) -> Future[Result]`` without a model: a think-then-act answer whose action
    ``choose_action`` picks from the decoded prompt and the request's seed; every token at log-probability -1."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.requests = 0
        self._lock = threading.Lock()

    def submit(self, request: Request) -> Future:
        action = choose_action(self.tokenizer.decode(request.prompt_ids), int(request.params.seed or 0))
        ids = self.tokenizer.encode(f"<think>\nI will try: {action}.\n</think>\n\n<action>{action}</action>")
        ids = ids[:request.params.max_new_tokens]
        now = time.perf_counter()
        with self._lock:
            self.requests += 1
        future: Future = Future()
        future.set_result(Result(request_id=request.request_id, kind=request.kind,
                                 prompt_ids=tuple(request.prompt_ids), token_ids=list(ids),
                                 text=self.tokenizer.decode(ids), logprobs=np.full(len(ids), -1.0, np.float32),
                                 finish_reason="stop", timings=Timings(now, now, now, now)))
        return future


# ------------------------------------------------------------------------------------------------ processes
def java_children() -> list[dict[str, Any]]:
    """The java processes below this one (pid, status), zombies included."""
    import psutil

    found = []
    for process in psutil.Process().children(recursive=True):
        try:
            if process.name() == "java" or "java" in os.path.basename((process.cmdline() or [""])[0]):
                found.append({"pid": process.pid, "status": process.status()})
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def _is_java_child(pid: int) -> bool:
    return any(child["pid"] == pid and child["status"] != "zombie" for child in java_children())


# ------------------------------------------------------------------------------------------------ the environment
class ChaosEnv(TextEnv):
    """One pool slot's environments: an ALFWorld one and a ScienceWorld one (each built on first use); a task is
    played by its benchmark's environment. Every call is reported to the ``ChaosMonkey``, which may arm the next
    ALFWorld step with a fault (``alfworld_raise``, ``hang``) or kill the ScienceWorld JVM."""

    def __init__(self, monkey: "ChaosMonkey", factories: dict[str, Callable[[], TextEnv]]):
        self.monkey = monkey
        self.factories = factories
        self.envs: dict[str, TextEnv] = {}
        self.current: str | None = None          # the benchmark of the episode in progress
        self.task_id: str | None = None
        self.in_episode = False
        self.pending_kills = 0                   # kills of the current JVM no call has noticed yet
        self.in_flight = 0                       # calls running now
        self.closed = False
        self.lock = threading.Lock()             # guards pending_kills / closed against the chaos thread
        self.uid = monkey.register(self)

    @property
    def benchmark(self) -> str:          # the pool compares a replay in the normal form of this benchmark
        return self.current or "mixed"

    def tasks(self, split: str) -> Sequence[Task]:
        return ()

    def _env(self, benchmark: str) -> TextEnv:
        if benchmark not in self.factories:
            raise ValueError(f"ChaosEnv plays {sorted(self.factories)} tasks, not {benchmark!r}")
        if benchmark not in self.envs:
            self.envs[benchmark] = self.factories[benchmark]()
        return self.envs[benchmark]

    @property
    def scienceworld(self) -> Any:
        return self.envs.get("scienceworld")

    def reset(self, task: Task) -> Observation:
        def run() -> Observation:
            env = self._env(task.benchmark)
            self.current, self.task_id, self.in_episode = task.benchmark, task.task_id, False
            return self._restarts_noted(env, lambda: env.reset(task))

        return self._call(run)

    def step(self, action: str) -> Observation:
        if self.current is None:
            raise ValueError("step() before reset()")

        def run() -> Observation:
            env = self.envs[self.current]
            if self.current == "alfworld":
                fault = self.monkey.take_armed()
                if fault is not None:
                    self.monkey.trigger(self, fault, lambda: env.step(action))
            return self._restarts_noted(env, lambda: env.step(action))

        return self._call(run)

    def _restarts_noted(self, env: TextEnv, call: Callable[[], Observation]) -> Observation:
        science = env if env is self.scienceworld else None
        restarts = science.restarts if science is not None else 0
        try:
            return call()
        finally:
            if science is not None:
                self.monkey.note_restarts(self, science.restarts - restarts)

    def _call(self, run: Callable[[], Observation]) -> Observation:
        """One pool call: counted in flight (a close during it means the pool gave up on it), its exception
        reported to the monkey (each one makes the pool rebuild this environment)."""
        with self.lock:
            self.in_flight += 1
        try:
            observation = run()
        except ValueError:
            raise                                 # bad input: the pool keeps the environment
        except Exception as error:
            self.monkey.note_error(self, error)
            raise
        finally:
            with self.lock:
                self.in_flight -= 1
        self.in_episode = not observation.done
        return observation

    def close(self) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
            abandoned = self.in_flight > 0        # the pool timed a call out and discards the environment
        self.monkey.note_closed(self, abandoned)
        for env in self.envs.values():
            try:
                env.close()
            except Exception:  # noqa: BLE001 - a broken environment may fail to close
                logger.warning("closing a ChaosEnv part failed", exc_info=True)


class _InjectedFault(RuntimeError):
    """Raised by an ALFWorld step the chaos thread armed."""


class _LateHang(RuntimeError):
    """A hung step waking up after the pool gave up on it (nobody receives it)."""


@dataclasses.dataclass
class Fault:
    kind: str
    at_s: float
    task_id: str | None
    env: int
    detail: str = ""


class ChaosMonkey:
    """Registers every ``ChaosEnv``, injects faults into them from its own thread at random (seeded) moments,
    and keeps the accounts: faults injected per kind, the faults and errors each task met, JVM kills noticed."""

    def __init__(self, seed: int, *, mean_gap_s: float = 3.0, weights: dict[str, float] | None = None,
                 hang_s: float | None = None, hang_steps: tuple[int, int] = (4, 16),
                 raise_steps: tuple[int, int] = (20, 40), min_per_kind: int = 2):
        self.rng = random.Random(seed)
        self.min_per_kind = min_per_kind
        self.mean_gap_s = mean_gap_s
        self.weights = dict(weights or DEFAULT_WEIGHTS)
        self.hang_s = hang_s
        # scheduled by ALFWorld step number (over all environments, replays included), whatever the machine's speed:
        # the hang (when ``hang_s`` is set), and one raise unless the thread armed one before
        self.hang_at_step = self.rng.randint(*hang_steps)
        self.raise_at_step = self.rng.randint(*raise_steps)
        self.alfworld_steps = 0           # ALFWorld steps begun under the chaos
        self.hang_taken = False
        self.raise_taken = False          # an ALFWorld step took a raise (the scheduled one is then not needed)
        self.envs: list[ChaosEnv] = []
        self.faults: list[Fault] = []
        self.events: list[tuple] = []     # (seconds, env, what, ...): errors, restarts, closes, for the record
        self.met: dict[str, list[str]] = collections.defaultdict(list)     # task id -> faults/errors met
        self.errors_raised = 0            # exceptions that left a ChaosEnv call (each makes the pool rebuild)
        self.kills_noticed = 0
        self.kills_unnoticed = 0          # the environment was closed before any call met the dead JVM
        self.jvm_restarts = 0
        self.abandoned_calls = 0          # calls the pool timed out (the environment was closed during them)
        self.late_results = 0             # abandoned calls that ended later (ignored, as the pool ignores them)
        self.armed: str | None = None     # the ALFWorld fault armed: the next ALFWorld step of any environment runs it
        self.armed_unused = 0             # still armed when the chaos stopped (no ALFWorld step came after)
        self.skipped = 0                  # moments with no eligible target
        self.jvm_peak = 0
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._start = time.perf_counter()

    # -- bookkeeping called by the environments
    def register(self, env: ChaosEnv) -> int:
        with self._lock:
            self.envs.append(env)
            return len(self.envs) - 1

    def _fault(self, kind: str, env: ChaosEnv, detail: str = "") -> None:
        with self._lock:
            self.faults.append(Fault(kind, round(self._elapsed(), 3), env.task_id, env.uid, detail))
            if env.task_id is not None:
                self.met[env.task_id].append(kind)

    def trigger(self, env: ChaosEnv, fault: str, run_step: Callable[[], Observation]) -> None:
        """Run an armed ALFWorld fault inside the step (it never returns normally)."""
        if fault == "hang":
            self._fault("hang", env, f"sleeps {self.hang_s:g} s")
            time.sleep(self.hang_s)
            raise _LateHang("chaos: a hung ALFWorld step woke up after the pool gave up on it")
        when = "after" if fault == "alfworld_raise_after" else "before"
        if when == "after":
            run_step()                            # the engine's state moves on; the pool must not trust it
        self._fault("alfworld_raise", env, f"raised {when} the engine step")
        raise _InjectedFault(f"chaos: injected ALFWorld step fault ({when} the engine step)")

    def take_armed(self) -> str | None:
        """The fault an ALFWorld step is about to run, if any (each runs once): the scheduled hang or raise when
        this step has its number, else the fault the thread armed.

        Armed faults wait for the next ALFWorld step of whichever environment takes one, not of the environment
        in episode when it was armed: that one may be at its turn cap and play only ScienceWorld tasks after it."""
        with self._lock:
            self.alfworld_steps += 1
            if self.hang_s is not None and not self.hang_taken and self.alfworld_steps >= self.hang_at_step:
                self.hang_taken = True
                return "hang"
            if self.armed is None and not self.raise_taken and self.alfworld_steps >= self.raise_at_step:
                self.armed = self.rng.choice(("alfworld_raise_before", "alfworld_raise_after"))
            fault, self.armed = self.armed, None
            self.raise_taken |= fault is not None
            return fault

    def note_error(self, env: ChaosEnv, error: BaseException) -> None:
        if env.closed or isinstance(error, _LateHang):
            with self._lock:
                self.late_results += 1            # a call the pool gave up on ended: nobody receives it
            return
        with self._lock:
            self.errors_raised += 1
            if not isinstance(error, _InjectedFault) and env.task_id is not None:
                self.met[env.task_id].append(f"error: {type(error).__name__}")
        pending = 0
        if env.current == "scienceworld":         # a JVM crash that the ScienceWorldEnv could not restart away
            with env.lock:
                pending, env.pending_kills = env.pending_kills, 0
        with self._lock:
            self.kills_noticed += pending
            self.events.append((round(self._elapsed(), 3), env.uid, "error", type(error).__name__, pending))

    def note_restarts(self, env: ChaosEnv, restarts: int) -> None:
        if restarts <= 0:
            return
        if env.closed:                            # in a call the pool gave up on: nobody sees its result
            with self._lock:
                self.jvm_restarts += restarts
            return
        with env.lock:
            noticed = min(restarts, env.pending_kills)
            env.pending_kills -= noticed
        with self._lock:
            self.events.append((round(self._elapsed(), 3), env.uid, "restart", restarts, noticed))
            self.jvm_restarts += restarts
            self.kills_noticed += noticed
            if env.task_id is not None:
                self.met[env.task_id].extend(["jvm_restart"] * restarts)

    def note_closed(self, env: ChaosEnv, abandoned: bool) -> None:
        with env.lock:
            pending, env.pending_kills = env.pending_kills, 0
        with self._lock:
            self.events.append((round(self._elapsed(), 3), env.uid, "closed", pending, abandoned))
            self.kills_unnoticed += pending
            self.abandoned_calls += abandoned

    # -- the chaos thread
    def start(self) -> None:
        self._start = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="chaos-monkey", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            self.armed_unused += self.armed is not None
            self.armed = None

    def injected(self) -> dict[str, int]:
        counts = collections.Counter(fault.kind for fault in self.faults)
        return {kind: counts.get(kind, 0) for kind in FAULT_KINDS}

    def _run(self) -> None:
        while not self._stop.wait(self.rng.expovariate(1.0 / self.mean_gap_s)):
            self.jvm_peak = max(self.jvm_peak, sum(c["status"] != "zombie" for c in java_children()))
            # a kind injected fewer than ``min_per_kind`` times goes first (at a moment where it has a target),
            # so every kind happens however fast the machine plays the episodes; then the weighted draw
            kinds = list(self.weights)
            injected = self.injected()
            behind = [k for k in kinds if injected.get(k, 0) < self.min_per_kind]
            self.rng.shuffle(behind)
            order = behind + [self.rng.choices(kinds, [self.weights[k] for k in kinds])[0]]
            done = False
            for kind in order:
                try:
                    done = self._inject(kind)
                except Exception:  # noqa: BLE001 - the chaos thread must outlive its own mistakes
                    logger.exception("chaos injection of %s failed", kind)
                    done = False
                if done:
                    break
            if not done:
                self.skipped += 1

    def _elapsed(self) -> float:
        return time.perf_counter() - self._start

    def _inject(self, kind: str) -> bool:
        with self._lock:
            envs = list(self.envs)
        if kind == "jvm_kill":
            candidates = []
            for env in envs:
                science = env.scienceworld
                pid = science.jvm_pid if science is not None and env.current == "scienceworld" else None
                if not env.closed and env.in_episode and pid is not None:
                    candidates.append((env, pid))
            candidates = [(env, pid) for env, pid in candidates if _is_java_child(pid)]
            if not candidates:
                return False
            env, pid = self.rng.choice(candidates)
            with env.lock:
                if env.closed:
                    return False
                os.kill(pid, signal.SIGKILL)
                env.pending_kills += 1
            self._fault("jvm_kill", env, f"SIGKILL pid {pid}")
            return True
        # an ALFWorld fault is armed at a moment an ALFWorld episode is under way (the rate the chaos was tuned to),
        # one at a time, and runs in the next ALFWorld step of any environment
        if not any(not env.closed and env.in_episode and env.current == "alfworld" for env in envs):
            return False
        fault = self.rng.choice(("alfworld_raise_before", "alfworld_raise_after"))
        with self._lock:
            if self.armed is not None:
                return False
            self.armed = fault
        return True


# ------------------------------------------------------------------------------------------------ tasks, comparison
def chaos_tasks(episodes: int, *, num_games: int = 16, cache_dir: str | os.PathLike | None = None
                ) -> tuple[list[Task], Path]:
    """``episodes`` tasks alternating ALFWorld (generated train games) and ScienceWorld (train tasks of
    ``SCIENCEWORLD_TYPES``, variations 0, 1, ...); tasks repeat when there are fewer than asked."""
    from jaxopd_envs import alfworld_gen
    from jaxopd_envs.alfworld import discover_games
    from jaxopd_envs.scienceworld import scienceworld_task

    root = alfworld_gen.ensure_games(cache_dir, seed=0, counts={"train": num_games, "valid_seen": 0,
                                                                  "valid_unseen": 0}, progress=False)
    games = [record.as_task() for record in discover_games(root, "train")]
    science = [scienceworld_task(name, variation) for variation in range(2) for name in SCIENCEWORLD_TYPES]
    tasks = []
    for index in range(episodes):
        pool = games if index % 2 == 0 else science
        tasks.append(pool[(index // 2) % len(pool)])
    return tasks, Path(root)


def _same_observation(benchmark: str, a: Observation, b: Observation) -> str | None:
    if not observation_texts_equivalent(benchmark, a.text, b.text):
        return f"text {a.text[:80]!r} != {b.text[:80]!r}"
    for name in ("instruction", "done", "won", "score", "turn", "last_action_valid"):
        if getattr(a, name) != getattr(b, name):
            return f"{name} {getattr(a, name)!r} != {getattr(b, name)!r}"
    if benchmark == "scienceworld":
        # ScienceWorld names objects that share a name differently from one reset to the next (even in one JVM,
        # without faults: "book on book shelf" / "book (pride and prejudice) in shelf"), in its object list and
        # in its valid action-object combinations, so only the action templates are compared
        if a.action_templates != b.action_templates:
            return "action templates differ"
    elif a.admissible_actions != b.admissible_actions:
        return "admissible actions differ"
    return None


def compare_trajectories(reference: Trajectory, trajectory: Trajectory) -> str | None:
    """None when ``trajectory`` is ``reference`` again (same task, actions, responses, end reason, observations in
    the benchmark's normal form with the same flags), else the first difference."""
    if trajectory.task.task_id != reference.task.task_id:
        return f"task {trajectory.task.task_id} != {reference.task.task_id}"
    if trajectory.end_reason != reference.end_reason:
        return f"end_reason {trajectory.end_reason} != {reference.end_reason}"
    if trajectory.actions != reference.actions:
        return f"actions {trajectory.actions} != {reference.actions}"
    benchmark = reference.task.benchmark
    difference = _same_observation(benchmark, trajectory.initial_observation, reference.initial_observation)
    if difference:
        return f"o_1: {difference}"
    for turn, ref_turn in zip(trajectory.turns, reference.turns):
        difference = _same_observation(benchmark, turn.next_observation, ref_turn.next_observation)
        if difference:
            return f"turn {turn.index}: {difference}"
        if [r.text for r in turn.responses] != [r.text for r in ref_turn.responses]:
            return f"turn {turn.index}: responses differ"
    return None


# ------------------------------------------------------------------------------------------------ the driver
@dataclasses.dataclass
class ChaosReport:
    """The figures of one chaos run (see the module docstring); ``checks`` name each expectation and whether
    it held, ``passed`` is all of them."""

    episodes: int
    slots: int
    max_turns: int
    seed: int
    tasks_by_benchmark: dict[str, int]
    alfworld_games: str
    completed: int
    intact: int
    not_intact: list[dict[str, Any]]
    failed: list[dict[str, Any]]
    faults_injected: dict[str, int]
    faults_injected_total: int
    episodes_met_fault: int
    faults_survived: int                 # episodes that met a fault (or an error it caused) and completed intact
    met_fault_and_failed: int
    end_reasons: dict[str, int]
    pool_recoveries: int
    errors_raised_by_envs: int
    calls_timed_out: int                 # the hang, and any call slower than the pool's call_timeout_s
    late_results: int
    scienceworld_jvm_restarts: int
    jvm_kills_noticed: int
    jvm_kills_unnoticed: int
    armed_unused: int
    injection_moments_skipped: int
    reference_failed: list[dict[str, Any]]
    threads_before: int
    threads_after: int
    leftover_threads: list[str]
    jvms_before: int
    jvms_peak: int
    jvms_after: int
    wall_s: float
    reference_wall_s: float
    faults: list[dict[str, Any]]
    events: list[list[Any]]
    checks: dict[str, bool]

    @property
    def passed(self) -> bool:
        return all(self.checks.values())

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "passed": self.passed}


def _make_pool(factory: Callable[[], TextEnv], slots: int, call_timeout_s: float | None, max_retries: int) -> EnvPool:
    return EnvPool(factory, num_slots=slots, backend="thread", call_timeout_s=call_timeout_s,
                   build_timeout_s=300.0, max_retries=max_retries)


def _play(tasks: list[Task], seeds: list[int], monkey: ChaosMonkey, factories: dict[str, Callable[[], TextEnv]],
          *, slots: int, max_turns: int, call_timeout_s: float | None, max_retries: int, tokenizer: Any,
          chaos: bool) -> tuple[list[EpisodeOutcome], EnvPool, float]:
    pool = _make_pool(functools.partial(ChaosEnv, monkey, factories), slots, call_timeout_s, max_retries)
    strategy = VanillaStrategy(ScriptedAgentEngine(tokenizer), pool, tokenizer, RolloutConfig(max_turns=max_turns))
    start = time.perf_counter()
    try:
        if chaos:
            monkey.start()
        try:
            outcomes = strategy.play(tasks, seeds=seeds)
        finally:
            monkey.stop()
    finally:
        pool.close()
    return outcomes, pool, time.perf_counter() - start


def _wait_for(predicate: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def run_env_chaos(episodes: int = 32, *, seed: int = 0, slots: int = 4, max_turns: int = 6,
                  mean_gap_s: float = 3.0, call_timeout_s: float = 60.0, hang: bool = True, max_retries: int = 1,
                  scienceworld_max_restarts: int = 2, num_games: int = 16, cache_dir: str | os.PathLike | None = None,
                  settle_s: float = 30.0, log: Callable[[str], None] = print) -> ChaosReport:
    """Run ``episodes`` episodes fault-free (the reference), then again under chaos; check and report."""
    from jaxopd_envs.alfworld import AlfWorldEnv
    from jaxopd_envs.scienceworld import ScienceWorldEnv
    from jaxopd.tokenizer import Qwen3Tokenizer

    tasks, root = chaos_tasks(episodes, num_games=num_games, cache_dir=cache_dir)
    factories = {"alfworld": functools.partial(AlfWorldEnv, root),
                 "scienceworld": functools.partial(ScienceWorldEnv, max_restarts=scienceworld_max_restarts)}
    seeds = [seed * 100_003 + index for index in range(len(tasks))]
    tokenizer = Qwen3Tokenizer()
    common = dict(slots=slots, max_turns=max_turns, call_timeout_s=call_timeout_s, max_retries=max_retries,
                  tokenizer=tokenizer)

    threads_before = set(threading.enumerate())
    jvms_before = len(java_children())
    log(f"reference: {len(tasks)} episodes without faults on {slots} slots ...")
    quiet = ChaosMonkey(seed)
    reference, _, reference_wall = _play(tasks, seeds, quiet, factories, chaos=False, **common)
    log(f"reference done in {reference_wall:.1f} s")

    monkey = ChaosMonkey(seed, mean_gap_s=mean_gap_s, hang_s=call_timeout_s + 1.0 if hang else None)
    log(f"chaos: {len(tasks)} episodes, a fault every {mean_gap_s:g} s on average ...")
    outcomes, pool, wall = _play(tasks, seeds, monkey, factories, chaos=True, **common)
    log(f"chaos done in {wall:.1f} s; closing checks ...")

    def leftover_threads() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t not in threads_before and t.is_alive()]

    # a hung call's thread sleeps on after the pool gave up on it (a thread cannot be stopped): wait for it too
    _wait_for(lambda: not leftover_threads() and len(java_children()) <= jvms_before,
              settle_s + (call_timeout_s + 1.0 if hang else 0.0))
    leftovers = sorted(t.name for t in leftover_threads())
    jvms_after = len(java_children())

    # -- outcomes
    one_per_task = (len(outcomes) == len(tasks) and [o.index for o in outcomes] == list(range(len(tasks)))
                    and all(o.task is task for o, task in zip(outcomes, tasks)))
    trajectories = [o.trajectory for o in outcomes if o.ok]
    distinct = len({id(t) for t in trajectories}) == len(trajectories)
    intact, not_intact, failed = 0, [], []
    for outcome, ref in zip(outcomes, reference):
        if not outcome.ok:
            failed.append({"index": outcome.index, "task_id": outcome.task.task_id, "reason": outcome.error,
                           "met": monkey.met.get(outcome.task.task_id, [])})
            continue
        difference = ("the fault-free run failed: " + ref.error) if not ref.ok else compare_trajectories(
            ref.trajectory, outcome.trajectory)
        if difference is None:
            intact += 1
        else:
            not_intact.append({"index": outcome.index, "task_id": outcome.task.task_id, "difference": difference})
    intact_ids = {o.task.task_id for o, ref in zip(outcomes, reference)
                  if o.ok and ref.ok and compare_trajectories(ref.trajectory, o.trajectory) is None}
    met_ids = {task_id for task_id, events in monkey.met.items() if events}
    failed_ids = {o.task.task_id for o in outcomes if not o.ok}
    injected = monkey.injected()
    explained = monkey.errors_raised + monkey.abandoned_calls
    end_reasons = collections.Counter(t.end_reason for t in trajectories)

    checks = {
        "one_outcome_per_task_in_order": one_per_task,
        "no_duplicated_trajectory": distinct,
        "fault_free_reference_completed": all(r.ok for r in reference),
        "every_completed_trajectory_intact": not not_intact,
        "every_failure_has_a_reason": all(f["reason"] and ": " in f["reason"] for f in failed),
        "faults_injected": sum(injected.values()) > 0,
        "faults_survived": bool(met_ids & intact_ids),
        "pool_recoveries_explained_by_faults": pool.recoveries == explained,
        "every_hang_timed_out": monkey.abandoned_calls >= injected["hang"],
        "jvm_kills_accounted": monkey.kills_noticed + monkey.kills_unnoticed == injected["jvm_kill"],
        "no_thread_left": not leftovers,
        "no_jvm_left": jvms_after <= jvms_before,
    }
    return ChaosReport(
        episodes=len(tasks), slots=slots, max_turns=max_turns, seed=seed,
        tasks_by_benchmark=dict(collections.Counter(t.benchmark for t in tasks)),
        alfworld_games=f"generated by jaxopd_envs.alfworld_gen under {root} (not the official ALFWorld splits)",
        completed=len(trajectories), intact=intact, not_intact=not_intact, failed=failed,
        faults_injected=injected, faults_injected_total=sum(injected.values()),
        episodes_met_fault=len(met_ids), faults_survived=len(met_ids & intact_ids),
        met_fault_and_failed=len(met_ids & failed_ids), end_reasons=dict(end_reasons),
        pool_recoveries=pool.recoveries, errors_raised_by_envs=monkey.errors_raised,
        calls_timed_out=monkey.abandoned_calls, late_results=monkey.late_results,
        scienceworld_jvm_restarts=monkey.jvm_restarts, jvm_kills_noticed=monkey.kills_noticed,
        jvm_kills_unnoticed=monkey.kills_unnoticed, armed_unused=monkey.armed_unused,
        injection_moments_skipped=monkey.skipped,
        reference_failed=[{"task_id": r.task.task_id, "reason": r.error} for r in reference if not r.ok],
        threads_before=len(threads_before), threads_after=len(threading.enumerate()), leftover_threads=leftovers,
        jvms_before=jvms_before, jvms_peak=monkey.jvm_peak, jvms_after=jvms_after,
        wall_s=round(wall, 2), reference_wall_s=round(reference_wall, 2),
        faults=[dataclasses.asdict(f) for f in monkey.faults], events=[list(e) for e in monkey.events],
        checks=checks)


# ------------------------------------------------------------------------------------------------ CLI
def table(report: ChaosReport) -> str:
    injected = ", ".join(f"{kind} {n}" for kind, n in report.faults_injected.items())
    rows = [
        ("episodes", f"{report.episodes} ({', '.join(f'{k} {v}' for k, v in report.tasks_by_benchmark.items())}); "
                     f"{report.slots} slots, max {report.max_turns} turns"),
        ("completed intact", f"{report.intact} of {report.completed} completed"),
        ("failed (reported)", f"{len(report.failed)}" + "".join(f"; {f['task_id']}: {f['reason'][:120]}"
                                                                 for f in report.failed)),
        ("not intact", str(len(report.not_intact))),
        ("faults injected", f"{report.faults_injected_total} ({injected})"),
        ("faults survived", f"{report.faults_survived} of {report.episodes_met_fault} episodes that met a fault "
                            f"completed intact ({report.met_fault_and_failed} reported failed)"),
        ("recoveries", f"pool {report.pool_recoveries} (env errors {report.errors_raised_by_envs} + calls timed out "
                       f"{report.calls_timed_out}); ScienceWorld JVM restarts {report.scienceworld_jvm_restarts}; "
                       f"JVM kills noticed {report.jvm_kills_noticed}, unnoticed {report.jvm_kills_unnoticed}"),
        ("threads", f"{report.threads_before} before, {report.threads_after} after close"
                    + (f"; left: {report.leftover_threads}" if report.leftover_threads else "")),
        ("JVM processes", f"{report.jvms_before} before, peak {report.jvms_peak}, {report.jvms_after} after close"),
        ("wall time", f"{report.wall_s:.1f} s under chaos (fault-free reference {report.reference_wall_s:.1f} s)"),
        ("checks", "all passed" if report.passed else
         "FAILED: " + ", ".join(name for name, ok in report.checks.items() if not ok)),
    ]
    lines = ["| environment chaos | |", "|---|---|"] + [f"| {name} | {value} |" for name, value in rows]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.env_chaos", description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--max-turns", type=int, default=6)
    parser.add_argument("--mean-gap", type=float, default=3.0, help="mean seconds between fault attempts")
    parser.add_argument("--call-timeout", type=float, default=60.0, help="the pool's call_timeout_s")
    parser.add_argument("--no-hang", action="store_true", help="inject no hung call")
    parser.add_argument("--max-retries", type=int, default=1, help="the pool's max_retries")
    parser.add_argument("--sw-max-restarts", type=int, default=2, help="ScienceWorldEnv max_restarts (0: the pool "
                                                                       "rebuilds after a JVM crash)")
    parser.add_argument("--out", default="results/reliability", help="folder of env_chaos.json")
    parser.add_argument("--verbose", action="store_true", help="log every recovery (the pool's and ScienceWorld's)")
    args = parser.parse_args(argv)
    if args.episodes < 1:
        parser.error("--episodes must be >= 1")
    logging.basicConfig(level=logging.WARNING if args.verbose else logging.ERROR, force=True)
    logging.getLogger("py4j").setLevel(logging.WARNING if args.verbose else logging.CRITICAL)  # kills are expected
    report = run_env_chaos(args.episodes, seed=args.seed, slots=args.slots, max_turns=args.max_turns,
                           mean_gap_s=args.mean_gap, call_timeout_s=args.call_timeout, hang=not args.no_hang,
                           max_retries=args.max_retries, scienceworld_max_restarts=args.sw_max_restarts)
    result = {"command": "python -m bench.env_chaos " + " ".join(sys.argv[1:] if argv is None else argv),
              **report.as_dict()}
    write_result(json.loads(json.dumps(result, default=str)), table(report), Path(args.out) / "env_chaos.json")
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
