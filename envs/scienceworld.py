"""ScienceWorld (``scienceworld==1.2.3``) behind the ``TextEnv`` interface, with the ActFirst-OPD split.

Owns the train/eval split rule of the paper (App. C.1, :func:`scienceworld_split`), the scoring rule
(max score reached clipped to [0, 100]; success = score >= 99.999), gold-path access for reference
trajectories, and the lifecycle of the engine's JVM: one JVM per environment, closed on ``close()``,
garbage collection or interpreter exit, and restarted with the episode replayed when it crashes.
"""
from __future__ import annotations

import json
import logging
import re
import shutil
import subprocess
import threading
import weakref
from typing import Any, Callable, Mapping, Sequence, TypeVar

from jaxopd_envs.base import EnvError, Observation, Task, TextEnv, require_int, require_text
from jaxopd_envs.checks import normalize_action, normalize_scienceworld_observation

logger = logging.getLogger(__name__)

__all__ = [
    "SCIENCEWORLD_VARIATIONS",
    "SCIENCEWORLD_TRAIN_TASK_TYPES",
    "EVAL_VARIATIONS_PER_TASK_TYPE",
    "SUCCESS_SCORE",
    "SCIENCEWORLD_SIMPLIFICATIONS",
    "check_simplification",
    "scienceworld_split",
    "scienceworld_task",
    "scienceworld_tasks",
    "ScienceWorldEnv",
    "canonical_ambiguity",
]

BENCHMARK = "scienceworld"
SUCCESS_SCORE = 99.999          # App. C.1: "Success ... requires a full score, implemented as score >= 99.999"
EVAL_VARIATIONS_PER_TASK_TYPE = 5
SCIENCEWORLD_SPLITS = ("train", "eval")
# The simplification labels of scienceworld 1.2.3 (``get_possible_simplifications`` plus "easy", which is
# all of them); a simplification string is a comma-separated list of these, or "" for none. The engine
# itself answers an unknown label with "ERROR: Unknown simplification label" as every observation.
SCIENCEWORLD_SIMPLIFICATIONS = ("easy", "teleportAction", "selfWateringFlowerPots", "openContainers", "openDoors",
                                "noElectricalAction")
_ELECTRICAL_TASK_MARKERS = ("power-component", "conductivity")   # tasks that need "connect X to Y"

# Number of variations of each task type in scienceworld 1.2.3 (``getTaskMaxVariations``), in the
# engine's task-id order (1-1 ... 10-2). Checked against the live engine in tests/envs/test_scienceworld.py.
SCIENCEWORLD_VARIATIONS: Mapping[str, int] = {
    "boil": 30,                                              # 1-1 Matter: changes of state (boiling)
    "melt": 30,                                              # 1-2 Matter: changes of state (melting)
    "freeze": 30,                                            # 1-3 Matter: changes of state (freezing)
    "change-the-state-of-matter-of": 30,                     # 1-4 Matter: changes of state (any)
    "use-thermometer": 540,                                  # 2-1 Measurement: use thermometer
    "measure-melting-point-known-substance": 436,            # 2-2 Measurement: melting point (known)
    "measure-melting-point-unknown-substance": 300,          # 2-3 Measurement: melting point (unknown)
    "power-component": 20,                                   # 3-1 Electricity: create a circuit
    "power-component-renewable-vs-nonrenewable-energy": 20,  # 3-2 Electricity: renewable vs non-renewable
    "test-conductivity": 900,                                # 3-3 Electricity: conductivity (known)
    "test-conductivity-of-unknown-substances": 600,          # 3-4 Electricity: conductivity (unknown)
    "find-living-thing": 300,                                # 4-1 Classification: find a living thing
    "find-non-living-thing": 300,                            # 4-2 Classification: find a non-living thing
    "find-plant": 300,                                       # 4-3 Classification: find a plant
    "find-animal": 300,                                      # 4-4 Classification: find an animal
    "grow-plant": 126,                                       # 5-1 Biology: grow a plant
    "grow-fruit": 126,                                       # 5-2 Biology: grow a fruit
    "chemistry-mix": 32,                                     # 6-1 Chemistry: mixing
    "chemistry-mix-paint-secondary-color": 36,               # 6-2 Chemistry: secondary colours
    "chemistry-mix-paint-tertiary-color": 36,                # 6-3 Chemistry: tertiary colours
    "lifespan-longest-lived": 125,                           # 7-1 Biology: longest-lived
    "lifespan-shortest-lived": 125,                          # 7-2 Biology: shortest-lived
    "lifespan-longest-lived-then-shortest-lived": 125,       # 7-3 Biology: longest then shortest
    "identify-life-stages-1": 14,                            # 8-1 Biology: life stages (plant)
    "identify-life-stages-2": 10,                            # 8-2 Biology: life stages (animal)
    "inclined-plane-determine-angle": 168,                   # 9-1 Forces: inclined plane angle
    "inclined-plane-friction-named-surfaces": 1386,          # 9-2 Forces: friction (named surfaces)
    "inclined-plane-friction-unnamed-surfaces": 162,         # 9-3 Forces: friction (unnamed surfaces)
    "mendelian-genetics-known-plant": 120,                   # 10-1 Biology: Mendelian genetics (known)
    "mendelian-genetics-unknown-plant": 480,                 # 10-2 Biology: Mendelian genetics (unknown)
}

# The 17 training task types. App. C.1 says "training uses the first half of the variations from 17
# task types" (2,294 training tasks) but does not name them; 13 held-out types give the 65 eval tasks
# "from the remaining 13 types". No subset is implied by the paper: about 10^5 subsets of 17 types
# reach 2,294 exactly. We take whole ScienceWorld topics: Matter (1-x), Electricity (3-x),
# Classification (4-x), life stages (8-x) and Forces (9-x): 17 types, 2,300 training tasks (paper:
# 2,294), and boil is a training task. Pass ``train_task_types`` to use another set.
SCIENCEWORLD_TRAIN_TASK_TYPES: tuple[str, ...] = (
    "boil", "melt", "freeze", "change-the-state-of-matter-of",
    "power-component", "power-component-renewable-vs-nonrenewable-energy",
    "test-conductivity", "test-conductivity-of-unknown-substances",
    "find-living-thing", "find-non-living-thing", "find-plant", "find-animal",
    "identify-life-stages-1", "identify-life-stages-2",
    "inclined-plane-determine-angle", "inclined-plane-friction-named-surfaces",
    "inclined-plane-friction-unnamed-surfaces",
)


def scienceworld_split(split: str, *, train_task_types: Sequence[str] = SCIENCEWORLD_TRAIN_TASK_TYPES,
                       variations: Mapping[str, int] = SCIENCEWORLD_VARIATIONS,
                       eval_variations_per_task_type: int = EVAL_VARIATIONS_PER_TASK_TYPE
                       ) -> list[tuple[str, int]]:
    """The (task name, variation) pairs of a split, App. C.1 of ActFirst-OPD.

    "training uses the first half of the variations from 17 task types, while evaluation uses the
    last five variations from each of all 30 task types."

    - ``train``: for each task type in ``train_task_types``, variations ``0 .. n//2 - 1`` (the first
      half, rounded down, of its ``n`` variations).
    - ``eval``: for every task type, variations ``n-5 .. n-1``.

    The two are disjoint because every task type has ``n >= 10`` (so ``n//2 <= n-5``); this is
    checked. Pairs come in task-id order, then variation order.
    """
    if split not in SCIENCEWORLD_SPLITS:
        raise ValueError(f"unknown ScienceWorld split {split!r}; expected one of {SCIENCEWORLD_SPLITS}")
    unknown = [t for t in train_task_types if t not in variations]
    if unknown:
        raise ValueError(f"unknown ScienceWorld task types in train_task_types: {unknown}")
    if len(set(train_task_types)) != len(train_task_types):
        raise ValueError("train_task_types contains duplicates")
    if eval_variations_per_task_type < 1:
        raise ValueError(f"eval_variations_per_task_type must be >= 1, got {eval_variations_per_task_type}")
    for name, count in variations.items():
        if count // 2 > count - eval_variations_per_task_type:
            raise ValueError(f"task type {name!r} has {count} variations: its first half would overlap its "
                             f"last {eval_variations_per_task_type}")
    if split == "train":
        chosen = set(train_task_types)
        return [(name, v) for name, count in variations.items() if name in chosen for v in range(count // 2)]
    return [(name, v) for name, count in variations.items()
            for v in range(count - eval_variations_per_task_type, count)]


def check_simplification(simplification: str, task_name: str | None = None) -> str:
    """``simplification`` if it is "" or a comma-separated list of known labels (and, for ``task_name``,
    usable by that task: electrical tasks cannot drop "connect" actions), else ``ValueError``."""
    if not isinstance(simplification, str):
        raise ValueError(f"simplification must be a str, got {type(simplification).__name__}")
    labels = [label for label in simplification.split(",") if label]
    unknown = [label for label in labels if label not in SCIENCEWORLD_SIMPLIFICATIONS]
    if unknown or (simplification and len(labels) != simplification.count(",") + 1):
        raise ValueError(f"unknown ScienceWorld simplification {simplification!r}: expected \"\" or a "
                         f"comma-separated list of {SCIENCEWORLD_SIMPLIFICATIONS}")
    if (task_name is not None and "noElectricalAction" in labels
            and any(marker in task_name for marker in _ELECTRICAL_TASK_MARKERS)):
        raise ValueError(f"ScienceWorld task {task_name!r} needs electrical actions: simplification "
                         f"'noElectricalAction' cannot be used with it")
    return simplification


def _check_variation(task_name: str, variation: Any) -> int:
    if task_name not in SCIENCEWORLD_VARIATIONS:
        raise ValueError(f"unknown ScienceWorld task type {task_name!r}")
    variation = require_int(variation, f"variation of {task_name!r}")      # 1.5 is not variation 1
    count = SCIENCEWORLD_VARIATIONS[task_name]
    if not 0 <= variation < count:
        raise ValueError(f"variation {variation} out of range for {task_name!r} (0..{count - 1})")
    return variation


def scienceworld_task(task_name: str, variation: int, *, split: str = "train",
                      simplification: str = "easy") -> Task:
    """The ``Task`` record of one ScienceWorld (task type, variation)."""
    variation = _check_variation(task_name, variation)
    check_simplification(simplification, task_name)
    if split not in SCIENCEWORLD_SPLITS:
        raise ValueError(f"unknown ScienceWorld split {split!r}; expected one of {SCIENCEWORLD_SPLITS}")
    return Task(benchmark=BENCHMARK, split=split, task_id=f"{BENCHMARK}/{split}/{task_name}-{variation}",
                task_type=task_name,
                payload={"task_name": task_name, "variation": variation, "simplification": simplification})


def scienceworld_tasks(split: str, *, simplification: str = "easy",
                       train_task_types: Sequence[str] = SCIENCEWORLD_TRAIN_TASK_TYPES) -> list[Task]:
    """``Task`` records of a split (see :func:`scienceworld_split`)."""
    return [scienceworld_task(name, v, split=split, simplification=simplification)
            for name, v in scienceworld_split(split, train_task_types=train_task_types)]


# ----------------------------------------------------------------------------------------------
# JVM lifecycle
# ----------------------------------------------------------------------------------------------

def _stop_jvm(engine: Any, graceful: bool = True) -> None:
    """Shut down one ``scienceworld.ScienceWorldEnv``'s gateway and make sure its JVM exits.

    ``graceful``: ask the JVM to shut down first (normal close); otherwise (after a crash) kill it and
    only close the Python side, so that nothing tries to reach a dead JVM.
    """
    gateway = engine._gateway
    process = getattr(gateway, "java_process", None)
    client = gateway._gateway_client
    engine.close = lambda: None     # the wrapper's __del__ would otherwise shut down the gateway again
    alive = process is not None and process.poll() is None
    if alive and not graceful:
        process.kill()
        alive = False
    try:
        if alive:
            gateway.shutdown()
        else:
            client.close()
            gateway.shutdown_callback_server()
    except Exception:               # noqa: BLE001 - a broken gateway makes shutdown fail; the kill below still runs
        pass
    client.is_connected = False     # py4j's object finalizers must not call a stopped JVM
    if process is not None and process.poll() is None:
        try:                        # launch_gateway(die_on_exit=True): the JVM exits on a line on stdin
            process.stdin.write(b"\n")
            process.stdin.flush()
        except (OSError, ValueError):
            pass
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
    if process is not None:
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            logger.error("ScienceWorld JVM pid %d did not exit after kill", process.pid)
    tempdir = getattr(engine, "_obj_tree_tempdir", None)
    if tempdir is not None:
        tempdir.cleanup()


_T = TypeVar("_T")

_AMBIGUOUS_HEADER = "Ambiguous request:"
_AMBIGUOUS_OPTION = re.compile(r"^(\d+):\t(.*)$")


def canonical_ambiguity(text: str) -> tuple[str, tuple[int, ...] | None]:
    """An "Ambiguous request" answer with its readings sorted and renumbered, and the engine's number of each.

    The engine lists the readings of an ambiguous action ("open door": which door?) in an order that changes
    from one reset to the next, and takes the number of one as the next action. Presented in text order, the
    listing and the meaning of each number are the same in every run, so a replay (after a JVM crash, or by
    ``EnvPool``) reproduces it. Returns ``(text, None)`` for any other text."""
    if not text.startswith(_AMBIGUOUS_HEADER):
        return text, None
    lines = text.split("\n")
    options, others = [], []
    for line in lines[1:]:
        match = _AMBIGUOUS_OPTION.match(line)
        if match:
            options.append((match.group(2), int(match.group(1))))
        elif line:
            others.append(line)
    if not options:
        return text, None
    options.sort()
    body = [lines[0]] + [f"{number}:\t{option}" for number, (option, _) in enumerate(options)] + others
    return "\n".join(body) + ("\n" if text.endswith("\n") else ""), tuple(engine for _, engine in options)


def _engine_command(command: str, ambiguity: tuple[int, ...] | None) -> str:
    """``command`` as the engine must receive it: the number of a reading of the last (canonical) ambiguity
    listing becomes the engine's own number of that reading."""
    number = command.strip()
    if ambiguity is not None and number.isascii() and number.isdigit() and int(number) < len(ambiguity):
        return str(ambiguity[int(number)])
    return command


def _clip_score(raw_score: int) -> float:
    return float(min(max(raw_score, 0), 100))


class ScienceWorldEnv(TextEnv):
    """One ScienceWorld engine (its own JVM) playing one episode at a time.

    Observation fields: ``text`` is the engine's answer to the action (``look around`` after reset);
    ``instruction`` the task description; ``admissible_actions`` the full list of valid
    action–object combinations (for validation; sorted); ``action_templates`` and ``objects`` the
    action templates and possible object referents shown in prompts (App. C.1: "we provide templates
    and possible object referents separately"); ``score`` the highest score reached in the episode,
    clipped to [0, 100]; ``won`` = ``score >= 99.999``; ``done`` the engine's completion flag (also
    set when the raw score turns negative, as the official wrapper does); ``reward`` the change of
    the raw engine score; ``last_action_valid`` whether the action's normalised text was in the
    previous admissible list (App. B.5). ``info`` holds ``raw_score``, ``moves``, ``task_name``,
    ``variation`` and ``restarts``.

    The engine itself imposes no step limit here; turn limits belong to the rollout.

    Ambiguous actions: the engine answers "Ambiguous request" with numbered readings in an order that changes
    from one reset to the next; the observation lists them sorted by text (``canonical_ambiguity``) and a
    numeric answer is translated to the engine's number, so a replay reaches the same state.

    Crash recovery: when a call to the JVM fails (``py4j`` error: the process died or the connection
    broke), the JVM is restarted, the task reloaded and the episode's actions replayed (each replayed
    observation must equal the recorded one in the App. B.5 normal form: the engine may enumerate
    objects in another order after a reset), then the call is retried; at most ``max_restarts``
    restarts happen in one call, after which ``EnvError`` is raised (the next call may restart again).
    With ``max_restarts=0`` a crash is reported at once, e.g. for ``EnvPool`` to rebuild the env.
    """

    benchmark = BENCHMARK

    def __init__(self, *, simplification: str = "easy", max_restarts: int = 2, jar_path: str | None = None,
                 train_task_types: Sequence[str] = SCIENCEWORLD_TRAIN_TASK_TYPES):
        max_restarts = require_int(max_restarts, "max_restarts", minimum=0)
        self.simplification = check_simplification(simplification)
        self.max_restarts = max_restarts
        self.jar_path = jar_path
        self.train_task_types = tuple(train_task_types)
        self.restarts = 0                       # JVM restarts after a crash, over this object's life
        self._engine: Any = None                # scienceworld.ScienceWorldEnv (owns the JVM)
        self._finalizer: weakref.finalize | None = None
        self._needs_restart = False
        self._closed = False
        self._lock = threading.Lock()           # guards start/stop against close() from another thread
        self._loaded: tuple[str, int, str] | None = None
        self._gold_cache: dict[tuple[str, int, str], tuple[str, ...]] = {}
        self._clear_episode()

    # -- episode state --------------------------------------------------------------------------
    def _clear_episode(self) -> None:
        self._task: Task | None = None
        self._actions: list[str] = []
        self._texts: list[str] = []             # o_1 .. o_{t+1} as returned by the engine (ambiguity listings sorted)
        self._ambiguity: tuple[int, ...] | None = None    # engine numbers of the last listing's readings
        self._instruction = ""
        self._raw_score = 0
        self._max_score = 0.0
        self._done = False
        self._admissible_by_norm: dict[str, str] = {}     # normalised text -> the engine's own spelling

    # -- JVM ------------------------------------------------------------------------------------
    @property
    def jvm_pid(self) -> int | None:
        """Process id of the current JVM (None before the first reset or after close)."""
        if self._engine is None:
            return None
        return self._engine._gateway.java_process.pid

    def _jvm_alive(self) -> bool:
        return self._engine._gateway.java_process.poll() is None

    def _start(self) -> None:
        if shutil.which("java") is None:
            raise EnvError("ScienceWorld needs a Java runtime, and `java` is not on PATH "
                           "(Debian/Ubuntu: apt-get install default-jre-headless)")
        try:
            from scienceworld import ScienceWorldEnv as _Engine
        except ImportError as error:
            raise EnvError("the `scienceworld` package is not installed (pip install scienceworld==1.2.3)") from error
        with self._lock:
            if self._closed:
                raise EnvError("this ScienceWorldEnv is closed")
            engine = _Engine("", serverPath=self.jar_path, envStepLimit=1 << 62)
            self._engine = engine
            self._finalizer = weakref.finalize(self, _stop_jvm, engine)
            self._loaded = None

    def _stop(self, *, graceful: bool = True) -> None:
        with self._lock:
            finalizer, engine = self._finalizer, self._engine
            self._finalizer, self._engine, self._loaded = None, None, None
        if finalizer is not None and finalizer.detach() is not None:
            _stop_jvm(engine, graceful)          # detach() returned the pending call: run it once, here

    def close(self) -> None:
        """Stop the JVM. Idempotent; a closed environment cannot be reset again."""
        self._closed = True
        self._stop()

    @property
    def _server(self) -> Any:
        return self._engine.server

    def _run(self, operation: Callable[[], _T], *, replay: bool) -> _T:
        """Run ``operation`` against the JVM, restarting it (and replaying the episode) after a crash."""
        from py4j.protocol import Py4JError

        if self._closed:
            raise EnvError("this ScienceWorldEnv is closed")
        last_error: BaseException | None = None
        restarts_left = self.max_restarts
        while True:
            try:
                if self._engine is None:
                    self._start()
                    if replay:
                        self._replay_episode()
                elif self._needs_restart or not self._jvm_alive():
                    if restarts_left == 0:
                        raise EnvError(f"ScienceWorld JVM crashed and max_restarts={self.max_restarts} restarts "
                                       f"in this call are used up (last error: {last_error})") from last_error
                    restarts_left -= 1
                    self._stop(graceful=False)
                    self.restarts += 1
                    logger.warning("ScienceWorld JVM crashed (%s); restart %d", last_error or "process exited",
                                   self.restarts)
                    self._start()
                    self._needs_restart = False
                    if replay:
                        self._replay_episode()
                return operation()
            except Py4JError as error:
                if self._closed:
                    raise EnvError("this ScienceWorldEnv was closed during a call") from error
                if self._engine is None:
                    raise EnvError(f"could not start the ScienceWorld JVM: {error}") from error
                last_error = error
                self._needs_restart = True

    def _load(self, task_name: str, variation: int, simplification: str, *, gold: bool) -> None:
        key = (task_name, variation, simplification)
        if gold or self._loaded != key:
            self._server.load(task_name, variation, simplification, gold)
            self._loaded = key

    def _replay_episode(self) -> None:
        """Reload the task and replay the recorded actions, checking every observation."""
        if self._task is None:
            return
        self._load(*self._task_key(self._task), gold=False)
        self._server.reset()
        replayed = [self._server.step("look around")]
        ambiguity = None            # this JVM numbers the readings of an ambiguous action its own way
        for action in self._actions:
            text, ambiguity = canonical_ambiguity(self._server.step(_engine_command(action, ambiguity)))
            replayed.append(text)
        self._ambiguity = ambiguity
        # Some variations list objects in another order after a reset, so observations are compared in
        # the App. B.5 ScienceWorld normal form (lines and enumerations sorted), not byte for byte.
        for turn, (recorded, now) in enumerate(zip(self._texts, replayed)):
            if normalize_scienceworld_observation(recorded) != normalize_scienceworld_observation(now):
                raise EnvError(f"replay of {self._task.task_id} diverged at turn {turn}: "
                               f"recorded {recorded[:200]!r}, replayed {now[:200]!r}")

    # -- TextEnv ------------------------------------------------------------------------------------
    def tasks(self, split: str) -> list[Task]:
        return scienceworld_tasks(split, simplification=self.simplification,
                                  train_task_types=self.train_task_types)

    def _task_key(self, task: Task) -> tuple[str, int, str]:
        if not isinstance(task, Task) or task.benchmark != BENCHMARK:
            raise ValueError(f"not a ScienceWorld task: {task!r}")
        payload = task.payload
        if "task_name" not in payload or "variation" not in payload:
            raise ValueError(f"task {task.task_id!r}: payload needs 'task_name' and 'variation', got {payload!r}")
        name = payload["task_name"]
        try:
            variation = _check_variation(name, payload["variation"])
            simplification = check_simplification(payload.get("simplification", self.simplification), name)
        except ValueError as error:
            raise ValueError(f"task {task.task_id!r}: {error}") from None
        return name, variation, simplification

    def reset(self, task: Task) -> Observation:
        name, variation, simplification = self._task_key(task)
        self._clear_episode()

        def load_and_reset() -> tuple[str, Observation]:
            self._load(name, variation, simplification, gold=False)
            self._server.reset()
            text = self._server.step("look around")
            instruction = self._server_task_description()
            return text, self._observe(text, task=task, instruction=instruction, raw_before=0,
                                       action_valid=True, turn=0)

        text, observation = self._run(load_and_reset, replay=False)
        self._task = task
        self._instruction = observation.instruction
        self._texts = [text]
        self._commit(observation)
        return observation

    def step(self, action: str) -> Observation:
        if self._task is None:
            raise ValueError("step() called before reset()")
        if self._done:
            raise ValueError(f"episode of {self._task.task_id} is over; call reset()")
        require_text(action, "action")       # a lone surrogate would fail inside py4j, not in the engine
        # An action that matches an admissible one after normalisation (NFKC, case, spaces) is sent in the
        # engine's own spelling: the engine's parser knows nothing of Unicode normalisation.
        canonical = self._admissible_by_norm.get(normalize_action(action))
        action_valid = canonical is not None
        command = action if canonical is None else canonical
        raw_before = self._raw_score

        def execute() -> tuple[str, tuple[int, ...] | None, Observation]:   # after a restart the replay has
            # renumbered the listing: translate at call time
            text, ambiguity = canonical_ambiguity(self._server.step(_engine_command(command, self._ambiguity)))
            return text, ambiguity, self._observe(text, task=self._task, instruction=self._instruction,
                                                  raw_before=raw_before, action_valid=action_valid,
                                                  turn=len(self._actions) + 1)

        text, ambiguity, observation = self._run(execute, replay=True)
        self._actions.append(command)
        self._texts.append(text)
        self._ambiguity = ambiguity
        self._commit(observation)
        return observation

    def gold_actions(self, task: Task) -> list[str]:
        """The engine's gold action sequence for ``task`` (loads the task: any open episode ends)."""
        key = self._task_key(task)
        if key not in self._gold_cache:
            self._clear_episode()

            def load_gold() -> tuple[str, ...]:
                self._load(*key, gold=True)
                return tuple(self._server.getGoldActionSequence())

            gold = self._run(load_gold, replay=False)
            if not gold or gold[0].startswith("ERROR"):
                raise EnvError(f"ScienceWorld produced no gold path for {task.task_id}: {list(gold)[:1]}")
            self._gold_cache[key] = gold
        return list(self._gold_cache[key])

    # -- observation assembly ---------------------------------------------------------------------
    def _server_task_description(self) -> str:
        description = self._server.freeActionTaskDesc()
        prefix = "Task Description:"
        description = description.strip()
        if description.startswith(prefix):
            description = description[len(prefix):].strip()
        return description

    def _observe(self, text: str, *, task: Task, instruction: str, raw_before: int, action_valid: bool,
                 turn: int) -> Observation:
        server = self._server
        raw_score = int(round(100 * server.getScore()))
        completed = bool(server.getCompleted())
        moves = int(server.getNumMoves())
        valid_json = json.loads(server.getValidActionObjectCombinationsJSON())
        admissible = tuple(sorted({entry["action"] for entry in valid_json["validActions"]}))
        templates = tuple(server.getPossibleActions())
        objects = tuple(server.getPossibleObjects())
        max_score = max(self._max_score, _clip_score(raw_score))
        return Observation(
            text=text, instruction=instruction, admissible_actions=admissible,
            action_templates=templates, objects=objects, done=completed or raw_score < 0,
            won=max_score >= SUCCESS_SCORE, score=max_score, reward=float(raw_score - raw_before), turn=turn,
            last_action_valid=action_valid,
            info={"raw_score": raw_score, "moves": moves, "task_name": task.payload["task_name"],
                  "variation": int(task.payload["variation"]), "restarts": self.restarts})

    def _commit(self, observation: Observation) -> None:
        self._raw_score = observation.info["raw_score"]
        self._max_score = observation.score
        self._done = observation.done
        self._admissible_by_norm = {}
        for admissible in observation.admissible_actions:          # sorted: the first spelling wins
            self._admissible_by_norm.setdefault(normalize_action(admissible), admissible)

