"""What an ALFWorld agent can read about its task from its own prompt: the goal, what it holds, what it sees.

Owns :class:`Goal` (task type and the object, receptacle and lamp classes of an instruction), parsed with the
alfworld wheel's own goal templates (``alfworld.gen.goal_library``, the text the games' instructions were
written from), and :func:`task_state`, the state an agent knows from the instruction, its executed actions with
the engine's answers, and the current observation: the goal object it holds, whether that object is now clean,
hot or cool, how many goal objects it has put in place, the goal objects (and lamps) in view, where it is, and the
object classes the engine just listed at an arrival or an opening (:func:`objects_listed`); and
``CHANGE_TOOLS``, the command verb and receptacle class that clean, heat or cool an object. Everything is read
from text the agent was shown; nothing comes from the game's hidden state. ``jaxopd.methods.sft_data``
writes it into the short thinking of SFT demonstrations.
"""
from __future__ import annotations

import dataclasses
import functools
import re
from typing import Sequence

from jaxopd_envs.alfworld_engine import REFUSED_FEEDBACK, TASK_TYPES
from jaxopd_envs.alfworld_import import import_alfworld

__all__ = ["ALFWORLD_GOAL_TYPES", "CHANGE_TOOLS", "INSTRUCTION_PREFIX", "Goal", "parse_goal", "TaskState",
           "task_state", "objects_in_view", "objects_listed"]

ALFWORLD_GOAL_TYPES = TASK_TYPES
"""The six task types of ALFWorld's games (``alfworld.gen.goal_library`` keys; owned by
``jaxopd_envs.alfworld_engine``)."""

INSTRUCTION_PREFIX = "your task is to:"
"""How ALFWorld instructions begin (lower-cased)."""
# The engine's answers that change what the agent holds or the held object's state (alfworld 0.4's wording).
_TAKEN = re.compile(r"^you pick up the (?P<name>[a-z]+ \d+) from the ")
_PUT = re.compile(r"^you (?:move|put) the (?P<name>[a-z]+ \d+) (?:to|in|on) the (?P<recep>[a-z]+) \d+")
_ARRIVED = re.compile(r"^you arrive at (?P<name>[a-z]+ \d+)\.")
_OPENED = re.compile(r"^you open the (?P<name>[a-z]+ \d+)\.")
_CLOSED = re.compile(r"^you close the (?P<name>[a-z]+ \d+)\.")
# what the engine lists on arriving at, or opening, a receptacle: "on the countertop 1, you see a apple 1, ..."
_LISTING = re.compile(r"^you (?:arrive at|open the) [a-z]+ \d+\..*?you see (?P<items>[^.]*)\.")
_CHANGED = {"clean": re.compile(r"^you clean the (?P<name>[a-z]+ \d+) using "),
            "hot": re.compile(r"^you heat the (?P<name>[a-z]+ \d+) using "),
            "cool": re.compile(r"^you cool the (?P<name>[a-z]+ \d+) using ")}
_CHANGE_OF = {"pick_clean_then_place_in_recep": "clean", "pick_heat_then_place_in_recep": "hot",
              "pick_cool_then_place_in_recep": "cool"}
CHANGE_TOOLS = {"clean": ("clean", "sinkbasin"), "hot": ("heat", "microwave"), "cool": ("cool", "fridge")}
"""For each state a goal object must reach, the verb of the command that makes it and the receptacle class it is
usually made with (alfworld 0.4's ``clean X with sinkbasin 1``, ``heat X with microwave 1``, ``cool X with fridge
1``; the searching expert's 1,076 such commands on the generated games use these, bar 4 cleans in a bathtubbasin)."""


@dataclasses.dataclass(frozen=True)
class Goal:
    """An instruction's task type and classes: ``obj`` to find, ``recep`` to put it in (None for look tasks),
    ``toggle`` the lamp (look tasks only); ``instruction``: the text it was parsed from, stripped, as the prompt
    shows it (None for a goal read from a task id; not compared)."""

    task_type: str
    obj: str
    recep: str | None = None
    toggle: str | None = None
    instruction: str | None = dataclasses.field(default=None, compare=False)

    @property
    def count(self) -> int:
        """How many ``obj`` the task puts in place."""
        return 2 if self.task_type == "pick_two_obj_and_place" else 1

    @property
    def change(self) -> str | None:
        """The state the object must reach before it is put: ``clean``, ``hot``, ``cool`` or None."""
        return _CHANGE_OF.get(self.task_type)

    @property
    def tool(self) -> tuple[str, str] | None:
        """The verb and receptacle class that make :attr:`change` (``("cool", "fridge")``), or None."""
        return CHANGE_TOOLS.get(self.change) if self.change else None


@functools.lru_cache(maxsize=1)
def _goal_patterns() -> tuple[tuple[str, re.Pattern], ...]:
    import_alfworld()
    from alfworld.gen.goal_library import gdict

    patterns = []
    for task_type in ALFWORLD_GOAL_TYPES:
        for template in gdict[task_type]["templates"]:
            regex = re.escape(template.lower())
            for slot in ("obj", "recep", "toggle"):
                regex = regex.replace(re.escape("{" + slot + "}"), f"(?P<{slot}>[a-z]+)")
            patterns.append((task_type, re.compile(f"^{regex}\\.?$")))
    return tuple(patterns)


def parse_goal(instruction: str) -> Goal | None:
    """The goal of an ALFWorld instruction (``"Your task is to: heat some egg and put it in fridge."``), or None when
    it matches none of the six task types' templates."""
    if not isinstance(instruction, str):
        raise ValueError(f"instruction must be a str, got {type(instruction).__name__}")
    text = " ".join(instruction.lower().split())
    if text.startswith(INSTRUCTION_PREFIX):
        text = text[len(INSTRUCTION_PREFIX):].strip()
    for task_type, pattern in _goal_patterns():
        match = pattern.match(text)
        if match:
            slots = match.groupdict()
            return Goal(task_type, slots["obj"], slots.get("recep"), slots.get("toggle"),
                        instruction=instruction.strip())
    return None


def objects_in_view(observation: str, object_class: str) -> list[str]:
    """The named objects of ``object_class`` (``"apple 4"``) an observation mentions, in order, each once."""
    found = re.findall(rf"\b{re.escape(object_class.lower())} \d+\b", observation.lower())
    return list(dict.fromkeys(found))


def objects_listed(observation: str) -> tuple[str, ...] | None:
    """The object classes an arrival or an opening lists, in order, each once (``("apple", "cup")`` for "You arrive
    at countertop 1. On the countertop 1, you see a apple 1, a cup 2, and a apple 3."; ``()`` for "... you see
    nothing."); None for any other observation (a closed receptacle, the room's description, a take)."""
    listing = _LISTING.match(" ".join(observation.lower().split()))
    if listing is None:
        return None
    return tuple(dict.fromkeys(re.findall(r"\b([a-z]+) \d+\b", listing.group("items"))))


@dataclasses.dataclass(frozen=True)
class TaskState:
    """What the agent knows at a turn: ``held`` (the goal object in hand, e.g. ``"apple 4"``, or None),
    ``changed`` (whether the held object has reached the goal's state: cleaned, heated or cooled), ``placed`` (goal
    objects put in the goal receptacle so far), ``in_view`` (goal objects the current observation names, less the
    held and the placed ones) and
    ``lamps_in_view`` (look tasks: the lamps it names); ``location`` (the receptacle of the last ``go to`` the
    engine answered with an arrival, None before) and ``location_closed`` (the engine said it is closed, and it
    was not opened since); ``listed`` (the object classes the current observation lists at an arrival or an
    opening, :func:`objects_listed`; None when it lists none); ``refused`` (the last executed command when the
    engine refused it, answering ``REFUSED_FEEDBACK``: ``"go to drawer 4"``; None otherwise)."""

    goal: Goal
    held: str | None
    changed: bool
    placed: int
    in_view: tuple[str, ...]
    lamps_in_view: tuple[str, ...] = ()
    location: str | None = None
    location_closed: bool = False
    listed: tuple[str, ...] | None = None
    refused: str | None = None


def task_state(goal: Goal, actions: Sequence[str], answers: Sequence[str], observation: str) -> TaskState:
    """The :class:`TaskState` after the executed ``actions``, ``answers[i]`` being the engine's text after
    ``actions[i]``, in the state whose text is ``observation``."""
    if len(actions) != len(answers):
        raise ValueError(f"{len(actions)} actions but {len(answers)} answers")
    held: str | None = None
    changed_objects: set[str] = set()
    placed: list[str] = []
    location, closed = None, False
    for answer in answers:
        text = " ".join(answer.lower().split())
        arrived = _ARRIVED.match(text)
        if arrived:
            location = arrived.group("name")
            closed = f"the {location} is closed" in text
            continue
        for pattern, now_closed in ((_OPENED, False), (_CLOSED, True)):
            toggled = pattern.match(text)
            if toggled and toggled.group("name") == location:
                closed = now_closed
        taken = _TAKEN.match(text)
        if taken:
            name = taken.group("name")
            held = name if name.split()[0] == goal.obj else None
            continue
        put = _PUT.match(text)
        if put:
            name = put.group("name")
            if name == held:
                held = None
                if goal.recep is not None and put.group("recep") == goal.recep:
                    placed.append(name)
            continue
        if goal.change is not None:
            change = _CHANGED[goal.change].match(text)
            if change:
                changed_objects.add(change.group("name"))
    lamps = tuple(objects_in_view(observation, goal.toggle)) if goal.toggle else ()
    return TaskState(goal=goal, held=held, changed=held is not None and held in changed_objects, placed=len(placed),
                     in_view=tuple(name for name in objects_in_view(observation, goal.obj)
                                   if name != held and name not in placed),
                     lamps_in_view=lamps, location=location, location_closed=closed,
                     listed=objects_listed(observation),
                     refused=actions[-1] if actions and answers[-1].strip() == REFUSED_FEEDBACK else None)
