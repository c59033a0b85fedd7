"""ALFWorld game generator: authors games of the six task types from the FloorPlan layouts, PDDL domain and
grammar shipped in the ``alfworld`` wheel, solves and verifies each on the real engine, caches them on disk.

Games are written as an ALFWorld ``json_2.1.1`` tree (``<split>/<task folder>/<trial>/{game.tw-pddl,
traj_data.json, initial_state.pddl}``) that ``jaxopd_envs.alfworld.AlfWorldEnv`` plays like the official release.
They are ALFWorld-format tasks on the real engine, *not* the ALFWorld benchmark games: rooms are ALFRED's
floor plans (receptacle ids and interaction poses from ``layouts/FloorPlan*-openable.json``, object
types from ``FloorPlan*-objects.json``), objects are placed at random where ALFRED's tables allow.

Splits follow ALFRED's scene split (``alfworld.gen.constants``): ``train`` and ``valid_seen`` use
``TRAIN_SCENE_NUMBERS``, ``valid_unseen`` the held-out ``TEST_SCENE_NUMBERS``. Every game gets a
shortest walkthrough from an exact expert (``expert_steps``; ALFWorld's own ``alfworld-generate`` also
defaults to a hand-coded expert) which is replayed on the real TextWorld engine and must reach
``won=True`` exactly at its last step before the game is kept; the walkthrough is stored in
``game.tw-pddl`` as the official files do. TextWorld's planner (``planner_walkthrough``) finds the same
plan lengths but takes 2-30 s per kitchen game, so it serves as a cross-check only. The same seed gives
byte-identical game files whatever the number of worker processes.

Differences from the release, by necessity: object placements are sampled (ALFRED's come from THOR
physics); a static receptacle type listed in a scene without a precomputed pose gets one instance at a
fixed reachable point; look-at-object tasks use desk lamps only (a floor lamp has no receptacle in the
PDDL state, so ``use floorlamp`` can never be admissible); objects are only placed in static receptacles
(the domain shipped with alfworld 0.4.2 has no action for movable receptacles).

Two sets of split sizes are in use, both owned here: ``DEFAULT_COUNTS``, the environment's own (``AlfWorldEnv``
without a game root, hence the main job and the benchmarks: ALFWorld's evaluation sizes), and
``TRAINING_COUNTS``, the training and evaluation commands' (``jaxopd.methods.benchmarks.GeneratedCounts``;
``experiments.train --generated-train-games N`` replaces its train count). The tree's cache folder is a hash of
the counts, so the same train count with other evaluation counts is another tree.

CLI: ``python -m jaxopd_envs.alfworld_gen --out DIR --num N --seed S``; ``--counts training --num N`` makes (in the
cache) exactly the tree ``experiments.train --generated-train-games N`` uses.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import functools
import hashlib
import json
import logging
import multiprocessing
import os
import random
import shutil
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from jaxopd_envs.alfworld_engine import (
    ALFWORLD_SPLITS,
    DATA_SUBDIR,
    GAME_FILE,
    INDEX_FILE,
    TASK_TYPES,
    TRAJ_FILE,
    AlfredEngine,
    admissible_actions,
)
from jaxopd_envs.base import EnvError, require_int
from jaxopd_envs.workers import worker_init
from jaxopd_envs.alfworld_import import import_alfworld

logger = logging.getLogger(__name__)

GENERATOR_VERSION = 1
DEFAULT_COUNTS = {"train": 600, "valid_seen": 140, "valid_unseen": 134}   # the environment's: eval sizes as in ALFWorld
TRAINING_COUNTS = {"train": 240, "valid_seen": 24, "valid_unseen": 48}   # experiments.train / experiments.evaluate
COUNT_SETS = {"environment": DEFAULT_COUNTS, "training": TRAINING_COUNTS}
DEFAULT_MAX_WALKTHROUGH = 30        # the interaction limit used for ALFWorld in the ActFirst paper
CACHE_ENV_VAR = "JAXOPD_CACHE"
MAX_INSTANCES = 3                   # alfworld.gen.constants.MAX_NUM_OF_OBJ_INSTANCES
MAX_TARGET_INSTANCES = 4            # alfworld.gen.constants.PICKUP_REPEAT_MAX
MAX_ATTEMPTS = 50                   # resamples of one game slot before giving up

# Where a desk lamp may stand (ALFRED's receptacle tables have no entry for lamps, which are not pickupable).
LAMP_HOSTS = ("Desk", "SideTable", "Dresser", "Shelf", "CoffeeTable", "DiningTable")
# The appliance each task type needs, which the target must not start in nor be delivered to
# (ALFRED's task_game_state.get_filter_crit).
TASK_APPLIANCE = {
    "pick_clean_then_place_in_recep": "SinkBasin",
    "pick_heat_then_place_in_recep": "Microwave",
    "pick_cool_then_place_in_recep": "Fridge",
}
TASK_PROPERTY = {
    "pick_clean_then_place_in_recep": "Cleanable",
    "pick_heat_then_place_in_recep": "Heatable",
    "pick_cool_then_place_in_recep": "Coolable",
}
_PROPERTY_PREDICATES = (("cleanable", "Cleanable"), ("heatable", "Heatable"), ("coolable", "Coolable"),
                        ("toggleable", "Toggleable"), ("sliceable", "Sliceable"))
_MANGLE = (("-", "_minus_"), ("|", "_bar_"), ("+", "_plus_"), (".", "_dot_"), (",", "_comma_"))


# ----------------------------------------------------------------------------------------- ALFRED data


@functools.lru_cache(maxsize=1)
def _alfred() -> Any:
    """alfworld's data: constants, goal library, domain and grammar text (imported once, lazily)."""
    import_alfworld()
    import alfworld.gen as alfred_gen
    import alfworld.gen.constants as constants
    import alfworld.gen.goal_library as goal_library
    from alfworld.info import ALFRED_PDDL_PATH, ALFRED_TWL2_PATH

    static_receptacles = frozenset(constants.RECEPTACLES) - frozenset(constants.MOVABLE_RECEPTACLES)
    object_types = frozenset(constants.OBJECTS_SET) - static_receptacles
    containable = frozenset().union(*constants.VAL_RECEPTACLE_OBJECTS.values())
    return dict(
        constants=constants,
        goals=goal_library.gdict,
        layouts_dir=Path(alfred_gen.__file__).parent / "layouts",
        domain=Path(ALFRED_PDDL_PATH).read_text(),
        grammar=Path(ALFRED_TWL2_PATH).read_text(),
        static_receptacles=static_receptacles,
        # PDDL type constants, declared once each as the official problems do.
        otypes=tuple(sorted(object_types)),
        rtypes=tuple(sorted(static_receptacles)),
        pickupable=frozenset(t for t in object_types if t in containable),
    )


def mangle(name: str) -> str:
    """ALFRED's PDDL-safe spelling of an id (PlannedGameState.fix_pddl_str_chars, without '#')."""
    for old, new in _MANGLE:
        name = name.replace(old, new)
    return name


def _fmt(value: float) -> str:
    """ALFRED's coordinate spelling in object ids: '+00.68', '-02.20'."""
    return f"{value:+06.2f}"


def _location(x: float, z: float, rotation: float, horizon: float) -> str:
    """ALFRED's location name for an agent pose (game_util.get_pose: 0.25 m grid, quarter turns)."""
    return f"loc|{int(round(x / 0.25))}|{int(round(z / 0.25))}|{int(round(rotation / 90)) % 4}|{int(round(horizon))}"


@dataclasses.dataclass(frozen=True)
class Receptacle:
    alfred_id: str           # e.g. "Cabinet|+00.68|+00.50|-02.20" or "Sink|-01.90|+00.97|-01.50|SinkBasin"
    rtype: str
    location: str            # the pose the agent interacts from, "loc|x|z|rot|horizon"
    position: tuple[float, float, float]
    openable: bool


@dataclasses.dataclass(frozen=True)
class FloorPlan:
    scene_num: int
    scene_type: str                      # Kitchen | LivingRoom | Bedroom | Bathroom
    receptacles: tuple[Receptacle, ...]
    object_types: tuple[str, ...]        # pickupable object types of the scene
    has_desk_lamp: bool
    floor_points: tuple[tuple[float, float], ...]   # reachable positions (layout.npy)

    def receptacles_of(self, rtype: str) -> tuple[Receptacle, ...]:
        return tuple(r for r in self.receptacles if r.rtype == rtype)

    @functools.cached_property
    def receptacle_types(self) -> frozenset[str]:
        return frozenset(r.rtype for r in self.receptacles)


def _receptacle_type(alfred_id: str) -> str:
    parts = alfred_id.split("|")
    return parts[-1] if parts[-1].endswith("Basin") else parts[0]


@functools.lru_cache(maxsize=None)
def load_floor_plan(scene_num: int) -> FloorPlan:
    """A room of ALFRED from the layouts shipped in the alfworld wheel.

    Receptacles are the ones with precomputed interaction poses (``openable.json``); a static receptacle
    type listed in ``objects.json`` without one (often GarbageCan, CoffeeMachine, Toaster, StoveBurner)
    gets one instance at a reachable point chosen from the scene number alone, so a room is the same in
    every game.
    """
    alfred = _alfred()
    constants = alfred["constants"]
    stem = alfred["layouts_dir"] / f"FloorPlan{scene_num}"
    try:
        scene_objects = json.loads(Path(f"{stem}-objects.json").read_text())
        interaction_points = json.loads(Path(f"{stem}-openable.json").read_text())
        floor = np.load(f"{stem}-layout.npy")
    except FileNotFoundError as exc:
        raise ValueError(f"FloorPlan{scene_num} is not among the layouts shipped with alfworld") from exc
    scene_type = next((name for name, nums in constants.SCENE_TYPE.items() if scene_num in nums), None)
    if scene_type is None:
        raise ValueError(f"FloorPlan{scene_num} has no ALFRED scene type")
    floor_points = tuple((float(x), float(z)) for x, z in floor)

    receptacles = []
    for alfred_id in sorted(interaction_points):
        rtype = _receptacle_type(alfred_id)
        if rtype not in alfred["static_receptacles"]:
            continue
        x, z, rotation, horizon = interaction_points[alfred_id]
        position = tuple(float(v) for v in alfred_id.split("|")[1:4])
        receptacles.append(Receptacle(alfred_id, rtype, _location(x, z, rotation, horizon), position,
                                      rtype in constants.OPENABLE_CLASS_SET))
    present = {r.rtype for r in receptacles}
    point_rng = random.Random(f"floorplan/{scene_num}")
    for rtype in sorted(set(scene_objects) & alfred["static_receptacles"] - present):
        x, z = point_rng.choice(floor_points)
        rotation = 90 * point_rng.randrange(4)
        position = (x, 0.9, z)
        alfred_id = "|".join([rtype if not rtype.endswith("Basin") else rtype[:-5], *map(_fmt, position)])
        if rtype.endswith("Basin"):
            alfred_id += f"|{rtype}"
        receptacles.append(Receptacle(alfred_id, rtype, _location(x, z, rotation, 30), position,
                                      rtype in constants.OPENABLE_CLASS_SET))
    object_types = tuple(sorted(t for t in set(scene_objects) if t in alfred["pickupable"]))
    has_lamp = "DeskLamp" in scene_objects and any(r.rtype in LAMP_HOSTS for r in receptacles)
    return FloorPlan(scene_num, scene_type, tuple(receptacles), object_types, has_lamp, floor_points)


def split_floor_plans(split: str) -> tuple[int, ...]:
    """ALFRED's scene split: seen rooms for train/valid_seen, held-out rooms for valid_unseen."""
    constants = _alfred()["constants"]
    if split in ("train", "valid_seen"):
        return tuple(sorted(constants.TRAIN_SCENE_NUMBERS))
    if split == "valid_unseen":
        return tuple(sorted(constants.TEST_SCENE_NUMBERS))
    raise ValueError(f"unknown ALFWorld split {split!r}; expected one of {ALFWORLD_SPLITS}")


# ------------------------------------------------------------------------------------------ sampling


@dataclasses.dataclass(frozen=True)
class TaskParams:
    task_type: str
    object_target: str
    parent_target: str = ""    # receptacle type to deliver to ("" for look_at_obj_in_light)
    toggle_target: str = ""    # "DeskLamp" for look_at_obj_in_light

    @property
    def folder_name(self) -> str:
        last = self.toggle_target or self.parent_target
        return f"{self.task_type}-{self.object_target}-None-{last}"


@dataclasses.dataclass(frozen=True)
class PlacedObject:
    alfred_id: str
    otype: str
    receptacle: Receptacle


@dataclasses.dataclass(frozen=True)
class GameSpec:
    """A sampled, not yet verified game."""

    split: str
    index: int
    seed: int
    floor_plan: int
    params: TaskParams
    task_desc: str
    pddl_problem: str
    expert_steps: tuple[tuple[str, ...], ...]    # the expert's solution, as (verb, *ALFRED ids)

    @property
    def relative_dir(self) -> str:
        return f"{self.params.folder_name}-{self.floor_plan}/trial_S{self.seed}_{self.index:05d}"

    @property
    def state_key(self) -> str:
        """Identity of the initial state and goal (the problem without its name)."""
        body = self.pddl_problem[self.pddl_problem.index("(:objects"):]
        return hashlib.sha256(body.encode()).hexdigest()

    def traj_data(self) -> dict[str, Any]:
        params = self.params
        return {
            "task_id": f"S{self.seed}_{self.split}_{self.index:05d}",
            "task_type": params.task_type,
            "pddl_params": {"object_target": params.object_target, "parent_target": params.parent_target,
                            "toggle_target": params.toggle_target, "mrecep_target": "",
                            "object_sliced": False},
            "scene": {"floor_plan": f"FloorPlan{self.floor_plan}", "scene_num": self.floor_plan},
            "turk_annotations": {"anns": [{"task_desc": self.task_desc}]},
            "generator": {"name": "jaxopd.envs.alfworld_gen", "version": GENERATOR_VERSION,
                          "seed": self.seed, "split": self.split, "index": self.index},
        }

    def game_data(self, walkthrough: Sequence[str] | None) -> dict[str, Any]:
        """The game.tw-pddl content, in the official key order."""
        alfred = _alfred()
        grammar = alfred["grammar"].replace("UNKNOWN GOAL", self.task_desc)
        return {"pddl_domain": alfred["domain"], "grammar": grammar, "pddl_problem": self.pddl_problem,
                "solvable": walkthrough is not None, "walkthrough": list(walkthrough) if walkthrough else None}


def _can_contain(rtype: str, otype: str) -> bool:
    return otype in _alfred()["constants"].VAL_RECEPTACLE_OBJECTS.get(rtype, ())


def _has_property(otype: str, prop: str) -> bool:
    return otype in _alfred()["constants"].VAL_ACTION_OBJECTS[prop]


def task_candidates(plan: FloorPlan, task_type: str) -> list[TaskParams]:
    """Every (object, receptacle[, lamp]) choice of ``task_type`` that is solvable in ``plan``."""
    constants = _alfred()["constants"]
    if task_type not in TASK_TYPES:
        raise ValueError(f"unknown ALFWorld task type {task_type!r}")
    if plan.scene_type not in constants.GOALS_VALID[task_type]:
        return []
    if task_type == "look_at_obj_in_light":
        if not plan.has_desk_lamp:
            return []
        return [TaskParams(task_type, o, "", "DeskLamp") for o in plan.object_types
                if any(_can_contain(r.rtype, o) for r in plan.receptacles)]
    appliance = TASK_APPLIANCE.get(task_type)
    if appliance is not None and appliance not in plan.receptacle_types:
        return []
    candidates = []
    for otype in plan.object_types:
        if task_type in TASK_PROPERTY and not _has_property(otype, TASK_PROPERTY[task_type]):
            continue
        for rtype in sorted(plan.receptacle_types):
            if rtype == appliance or not _can_contain(rtype, otype):
                continue
            # the targets must start somewhere else than the goal receptacle type and the appliance
            if any(r.rtype not in (rtype, appliance) and _can_contain(r.rtype, otype) for r in plan.receptacles):
                candidates.append(TaskParams(task_type, otype, rtype, ""))
    return candidates


def sample_game(plan: FloorPlan, task_type: str, rng: random.Random, *, split: str, index: int,
                seed: int) -> GameSpec | None:
    """One random game of ``task_type`` in ``plan`` (None when the room cannot host that task type)."""
    candidates = task_candidates(plan, task_type)
    if not candidates:
        return None
    params = rng.choice(candidates)
    goals = _alfred()["goals"][task_type]
    template = rng.choice(goals["templates"])
    task_desc = template.format(obj=params.object_target.lower(), recep=params.parent_target.lower(),
                                toggle=params.toggle_target.lower(), mrecep="")

    objects = _place_objects(plan, params, rng)
    agent_location = _agent_start(plan, rng)
    problem = render_problem(f"S{seed}_{split}_{index:05d}", plan, objects, agent_location,
                             goals["pddl"].format(obj=params.object_target, recep=params.parent_target,
                                                  toggle=params.toggle_target, mrecep=""))
    steps = expert_steps(plan, params, objects, agent_location)
    return GameSpec(split, index, seed, plan.scene_num, params, task_desc, problem, steps)


def _place_objects(plan: FloorPlan, params: TaskParams, rng: random.Random) -> list[PlacedObject]:
    forbidden_for_target = {params.parent_target, TASK_APPLIANCE.get(params.task_type, "")}
    objects: list[PlacedObject] = []
    used_ids: set[str] = set()

    def place(otype: str, hosts: Sequence[Receptacle]) -> None:
        host = rng.choice(hosts)
        x, y, z = host.position
        while True:   # an object's id spells its position: somewhere on its receptacle
            position = (x + round(rng.uniform(-0.3, 0.3), 2), y, z + round(rng.uniform(-0.3, 0.3), 2))
            alfred_id = "|".join([otype, *map(_fmt, position)])
            if alfred_id not in used_ids:
                break
        used_ids.add(alfred_id)
        objects.append(PlacedObject(alfred_id, otype, host))

    for otype in plan.object_types:
        hosts = [r for r in plan.receptacles if _can_contain(r.rtype, otype)]
        if otype == params.object_target:
            hosts = [r for r in hosts if r.rtype not in forbidden_for_target]
            low = 2 if params.task_type == "pick_two_obj_and_place" else 1
            count = rng.randint(low, MAX_TARGET_INSTANCES)
        else:
            count = rng.randint(1, MAX_INSTANCES)
        if not hosts:
            continue
        for _ in range(count):
            place(otype, hosts)
    if plan.has_desk_lamp:
        place("DeskLamp", [r for r in plan.receptacles if r.rtype in LAMP_HOSTS])
    return objects


def _agent_start(plan: FloorPlan, rng: random.Random) -> str:
    taken = {r.location for r in plan.receptacles}
    while True:
        x, z = rng.choice(plan.floor_points)
        location = _location(x, z, 90 * rng.randrange(4), 30)
        if location not in taken:
            return location


def render_problem(name: str, plan: FloorPlan, objects: Sequence[PlacedObject], agent_location: str,
                   goal: str) -> str:
    """A PDDL problem in the layout of ALFWorld's ``initial_state.pddl`` (augment_pddl_states.py)."""
    alfred = _alfred()
    constants = alfred["constants"]
    receptacles = sorted(plan.receptacles, key=lambda r: r.alfred_id)
    objects = sorted(objects, key=lambda o: o.alfred_id)
    locations = sorted({r.location for r in receptacles} | {agent_location})
    scene_object_types = {o.otype for o in objects}

    decl = ["agent1 - agent"]
    decl += [f"{t}Type - otype" for t in alfred["otypes"]]
    decl += [f"{t}Type - rtype" for t in alfred["rtypes"]]
    decl += [f"{mangle(o.alfred_id)} - object" for o in objects]
    decl += [f"{mangle(r.alfred_id)} - receptacle" for r in receptacles]
    decl += [f"{mangle(loc)} - location" for loc in locations]

    init = [f"(receptacleType {mangle(r.alfred_id)} {r.rtype}Type)" for r in receptacles]
    init += [f"(objectType {mangle(o.alfred_id)} {o.otype}Type)" for o in objects]
    for rtype in sorted(plan.receptacle_types):
        init += [f"(canContain {rtype}Type {o}Type)"
                 for o in sorted(constants.VAL_RECEPTACLE_OBJECTS.get(rtype, ())) if o in scene_object_types]
    init += [f"(pickupable {mangle(o.alfred_id)})" for o in objects if o.otype in alfred["pickupable"]]
    init += [f"(isReceptacleObject {mangle(o.alfred_id)})" for o in objects
             if o.otype in constants.MOVABLE_RECEPTACLES_SET]
    init += [f"(openable {mangle(r.alfred_id)})" for r in receptacles if r.openable]
    init.append(f"(atLocation agent1 {mangle(agent_location)})")
    for predicate, prop in _PROPERTY_PREDICATES:
        init += [f"({predicate} {mangle(o.alfred_id)})" for o in objects if _has_property(o.otype, prop)]
    init += [f"(inReceptacle {mangle(o.alfred_id)} {mangle(o.receptacle.alfred_id)})" for o in objects]
    init += [f"(receptacleAtLocation {mangle(r.alfred_id)} {mangle(r.location)})" for r in receptacles]
    init += [f"(objectAtLocation {mangle(o.alfred_id)} {mangle(o.receptacle.location)})" for o in objects]

    # goal_library's PDDL uses '#' for the type dash and closes the (define ...) form itself.
    goal_text = "\n".join(line.strip() for line in goal.replace("#", "-").strip().splitlines())
    lines = [f"(define (problem plan_{name})", "(:domain alfred)", "(:objects", *decl, ")", "(:init", *init, ")",
             goal_text]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------- expert


_COMMAND_TEMPLATES = {
    "go": "go to {0}", "open": "open {0}", "take": "take {0} from {1}", "move": "move {0} to {1}",
    "heat": "heat {0} with {1}", "cool": "cool {0} with {1}", "clean": "clean {0} with {1}", "use": "use {0}",
}
_APPLIANCE_VERB = {"pick_clean_then_place_in_recep": "clean", "pick_heat_then_place_in_recep": "heat",
                   "pick_cool_then_place_in_recep": "cool"}


class _Route:
    """Expands high-level moves into engine steps, tracking where the agent is and what is open."""

    def __init__(self, agent_location: str) -> None:
        self.location = agent_location
        self.opened: set[str] = set()
        self.steps: list[tuple[str, ...]] = []

    def reach(self, receptacle: Receptacle, *, needs_open: bool) -> None:
        if self.location != receptacle.location:     # receptacles sharing a pose need no second "go to"
            self.steps.append(("go", receptacle.alfred_id))
            self.location = receptacle.location
        if needs_open and receptacle.openable and receptacle.alfred_id not in self.opened:
            self.steps.append(("open", receptacle.alfred_id))
            self.opened.add(receptacle.alfred_id)

    def take(self, obj: PlacedObject) -> "_Route":
        self.reach(obj.receptacle, needs_open=True)
        self.steps.append(("take", obj.alfred_id, obj.receptacle.alfred_id))
        return self

    def put(self, obj: PlacedObject, receptacle: Receptacle) -> "_Route":
        self.reach(receptacle, needs_open=True)
        self.steps.append(("move", obj.alfred_id, receptacle.alfred_id))
        return self

    def apply(self, verb: str, obj: PlacedObject, appliance: Receptacle) -> "_Route":
        self.reach(appliance, needs_open=False)     # Clean/Heat/CoolObject do not need the door open
        self.steps.append((verb, obj.alfred_id, appliance.alfred_id))
        return self

    def use(self, lamp: PlacedObject) -> "_Route":
        self.reach(lamp.receptacle, needs_open=False)
        self.steps.append(("use", lamp.alfred_id))
        return self


def expert_steps(plan: FloorPlan, params: TaskParams, objects: Sequence[PlacedObject],
                 agent_location: str) -> tuple[tuple[str, ...], ...]:
    """A shortest solution, found by enumerating which target, appliance and goal receptacle to use.

    The generator knows where everything is, so this is exact for the game's initial state: like the
    PDDL planner with unit costs, but in milliseconds (the planner needs 2-30 s per kitchen game).
    Ties are broken by the ids involved, so the result is deterministic.
    """
    targets = [o for o in objects if o.otype == params.object_target]
    parents = plan.receptacles_of(params.parent_target) if params.parent_target else ()
    routes: list[_Route] = []
    if params.task_type == "pick_and_place_simple":
        routes = [_Route(agent_location).take(o).put(o, p) for o in targets for p in parents]
    elif params.task_type == "pick_two_obj_and_place":
        routes = [_Route(agent_location).take(a).put(a, p).take(b).put(b, p)
                  for a in targets for b in targets if a is not b for p in parents]
    elif params.task_type in _APPLIANCE_VERB:
        verb = _APPLIANCE_VERB[params.task_type]
        appliances = plan.receptacles_of(TASK_APPLIANCE[params.task_type])
        routes = [_Route(agent_location).take(o).apply(verb, o, a).put(o, p)
                  for o in targets for a in appliances for p in parents]
    elif params.task_type == "look_at_obj_in_light":
        lamps = [o for o in objects if o.otype == params.toggle_target]
        routes = [_Route(agent_location).take(o).use(lamp) for o in targets for lamp in lamps]
    if not routes:
        raise ValueError(f"no solution for {params} (no target, receptacle or appliance in the room)")
    best = min(routes, key=lambda route: (len(route.steps), route.steps))
    return tuple(best.steps)


# ------------------------------------------------------------------------------------------ verifying


_WORKER_ENGINE: AlfredEngine | None = None


def _engine(engine: AlfredEngine | None) -> AlfredEngine:
    global _WORKER_ENGINE
    if engine is not None:
        return engine
    if _WORKER_ENGINE is None:
        _WORKER_ENGINE = AlfredEngine()
    return _WORKER_ENGINE


def entity_names(game_state: Mapping[str, Any]) -> dict[str, str]:
    """ALFRED id → the name the engine shows ("Cabinet|+00.68|+00.50|-02.20" → "cabinet 3")."""
    infos = game_state["_entity_infos"]
    return {key: info.name.strip() for key, info in infos.items()}


def replay_walkthrough(game_data: Mapping[str, Any], steps: Sequence[tuple[str, ...]], *,
                       engine: AlfredEngine | None = None) -> tuple[list[str] | None, str]:
    """Play ``steps`` on the real engine; returns (commands, "") if the game is won exactly at the last
    step with every command admissible and not won before, else (None, reason)."""
    engine = _engine(engine)
    try:
        engine.expert_plan = False
        engine.load(game_data)
        state = engine.reset()
        if state["won"]:
            return None, "won at reset"
        names = entity_names(state)
        commands = []
        for number, (verb, *ids) in enumerate(steps):
            try:
                command = _COMMAND_TEMPLATES[verb].format(*(names[mangle(i).lower()] for i in ids))
            except KeyError as exc:
                return None, f"step {number} {verb} {ids}: unknown verb or entity {exc}"
            if command not in admissible_actions(state):
                return None, f"step {number} {command!r} is not admissible"
            state, _, _ = engine.step(command)
            commands.append(command)
            if bool(state["won"]) != (number == len(steps) - 1):
                return None, f"won={state['won']} after step {number} of {len(steps)}"
        return commands, ""
    except EnvError as exc:
        return None, f"engine error: {exc}"


def planner_walkthrough(game_data: Mapping[str, Any], *, engine: AlfredEngine | None = None) -> list[str]:
    """TextWorld's PDDL planner (fast-downward) solution from the initial state ([] if none). Slow on big
    rooms (seconds to tens of seconds); the generator uses it only to cross-check the expert."""
    engine = _engine(engine)
    engine.expert_plan = True
    try:
        engine.load(game_data)
        return list(engine.reset()["policy_commands"])
    finally:
        engine.expert_plan = False


def _verify_job(job: tuple[int, dict[str, Any], tuple[tuple[str, ...], ...]]) -> tuple[int, list[str] | None, str]:
    slot, game_data, steps = job
    commands, reason = replay_walkthrough(game_data, steps)
    return slot, commands, reason


# ---------------------------------------------------------------------------------------- generation


@dataclasses.dataclass(frozen=True)
class GeneratedGame:
    spec: GameSpec
    walkthrough: tuple[str, ...]


class _Sampler:
    """Deterministic sampling of game slots with distinct initial states across all splits."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.keys: set[str] = set()
        self._eligible: dict[tuple[str, str], list[FloorPlan]] = {}

    def eligible(self, split: str, task_type: str) -> list[FloorPlan]:
        key = (split, task_type)
        if key not in self._eligible:
            plans = [load_floor_plan(n) for n in split_floor_plans(split)]
            self._eligible[key] = [p for p in plans if task_candidates(p, task_type)]
            if not self._eligible[key]:
                raise ValueError(f"no floor plan of split {split!r} can host {task_type}")
        return self._eligible[key]

    def sample(self, split: str, index: int, attempt: int) -> tuple[GameSpec, int]:
        """The game of a slot from its ``attempt``-th draw on, and the next attempt number."""
        task_type = TASK_TYPES[index % len(TASK_TYPES)]
        while attempt < MAX_ATTEMPTS:
            rng = random.Random(f"jaxopd-alfworld/v{GENERATOR_VERSION}/{self.seed}/{split}/{index}/{attempt}")
            plan = rng.choice(self.eligible(split, task_type))
            spec = sample_game(plan, task_type, rng, split=split, index=index, seed=self.seed)
            attempt += 1
            if spec is not None and spec.state_key not in self.keys:
                self.keys.add(spec.state_key)
                return spec, attempt
        raise RuntimeError(f"could not sample a new {task_type} game for {split}[{index}] "
                           f"in {MAX_ATTEMPTS} attempts")


def check_counts(counts: Mapping[str, int] | None) -> dict[str, int]:
    """``counts`` (split -> number of games; None: the defaults) checked: known splits, non-negative ints
    (``True`` is not 1 game), not all zero."""
    if counts is None:
        return dict(DEFAULT_COUNTS)
    if not isinstance(counts, Mapping):
        raise ValueError(f"counts must map split -> number of games, got {type(counts).__name__}")
    checked = {}
    for split, n in counts.items():
        if split not in ALFWORLD_SPLITS:
            raise ValueError(f"unknown ALFWorld split {split!r}; expected one of {ALFWORLD_SPLITS}")
        checked[split] = require_int(n, f"number of {split} games", minimum=0)
    if sum(checked.values()) == 0:
        raise ValueError("asked to generate zero ALFWorld games")
    return checked


def generate_games(out_dir: str | os.PathLike, *, seed: int = 0, counts: Mapping[str, int] | None = None,
                   workers: int | None = None, max_walkthrough: int = DEFAULT_MAX_WALKTHROUGH,
                   progress: bool = True) -> list[GeneratedGame]:
    """Author, verify and write games; ``counts`` maps split → number of games (task types round-robin).

    Games are distinct by initial state (and goal) across all splits. A game whose walkthrough fails
    replay or exceeds ``max_walkthrough`` steps is resampled (deterministically, in slot order).

    Writes into a temporary sibling folder and renames it to ``out_dir`` when complete (which must not
    exist yet), so a partial tree is never mistaken for a cache.
    """
    counts = check_counts(counts)
    max_walkthrough = require_int(max_walkthrough, "max_walkthrough", minimum=1)
    out_dir = Path(out_dir).expanduser()
    if out_dir.exists():
        raise ValueError(f"output folder {str(out_dir)!r} already exists")

    sampler = _Sampler(seed)
    slots = [(split, i) for split in ALFWORLD_SPLITS for i in range(counts.get(split, 0))]
    specs: dict[int, GameSpec] = {}
    attempts: dict[int, int] = {}
    for slot, (split, index) in enumerate(slots):
        specs[slot], attempts[slot] = sampler.sample(split, index, 0)

    walkthroughs: dict[int, list[str]] = {}
    pending = list(range(len(slots)))
    resampled = 0
    bar = _ProgressBar(len(slots), progress)
    try:
        with _SolverPool(workers, len(slots)) as solve_many:
            while pending:
                jobs = [(slot, specs[slot].game_data(None), specs[slot].expert_steps) for slot in pending
                        if len(specs[slot].expert_steps) <= max_walkthrough]
                failed = [slot for slot in pending if len(specs[slot].expert_steps) > max_walkthrough]
                resampled += len(failed)
                for slot, plan, reason in solve_many(jobs):
                    if plan is None:
                        logger.info("resampling %s[%d]: %s", *slots[slot], reason)
                        failed.append(slot)
                        resampled += 1
                    else:
                        walkthroughs[slot] = plan
                        bar.update(1)
                # resample failures in slot order: the result does not depend on worker scheduling
                pending = []
                for slot in sorted(failed):
                    split, index = slots[slot]
                    sampler.keys.discard(specs[slot].state_key)
                    specs[slot], attempts[slot] = sampler.sample(split, index, attempts[slot])
                    pending.append(slot)
    finally:
        bar.close()

    games = [GeneratedGame(specs[s], tuple(walkthroughs[s])) for s in range(len(slots))]
    _write_tree(out_dir, games, seed=seed, counts=counts, max_walkthrough=max_walkthrough, resampled=resampled)
    return games


class _ProgressBar:
    def __init__(self, total: int, enabled: bool) -> None:
        self._bar = None
        if enabled:
            from tqdm import tqdm
            self._bar = tqdm(total=total, desc="ALFWorld games", unit="game")

    def update(self, n: int) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


class _SolverPool:
    """Context manager yielding ``solve_many(jobs) -> iterable of (slot, plan, reason)``."""

    def __init__(self, workers: int | None, num_jobs: int) -> None:
        if workers is None:
            workers = min(os.cpu_count() or 1, 8)
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.workers = min(workers, max(num_jobs, 1))
        self._executor = None

    def __enter__(self) -> Callable[[list], Iterable]:
        if self.workers == 1:
            return lambda jobs: map(_verify_job, jobs)
        # spawn: the parent may hold JAX or other threads that make fork unsafe
        self._executor = concurrent.futures.ProcessPoolExecutor(
            max_workers=self.workers, mp_context=multiprocessing.get_context("spawn"), initializer=worker_init,
            initargs=(os.getpid(),))
        return lambda jobs: self._executor.map(_verify_job, jobs, chunksize=4)

    def __exit__(self, *exc) -> None:
        if self._executor is not None:
            self._executor.shutdown(cancel_futures=True)


def _write_tree(out_dir: Path, games: Sequence[GeneratedGame], *, seed: int, counts: Mapping[str, int],
                max_walkthrough: int, resampled: int) -> None:
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    data_dir = tmp / DATA_SUBDIR
    index_games = []
    for game in games:
        spec = game.spec
        game_dir = data_dir / spec.split / spec.relative_dir
        game_dir.mkdir(parents=True)
        (game_dir / TRAJ_FILE).write_text(json.dumps(spec.traj_data(), indent=2, sort_keys=True) + "\n")
        (game_dir / "initial_state.pddl").write_text(spec.pddl_problem)
        (game_dir / GAME_FILE).write_text(json.dumps(spec.game_data(game.walkthrough)))
        index_games.append({"split": spec.split, "relative_dir": spec.relative_dir,
                            "task_type": spec.params.task_type, "floor_plan": spec.floor_plan,
                            "walkthrough_steps": len(game.walkthrough), "state_key": spec.state_key})
    index = {"generator_version": GENERATOR_VERSION, "seed": seed, "counts": dict(counts),
             "max_walkthrough": max_walkthrough, "alfworld_version": _package_version("alfworld"),
             "textworld_version": _package_version("textworld"), "resampled_after_verification": resampled,
             "games": index_games}
    (tmp / INDEX_FILE).write_text(json.dumps(index, indent=1) + "\n")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    try:
        tmp.rename(out_dir)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out_dir / INDEX_FILE).is_file():
            raise


def _package_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "unknown"


# --------------------------------------------------------------------------------------------- cache


def cache_base(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where generated game trees live: ``cache_dir``, else ``$JAXOPD_CACHE/alfworld_games``, else
    ``~/.cache/jaxopd/alfworld_games``."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    if os.environ.get(CACHE_ENV_VAR):
        return Path(os.environ[CACHE_ENV_VAR]).expanduser() / "alfworld_games"
    return Path.home() / ".cache" / "jaxopd" / "alfworld_games"


def version_hash(*, seed: int, counts: Mapping[str, int], max_walkthrough: int) -> str:
    """Names a generated tree by everything its bytes depend on."""
    alfred = _alfred()
    key = {"generator_version": GENERATOR_VERSION, "seed": seed,
           "counts": {s: int(counts.get(s, 0)) for s in ALFWORLD_SPLITS}, "max_walkthrough": max_walkthrough,
           "alfworld": _package_version("alfworld"), "textworld": _package_version("textworld"),
           "domain": hashlib.sha256(alfred["domain"].encode()).hexdigest(),
           "grammar": hashlib.sha256(alfred["grammar"].encode()).hexdigest()}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def ensure_games(cache_dir: str | os.PathLike | None = None, *, seed: int = 0,
                 counts: Mapping[str, int] | None = None, workers: int | None = None,
                 max_walkthrough: int = DEFAULT_MAX_WALKTHROUGH, progress: bool = True) -> Path:
    """The root of a generated game tree for this configuration, generating it on first use."""
    counts = check_counts(counts)
    max_walkthrough = require_int(max_walkthrough, "max_walkthrough", minimum=1)
    root = cache_base(cache_dir) / version_hash(seed=seed, counts=counts, max_walkthrough=max_walkthrough)
    if not (root / INDEX_FILE).is_file():
        if root.exists():   # an interrupted run cannot leave this (writes are renamed into place)
            raise ValueError(f"{str(root)!r} exists but has no {INDEX_FILE}; remove it")
        generate_games(root, seed=seed, counts=counts, workers=workers, max_walkthrough=max_walkthrough,
                       progress=progress)
    return root


def _describe(counts: Mapping[str, int]) -> str:
    return ", ".join(f"{n} {split}" for split, n in counts.items())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxopd_envs.alfworld_gen", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="output folder (default: the cache, see --cache-dir / $JAXOPD_CACHE)")
    parser.add_argument("--cache-dir", help="cache base folder used when --out is not given")
    parser.add_argument("--counts", choices=sorted(COUNT_SETS), default="environment",
                        help="the split sizes the --num flags default to: 'environment' "
                             f"({_describe(DEFAULT_COUNTS)}: AlfWorldEnv's own games, the main job's, the benchmarks') "
                             f"or 'training' ({_describe(TRAINING_COUNTS)}: experiments.train and "
                             "experiments.evaluate; with --num N the tree of "
                             "experiments.train --generated-train-games N)")
    parser.add_argument("--num", type=int, default=None, help="number of train games (default: from --counts)")
    parser.add_argument("--num-valid-seen", type=int, default=None, help="default: from --counts")
    parser.add_argument("--num-valid-unseen", type=int, default=None, help="default: from --counts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=None, help="planner processes (default: CPUs, max 8)")
    parser.add_argument("--max-walkthrough", type=int, default=DEFAULT_MAX_WALKTHROUGH)
    args = parser.parse_args(argv)
    given = {"train": args.num, "valid_seen": args.num_valid_seen, "valid_unseen": args.num_valid_unseen}
    counts = {split: COUNT_SETS[args.counts][split] if n is None else n for split, n in given.items()}
    start = time.perf_counter()
    if args.out:
        generate_games(args.out, seed=args.seed, counts=counts, workers=args.workers,
                       max_walkthrough=args.max_walkthrough)
        root = Path(args.out)
    else:
        root = ensure_games(args.cache_dir, seed=args.seed, counts=counts, workers=args.workers,
                            max_walkthrough=args.max_walkthrough)
    elapsed = time.perf_counter() - start
    total = sum(counts.values())
    print(f"{total} games in {root} ({_describe(counts)}; {elapsed:.1f} s, {elapsed / max(total, 1):.3f} s/game)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
