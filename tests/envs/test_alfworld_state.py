"""``jaxopd_envs.alfworld_state``: goals parsed with the alfworld wheel's templates, and the task state read from the
executed actions and the engine's answers (hand-written episodes in alfworld 0.4's wording)."""
from __future__ import annotations

import pytest

from jaxopd_envs.alfworld_state import (ALFWORLD_GOAL_TYPES, Goal, objects_in_view, objects_listed, parse_goal,
                                        task_state)

pytest.importorskip("alfworld")


@pytest.mark.parametrize("instruction, goal", [
    ("Your task is to: put some book on bed.", Goal("pick_and_place_simple", "book", "bed")),
    ("Your task is to: put a cellphone in sofa.", Goal("pick_and_place_simple", "cellphone", "sofa")),
    ("Your task is to: look at cd under the desklamp.", Goal("look_at_obj_in_light", "cd", None, "desklamp")),
    ("Your task is to: examine the pillow with the desklamp.",
     Goal("look_at_obj_in_light", "pillow", None, "desklamp")),
    ("Your task is to: clean some apple and put it in microwave.",
     Goal("pick_clean_then_place_in_recep", "apple", "microwave")),
    ("Your task is to: put a clean cloth in toilet.", Goal("pick_clean_then_place_in_recep", "cloth", "toilet")),
    ("Your task is to: heat some egg and put it in fridge.", Goal("pick_heat_then_place_in_recep", "egg", "fridge")),
    ("Your task is to: put a hot bread in garbagecan.",
     Goal("pick_heat_then_place_in_recep", "bread", "garbagecan")),
    ("Your task is to: cool some potato and put it in sinkbasin.",
     Goal("pick_cool_then_place_in_recep", "potato", "sinkbasin")),
    ("Your task is to: put a cool mug in cabinet.", Goal("pick_cool_then_place_in_recep", "mug", "cabinet")),
    ("Your task is to: find two vase and put them in shelf.", Goal("pick_two_obj_and_place", "vase", "shelf")),
    ("Your task is to: put two creditcard in desk.", Goal("pick_two_obj_and_place", "creditcard", "desk")),
    ("  put   two creditcard in desk ", Goal("pick_two_obj_and_place", "creditcard", "desk")),
])
def test_parse_goal_every_template(instruction, goal):
    assert parse_goal(instruction) == goal
    assert goal.task_type in ALFWORLD_GOAL_TYPES


def test_parse_goal_unknown_and_bad_input():
    assert parse_goal("Your task is to: slice the apple.") is None
    assert parse_goal("") is None
    with pytest.raises(ValueError, match="must be a str"):
        parse_goal(None)
    assert Goal("pick_two_obj_and_place", "vase", "shelf").count == 2
    assert Goal("pick_heat_then_place_in_recep", "egg", "fridge").change == "hot"
    assert Goal("pick_and_place_simple", "egg", "fridge").change is None


def test_objects_in_view():
    text = "On the countertop 1, you see a apple 4, a pineapple 1, a apple 11, and a apple 4."
    assert objects_in_view(text, "apple") == ["apple 4", "apple 11"]
    assert objects_in_view("You arrive at drawer 1. The drawer 1 is closed.", "apple") == []


def test_objects_listed():
    """The classes an arrival or an opening lists, in order and each once; spacing and case do not matter; other
    observations (a take, a closed receptacle, the room's description) list nothing (None), an empty one ()."""
    assert objects_listed("You arrive at countertop 1. On the countertop 1, you see a apple 4, a pineapple 1, a "
                          "apple 11, and a cup 2.") == ("apple", "pineapple", "cup")
    assert objects_listed("You open the Drawer 1.  The drawer 1 is open. In it, you see a pen 1,\nand a pen 2.") \
        == ("pen",)
    assert objects_listed("You open the drawer 1. The drawer 1 is open. In it, you see nothing.") == ()
    assert objects_listed("You pick up the mug 2 from the countertop 1.") is None
    assert objects_listed("You arrive at drawer 1. The drawer 1 is closed.") is None
    assert objects_listed("You are in the middle of a room. Looking quickly around you, you see a cabinet 1.") is None
    goal = parse_goal("Your task is to: put some keychain on dresser.")
    answers = ["You arrive at desk 1. On the desk 1, you see a pen 1, and a book 2."]
    assert task_state(goal, ["go to desk 1"], answers, answers[0]).listed == ("pen", "book")
    assert task_state(goal, [], [], "You are in the middle of a room.").listed is None


def test_task_state_through_a_cool_task():
    goal = parse_goal("Your task is to: cool some mug and put it in cabinet.")
    steps = [("go to countertop 1", "You arrive at countertop 1. On the countertop 1, you see a mug 2, a cup 1."),
             ("take cup 1 from countertop 1", "You pick up the cup 1 from the countertop 1."),
             ("move cup 1 to countertop 1", "You move the cup 1 to the countertop 1."),
             ("take mug 2 from countertop 1", "You pick up the mug 2 from the countertop 1."),
             ("go to fridge 1", "You arrive at fridge 1. The fridge 1 is closed."),
             ("cool mug 2 with fridge 1", "You cool the mug 2 using the fridge 1."),
             ("go to cabinet 1", "You arrive at cabinet 1. On the cabinet 1, you see a mug 1."),
             ("move mug 2 to cabinet 1", "You move the mug 2 to the cabinet 1.")]
    states = []
    for count in range(len(steps) + 1):
        actions = [a for a, _ in steps[:count]]
        answers = [o for _, o in steps[:count]]
        observation = answers[-1] if answers else "You are in the middle of a room."
        states.append(task_state(goal, actions, answers, observation))
    assert [s.held for s in states] == [None, None, None, None, "mug 2", "mug 2", "mug 2", "mug 2", None]
    assert [s.changed for s in states] == [False] * 6 + [True, True, False]
    assert states[1].in_view == ("mug 2",) and states[4].in_view == ()      # the held one is not "in view"
    assert states[7].in_view == ("mug 1",)
    assert [s.placed for s in states] == [0] * 8 + [1]
    assert [s.location for s in states] == [None] + ["countertop 1"] * 4 + ["fridge 1"] * 2 + ["cabinet 1"] * 2
    assert [s.location_closed for s in states] == [False] * 5 + [True, True, False, False]
    with pytest.raises(ValueError, match="2 actions but 1 answers"):
        task_state(goal, ["a", "b"], ["x"], "")


def test_task_state_two_objects_and_lamps():
    goal = parse_goal("Your task is to: put two vase in shelf.")
    actions = ["take vase 1 from sidetable 1", "move vase 1 to shelf 1", "go to shelf 1"]
    answers = ["You pick up the vase 1 from the sidetable 1.", "You move the vase 1 to the shelf 1.",
               "On the shelf 1, you see a vase 1, and a vase 3."]
    state = task_state(goal, actions, answers, answers[-1])
    assert state.placed == 1 and state.held is None and state.in_view == ("vase 3",)   # the placed one is left out
    look = parse_goal("Your task is to: look at cd under the desklamp.")
    state = task_state(look, ["take cd 1 from desk 1"], ["You pick up the cd 1 from the desk 1."],
                       "On the sidetable 1, you see a desklamp 1, and a cd 2.")
    assert state.held == "cd 1" and state.lamps_in_view == ("desklamp 1",) and state.in_view == ("cd 2",)
    # a move to another receptacle class does not count as placed
    state = task_state(goal, actions[:1] + ["move vase 1 to sidetable 1"],
                       answers[:1] + ["You move the vase 1 to the sidetable 1."], "")
    assert state.placed == 0 and state.held is None


def test_task_state_location_opened_and_closed():
    goal = parse_goal("Your task is to: put some keychain on dresser.")
    steps = [("go to drawer 1", "You arrive at drawer 1. The drawer 1 is closed."),
             ("open drawer 2", "Nothing happens."),
             ("open drawer 1", "You open the drawer 1. The drawer 1 is open. In it, you see a keychain 3."),
             ("close drawer 1", "You close the drawer 1."),
             ("open drawer 1", "You open the drawer 1. The drawer 1 is open. In it, you see a keychain 3."),
             ("go to dresser 1", "You arrive at dresser 1. On the dresser 1, you see nothing.")]
    where = []
    for count in range(len(steps) + 1):
        answers = [o for _, o in steps[:count]]
        state = task_state(goal, [a for a, _ in steps[:count]], answers, answers[-1] if answers else "")
        where.append((state.location, state.location_closed))
    assert where == [(None, False), ("drawer 1", True), ("drawer 1", True), ("drawer 1", False), ("drawer 1", True),
                     ("drawer 1", False), ("dresser 1", False)]
