"""Consistent renaming of ALFWorld's object and receptacle classes in a demonstration's text.

An agent trained on a few hundred games learns which names go with which rooms ("a mug" in a kitchen) faster
than it learns to read the name its instruction asks for: a tiny SFT'd Qwen3 restated "put a clean bowl in
microwave" and went on "I need a mug." Renaming the classes of a demonstration consistently (every ``bowl``
of its instruction, observations, admissible actions and actions becomes, say, ``cd``) keeps the task, the
engine's logic and every copy relation intact while making the room's priors useless: the only way to the
right name is to copy it from the prompt. This is the data-side cure for in-context learning losing to
memorisation (Chan et al., 2022, "Data distributional properties drive emergent in-context learning").

Owns the class vocabularies that may be renamed (:func:`class_vocabularies`: ALFRED's classes from
``alfworld.gen.constants``, lower-cased as the engine writes them), the classes that never are
(``FIXED_CLASSES``: the tools whose class decides the command, ``clean``/``heat``/``cool`` and the lamps), and
:func:`rename_reference` / :func:`random_renaming`. The renamed text is training data only: it is never
played on the engine.
"""
from __future__ import annotations

import dataclasses
import functools
import re
import zlib
from typing import Callable, Mapping

import numpy as np

from jaxopd_envs.alfworld_state import CHANGE_TOOLS, parse_goal
from jaxopd_envs.references import ReferenceTrajectory
from jaxopd_envs.alfworld_import import import_alfworld

__all__ = ["FIXED_CLASSES", "class_vocabularies", "classes_in_reference", "random_renaming", "rename_reference",
           "rename_text"]

FIXED_CLASSES = frozenset({tool for _, tool in CHANGE_TOOLS.values()} | {"bathtubbasin", "desklamp", "floorlamp"})
"""Classes never renamed nor used as a new name: the receptacles that clean, heat or cool (the class decides the
command's verb and ``jaxopd_envs.alfworld_state.CHANGE_TOOLS`` names them), the other basin the engine cleans in, and
the lamps of look tasks."""


_LOOKALIKES = frozenset({"sink", "bathtub"})   # ALFRED object classes that read as a fixed tool ("sinkbasin")


@functools.lru_cache(maxsize=1)
def class_vocabularies() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The renameable ``(object classes, receptacle classes)``, sorted: ALFRED's object classes less the static
    receptacles, and its static receptacles (movable ones such as ``mug`` are objects), both less
    ``FIXED_CLASSES`` and the object classes that read as a fixed one. Read from the alfworld wheel once."""
    import_alfworld()
    import alfworld.gen.constants as constants

    movable = {name.lower() for name in constants.MOVABLE_RECEPTACLES}
    static = {name.lower() for name in constants.RECEPTACLES} - movable
    objects = {name.lower() for name in constants.OBJECTS} - static - FIXED_CLASSES - _LOOKALIKES
    return tuple(sorted(objects)), tuple(sorted(static - FIXED_CLASSES))


_NAMED = re.compile(r"\b([a-z]+) \d+\b")


def _reference_texts(reference: ReferenceTrajectory) -> list[str]:
    texts = [reference.instruction, *reference.observations, *reference.actions]
    for record in reference.records:
        texts.append(record.text)
        texts.extend(record.admissible_actions)
    return texts


def classes_in_reference(reference: ReferenceTrajectory) -> tuple[frozenset[str], frozenset[str]]:
    """The renameable object and receptacle classes a reference's text mentions: every ``name N`` of its
    observations, admissible actions and actions, and its instruction's goal classes."""
    objects, receptacles = class_vocabularies()
    found = {match.group(1) for text in _reference_texts(reference) for match in _NAMED.finditer(text.lower())}
    goal = parse_goal(reference.instruction) if reference.instruction else None
    if goal is not None:
        found |= {goal.obj} | ({goal.recep} if goal.recep else set())
    return frozenset(found & set(objects)), frozenset(found & set(receptacles))


def random_renaming(reference: ReferenceTrajectory, *, seed: int, copy: int = 0) -> dict[str, str]:
    """A random injective map of the reference's renameable classes (:func:`classes_in_reference`) onto classes of
    the same kind (objects to objects, receptacles to receptacles), drawn from ``(seed, copy, task id)`` only.
    Every mentioned class of a kind is in the map, so no new name collides with a name left as it was."""
    objects, receptacles = class_vocabularies()
    present_objects, present_receptacles = classes_in_reference(reference)
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), int(copy),
                                                        zlib.crc32(reference.task_id.encode())]))
    mapping: dict[str, str] = {}
    for present, pool in ((present_objects, objects), (present_receptacles, receptacles)):
        names = sorted(present)
        chosen = rng.choice(len(pool), size=len(names), replace=False)
        mapping.update({name: pool[int(index)] for name, index in zip(names, chosen)})
    return mapping


def _renamer(mapping: Mapping[str, str]) -> Callable[[str], str]:
    if not mapping:
        return lambda text: text
    pattern = re.compile(r"\b(" + "|".join(sorted(map(re.escape, mapping), key=len, reverse=True)) + r")\b")
    return lambda text: pattern.sub(lambda match: mapping[match.group(1)], text)


def rename_text(text: str, mapping: Mapping[str, str]) -> str:
    """``text`` with every whole-word class of ``mapping`` replaced at once (no chained replacement:
    ``{"apple": "egg", "egg": "apple"}`` swaps them)."""
    return _renamer(mapping)(text)


def rename_reference(reference: ReferenceTrajectory, mapping: Mapping[str, str], *, tag: str = "renamed"
                     ) -> ReferenceTrajectory:
    """A copy of ``reference`` whose instruction, observations, actions and records (text and admissible actions)
    say ``mapping[c]`` wherever they said class ``c``; its task id gains ``#{tag}`` and it keeps its records'
    flags. ``ValueError`` for a map that is not injective or touches a fixed class."""
    targets = list(mapping.values())
    if len(set(targets)) != len(targets):
        raise ValueError(f"a class renaming must be injective, got {dict(mapping)}")
    fixed = (set(mapping) | set(targets)) & FIXED_CLASSES
    if fixed:
        raise ValueError(f"the classes {sorted(fixed)} are never renamed (they decide the command)")
    rename = _renamer({key: value for key, value in mapping.items() if key != value})
    records = tuple(dataclasses.replace(record, text=rename(record.text),
                                        admissible_actions=tuple(map(rename, record.admissible_actions)))
                    for record in reference.records)
    return dataclasses.replace(
        reference, task_id=f"{reference.task_id}#{tag}", instruction=rename(reference.instruction),
        observations=tuple(map(rename, reference.observations)), actions=tuple(map(rename, reference.actions)),
        records=records)
