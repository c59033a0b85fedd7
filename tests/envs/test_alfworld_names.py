"""Consistent class renaming of ALFWorld demonstrations (jaxopd_envs.alfworld_names), on a hand-written cool task."""
import pytest

pytest.importorskip("alfworld")

from jaxopd_envs.alfworld_names import (FIXED_CLASSES, class_vocabularies, classes_in_reference, random_renaming,
                                        rename_reference, rename_text)
from jaxopd_envs.references import ReferenceObservation, ReferenceTrajectory
from jaxopd.methods.sft_data import _state_of, task_plan_here_text, walkthrough_turns

OBJECT_CLASSES, RECEPTACLE_CLASSES = class_vocabularies()

INSTRUCTION = "Your task is to: cool some apple and put it in garbagecan."
OBSERVATIONS = (
    "You are in the middle of a room. Looking quickly around you, you see a countertop 1, a fridge 1, "
    "and a garbagecan 1.",
    "You arrive at countertop 1. On the countertop 1, you see a apple 2, a egg 1, and a mug 3.",
    "You pick up the apple 2 from the countertop 1.",
    "You arrive at fridge 1. The fridge 1 is closed.",
    "You cool the apple 2 using the fridge 1.",
)
ACTIONS = ("go to countertop 1", "take apple 2 from countertop 1", "go to fridge 1", "cool apple 2 with fridge 1")
ADMISSIBLE = (
    ("go to countertop 1", "go to fridge 1", "go to garbagecan 1", "look"),
    ("take apple 2 from countertop 1", "take egg 1 from countertop 1", "take mug 3 from countertop 1", "look"),
    ("go to fridge 1", "move apple 2 to countertop 1", "look"),
    ("cool apple 2 with fridge 1", "open fridge 1", "look"),
    ("go to garbagecan 1", "look"),
)


def cool_task() -> ReferenceTrajectory:
    records = tuple(ReferenceObservation(text=text, admissible_actions=admissible)
                    for text, admissible in zip(OBSERVATIONS, ADMISSIBLE))
    return ReferenceTrajectory(task_id="alfworld/train/cool-apple/trial_1", actions=ACTIONS,
                               observations=OBSERVATIONS, benchmark="alfworld",
                               task_type="pick_cool_then_place_in_recep", instruction=INSTRUCTION, records=records)


def test_vocabularies_are_disjoint_and_keep_the_tools_out():
    objects, receptacles = set(OBJECT_CLASSES), set(RECEPTACLE_CLASSES)
    assert {"apple", "mug", "bowl", "cd", "remotecontrol"} <= objects
    assert {"countertop", "garbagecan", "drawer", "sofa"} <= receptacles
    assert not objects & receptacles
    assert not (objects | receptacles) & (FIXED_CLASSES | {"sink", "bathtub"})
    assert {"fridge", "microwave", "sinkbasin", "desklamp"} <= FIXED_CLASSES


def test_rename_text_is_simultaneous_and_whole_word():
    swap = {"apple": "egg", "egg": "apple", "pen": "cd"}
    assert rename_text("a apple 2, a egg 1, a pencil 1 and a pen 3", swap) == \
        "a egg 2, a apple 1, a pencil 1 and a cd 3"
    assert rename_text("applesliced 1 stays", swap) == "applesliced 1 stays"
    assert rename_text("unchanged", {}) == "unchanged"


def test_classes_in_reference_reads_every_named_class_and_the_goal():
    objects, receptacles = classes_in_reference(cool_task())
    assert objects == {"apple", "egg", "mug"}
    assert receptacles == {"countertop", "garbagecan"}      # the fridge is a fixed tool


def test_renamed_reference_is_consistent_everywhere():
    mapping = {"apple": "cd", "egg": "apple", "mug": "egg", "countertop": "sofa", "garbagecan": "drawer"}
    renamed = rename_reference(cool_task(), mapping, tag="renamed1")
    assert renamed.task_id == "alfworld/train/cool-apple/trial_1#renamed1"
    assert renamed.instruction == "Your task is to: cool some cd and put it in drawer."
    assert renamed.actions == ("go to sofa 1", "take cd 2 from sofa 1", "go to fridge 1", "cool cd 2 with fridge 1")
    assert renamed.observations[1] == "You arrive at sofa 1. On the sofa 1, you see a cd 2, a apple 1, and a egg 3."
    assert renamed.records[1].admissible_actions[:2] == ("take cd 2 from sofa 1", "take apple 1 from sofa 1")
    assert [r.text for r in renamed.records] == list(renamed.observations)
    # the rule's thinking follows the renamed goal: the cool at the fridge, now with a cd
    turn = walkthrough_turns(renamed)[3]
    assert task_plan_here_text(_state_of(turn.inputs, "task-plan-here")) == (
        "Your task is to: cool some cd and put it in drawer. I hold cd 2. I must cool it with a fridge. "
        "I am at fridge 1. It is closed. I can cool it here.")
    # and every action stays among its state's admissible actions
    for action, record in zip(renamed.actions, renamed.records):
        assert action in record.admissible_actions


def test_random_renaming_is_seeded_injective_and_kind_preserving():
    reference = cool_task()
    first = random_renaming(reference, seed=0, copy=1)
    assert first == random_renaming(reference, seed=0, copy=1)
    assert set(first) == {"apple", "egg", "mug", "countertop", "garbagecan"}
    assert len(set(first.values())) == len(first)
    assert all(first[name] in OBJECT_CLASSES for name in ("apple", "egg", "mug"))
    assert all(first[name] in RECEPTACLE_CLASSES for name in ("countertop", "garbagecan"))
    draws = {tuple(sorted(random_renaming(reference, seed=0, copy=c).items())) for c in range(1, 6)}
    assert len(draws) == 5                                   # copies differ


def test_bad_renamings_are_refused():
    with pytest.raises(ValueError, match="injective"):
        rename_reference(cool_task(), {"apple": "cd", "egg": "cd"})
    with pytest.raises(ValueError, match="never renamed"):
        rename_reference(cool_task(), {"apple": "fridge"})
