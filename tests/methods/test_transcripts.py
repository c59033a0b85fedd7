"""Transcript counts of ALFWorld episodes (jaxopd.methods.transcripts) and their report (experiments.episode_report),
on hand-written episodes whose every count is known."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("alfworld")

COOL_ID = "alfworld/valid_unseen/pick_cool_then_place_in_recep-Mug-None-Cabinet-10/trial_S0_00001"
LOOK_ID = "alfworld/valid_unseen/look_at_obj_in_light-CD-None-DeskLamp-305/trial_S0_00025"


def _answer(thinking, action):
    return f"<think>\n{thinking}\n</think>\n\n<action>{action}</action><|im_end|>"


def _cool_episode():
    """A cool task played to the end: 5 rounds, 1 refused, 0 repeats; plan thinking right in 4 rounds of 5."""
    steps = [("I need a mug.", "go to drawer 1", "Nothing happens."),
             ("I need a mug.", "go to countertop 1",
              "You arrive at countertop 1. On the countertop 1, you see a mug 2."),
             ("I need a mug. I see mug 2 here.", "take mug 2 from countertop 1",
              "You pick up the mug 2 from the countertop 1."),
             ("I hold mug 2. It goes in cabinet.", "cool mug 2 with fridge 1",
              "You cool the mug 2 using the fridge 1."),
             ("I hold mug 2, now cool. It goes in cabinet.", "move mug 2 to cabinet 1",
              "You move the mug 2 to the cabinet 1.")]
    return {"task_id": COOL_ID, "won": True, "actions": [a for _, a, _ in steps],
            "feedback": [f for _, _, f in steps], "answers": [_answer(t, a) for t, a, _ in steps]}


def _look_episode():
    """A look task that never finds its object: 3 rounds, 2 refused repeats, one answer without thinking."""
    return {"task_id": LOOK_ID, "won": False, "actions": ["go to drawer 1", "go to drawer 1", "look"],
            "feedback": ["Nothing happens.", "Nothing happens.", "You are in the middle of a room."],
            "answers": [_answer("I need a cd.", "go to drawer 1"), _answer("I need a desklamp.", "go to drawer 1"),
                        "<action>look</action>"]}


def test_goal_of_task_id():
    from jaxopd_envs.alfworld_state import Goal, goal_of_task_id
    assert goal_of_task_id(COOL_ID) == Goal("pick_cool_then_place_in_recep", "mug", "cabinet")
    assert goal_of_task_id(LOOK_ID) == Goal("look_at_obj_in_light", "cd", toggle="desklamp")
    assert goal_of_task_id("pick_two_obj_and_place-Vase-None-Shelf-7").count == 2
    with pytest.raises(ValueError, match="no ALFWorld trial folder"):
        goal_of_task_id("alfworld/valid_unseen/task-1")


def test_thinking_of():
    from jaxopd.methods.transcripts import thinking_of
    assert thinking_of(_answer("I need a mug.", "look")) == "I need a mug."
    assert thinking_of("<think>\n\n</think>\n\n<action>look</action>") == ""
    assert thinking_of("<action>look</action>") is None
    assert thinking_of("<think>\nunfinished") is None


def test_episode_progress():
    from jaxopd.methods.transcripts import episode_progress
    assert episode_progress(_cool_episode()) == {"held": True, "changed": True, "placed": True, "won": True}
    assert episode_progress(_look_episode()) == {"held": False, "changed": None, "placed": None, "won": False}
    partial = _cool_episode()
    for key in ("actions", "feedback", "answers"):
        partial[key] = partial[key][:3]
    partial["won"] = False
    assert episode_progress(partial) == {"held": True, "changed": False, "placed": False, "won": False}


def test_refused_runs_by_hand():
    from jaxopd.methods.transcripts import refused_runs
    no, ok = "Nothing happens.", "You arrive at shelf 1. On the shelf 1, you see nothing."
    assert refused_runs([], []) == []
    assert refused_runs(["look"], [ok]) == []
    # a lone refusal; then "go to shelf 2" refused three times, the third answer padded as the engine pads it
    assert refused_runs(["open drawer 1", "go to shelf 1", "go to shelf 2", "go to shelf 2", "go to shelf 2"],
                        [no, ok, no, no, no + "\n"]) == [1, 3]
    # another refused command starts a new run; a command carried out ends one, and the same command after it
    # starts again from 1
    assert refused_runs(["go to shelf 2", "go to shelf 2", "go to shelf 3", "go to shelf 1", "go to shelf 3"],
                        [no, no, no, ok, no]) == [2, 1, 1]


def test_stuck_episodes_by_hand():
    from jaxopd.methods.transcripts import STUCK_RUN, transcript_counts
    no = "Nothing happens."
    stuck = _look_episode()       # 2 refused "go to drawer 1", then STUCK_RUN refused "go to shelf 9", then look
    stuck["actions"] = stuck["actions"][:2] + ["go to shelf 9"] * STUCK_RUN + ["look"]
    stuck["feedback"] = stuck["feedback"][:2] + [no] * STUCK_RUN + ["You are in the middle of a room."]
    stuck["answers"] = stuck["answers"][:2] + [_answer("I need a cd.", "go to shelf 9")] * STUCK_RUN + ["look"]
    short = _look_episode()       # one run one short of stuck
    short["actions"] = ["go to shelf 9"] * (STUCK_RUN - 1)
    short["feedback"] = [no] * (STUCK_RUN - 1)
    short["answers"] = [_answer("I need a cd.", "go to shelf 9")] * (STUCK_RUN - 1)
    counts = transcript_counts([_cool_episode(), stuck, short], thinking="plan")
    assert counts["stuck"] == {"episodes": 1, "of": 3, "rounds": STUCK_RUN, "run": STUCK_RUN}


def test_transcript_counts_by_hand():
    from jaxopd.methods.transcripts import transcript_counts
    counts = transcript_counts([_cool_episode(), _look_episode()], thinking="plan")
    assert counts["episodes"] == 2 and counts["rounds"] == 8
    assert counts["refused"] == pytest.approx(3 / 8)
    assert counts["repeated"] == pytest.approx(1 / 8)
    # after a refusal: the cool episode moves on; the look episode gives "go to drawer 1" again, then "look"
    assert counts["refusal_repeated"] == {"rounds": 1, "of": 3, "share": pytest.approx(1 / 3)}
    # faithful: the cool episode's rounds 1, 2, 3 and 5 (round 4 should have said "I must cool it with a fridge."),
    # the look episode's round 1 ("I need a cd."); 7 rounds have thinking
    assert counts["thinking_faithful"] == pytest.approx(5 / 8)
    assert counts["thinking_names_goal"] == pytest.approx(6 / 8)     # "mug" 5 times, "cd" once
    assert counts["no_thinking"] == pytest.approx(1 / 8)
    assert counts["stuck"] == {"episodes": 0, "of": 2, "rounds": 0, "run": 5}    # the look episode's run is 2
    assert counts["funnel"] == {"held": {"episodes": 1, "of": 2, "share": 0.5},
                                "changed": {"episodes": 1, "of": 1, "share": 1.0},
                                "placed": {"episodes": 1, "of": 1, "share": 1.0},
                                "won": {"episodes": 1, "of": 2, "share": 0.5}}
    state = transcript_counts([_cool_episode()], thinking="state")
    # state thinking of the same rounds: "I need a mug." twice, "... I see mug 2 here.", "I hold mug 2.",
    # "I hold mug 2, now cool." -- none of the last two match the plan words written above
    assert state["thinking_faithful"] == pytest.approx(3 / 5)
    # plan-here adds "I am at countertop 1." from round 3 on, which the rounds above do not say
    assert transcript_counts([_cool_episode()], thinking="plan-here")["thinking_faithful"] == pytest.approx(2 / 5)
    with pytest.raises(ValueError, match="not 'chain'"):
        transcript_counts([_cool_episode()], thinking="chain")
    with pytest.raises(ValueError, match="no episodes"):
        transcript_counts([], thinking="plan")
    broken = _cool_episode()
    broken["feedback"] = broken["feedback"][:2]
    with pytest.raises(ValueError, match="5 actions but 2 answers"):
        transcript_counts([broken])


def test_episode_report_cli(tmp_path, capsys):
    from jaxopd_experiments.episode_report import main
    first, second = tmp_path / "a", tmp_path / "b.json"
    first.mkdir()
    (first / "evaluation.json").write_text(json.dumps({"episodes": [_cool_episode(), _look_episode()]}))
    second.write_text(json.dumps({"episodes": [_look_episode()]}))
    out = tmp_path / "out"
    assert main(["--eval", f"one={first}", "--eval", f"two={second}", "--out", str(out)]) == 0
    report = json.loads((out / "transcripts.json").read_text())
    assert report["evaluations"]["one"]["funnel"]["won"]["episodes"] == 1
    assert report["evaluations"]["two"]["refused"] == pytest.approx(2 / 3)
    table = (out / "transcripts.md").read_text()
    assert "| one | 2 | 1/2 | 1/1 | 1/1 | 1/2 | 37.5 % | 12.5 % | 1/3 | 62.5 % | 75.0 % |" in table
    assert table.splitlines()[2].endswith(" | 0/2 (0 rounds) |")     # the stuck column: no run of 5 refused
    assert (out / "funnel.png").stat().st_size > 0
    capsys.readouterr()
    assert main(["--eval", "x", "--out", str(out)]) == 2
    assert "LABEL=PATH" in capsys.readouterr().err
    assert main(["--eval", f"one={tmp_path / 'missing'}", "--out", str(out)]) == 2
    assert "no evaluation file" in capsys.readouterr().err
    assert main(["--eval", f"one={second}", "--eval", f"one={second}", "--out", str(out)]) == 2
    assert "labels must differ" in capsys.readouterr().err


def test_task_plan_here_fidelity_reads_the_record_instruction():
    from jaxopd.methods.transcripts import transcript_counts
    instruction = "Your task is to: cool some mug and put it in cabinet."
    episode = _cool_episode()
    said = [f"{instruction} I need a mug.", f"{instruction} I need a mug.",
            f"{instruction} I need a mug. I see mug 2 here. I am at countertop 1.",
            "I hold mug 2.", f"{instruction} I hold mug 2, now cool. It goes in cabinet. I am at countertop 1."]
    episode["answers"] = [_answer(t, a) for t, a in zip(said, episode["actions"])]
    with pytest.raises(ValueError, match="restates the instruction"):      # an old record: no instruction
        transcript_counts([episode], thinking="task-plan-here")
    counts = transcript_counts([{**episode, "instruction": instruction}], thinking="task-plan-here")
    # round 4 (held at the countertop, no tool there) should have restated the task: 4 of 5 faithful
    assert counts["thinking_faithful"] == pytest.approx(4 / 5) and counts["thinking_names_goal"] == 1.0


def test_a_restated_instruction_does_not_name_the_goal():
    from jaxopd_envs.alfworld_state import without_restated_instruction
    from jaxopd.methods.transcripts import transcript_counts
    instruction = "Your task is to: cool some mug and put it in cabinet."
    assert without_restated_instruction(f"{instruction} I need a bread.") == "I need a bread."
    assert without_restated_instruction("I need a mug.") == "I need a mug."
    assert without_restated_instruction("Your task is to: cool some mug") == ""
    episode = {**_cool_episode(), "instruction": instruction}
    episode["answers"] = [_answer(f"{instruction} I need a bread.", a) for a in episode["actions"]]
    assert transcript_counts([episode], thinking="task-plan-here")["thinking_names_goal"] == 0.0


def test_thinking_against_action_by_hand():
    """Whether the action does what the thinking said: the object named in view taken, the command ended on given,
    the change sentence the task's verb and tool; rounds that say none of these are not counted."""
    from jaxopd.methods.transcripts import transcript_counts

    steps = [("I need a mug. I see mug 2 here. I am at countertop 1. I can take mug 2 from countertop 1.",
              "take mug 1 from countertop 1", "You pick up the mug 1 from the countertop 1."),
             ("I hold mug 1. I must heat it with a microwave. I am at countertop 1.", "go to fridge 1",
              "You arrive at fridge 1. The fridge 1 is closed."),
             ("I hold mug 1. I must cool it with a fridge. I am at fridge 1. It is closed. "
              "I can cool mug 1 with fridge 1.", "cool mug 1 with fridge 1", "You cool the mug 1 using the fridge 1."),
             ("I hold mug 1. I must cool it with a fridge. I can cool it here.", "look", "Nothing happens."),
             ("I need a mug. I see mug 3 here.", "take mug 3 from fridge 1", "Nothing happens.")]
    episode = {"task_id": COOL_ID, "won": False, "actions": [a for _, a, _ in steps],
               "feedback": [f for _, _, f in steps], "answers": [_answer(t, a) for t, a, _ in steps],
               "instruction": "Your task is to: cool some mug and put it in cabinet."}
    counts = transcript_counts([episode], thinking="task-list-act-here")
    assert counts["named_taken"] == {"rounds": 1, "of": 2, "share": 0.5}
    assert counts["command_followed"] == {"rounds": 1, "of": 2, "share": 0.5}   # "I can cool it here." is none
    assert counts["change_right"] == {"rounds": 2, "of": 3, "share": pytest.approx(2 / 3)}
    look = transcript_counts([_look_episode()], thinking="plan")
    assert look["change_right"] == {"rounds": 0, "of": 0, "share": None}   # a look task changes nothing


def test_thinking_against_observation_by_hand():
    """Whether the thinking read the observation it answered: an object said in view that the observation names
    (the first round answers an unrecorded observation: never), and an arrival's or an opening's classes copied
    as the listing rules write them; rules that copy no listing count none."""
    from jaxopd.methods.transcripts import transcript_counts

    instruction = "Your task is to: cool some mug and put it in cabinet."
    steps = [("I need a mug. I see mug 2 here.", "go to countertop 1",
              "You arrive at countertop 1. On the countertop 1, you see a apple 1, a mug 2, and a apple 3."),
             ("Your task is to: cool some mug and put it in cabinet. Here: apple, mug. I need a mug. I see mug 2 "
              "here.", "take mug 2 from countertop 1", "You pick up the mug 2 from the countertop 1."),
             ("I hold mug 2.", "go to cabinet 1", "You arrive at cabinet 1. The cabinet 1 is closed."),
             ("Here: nothing.", "open cabinet 1", "You open the cabinet 1. The cabinet 1 is open. In it, you see "
                                                  "a cup 4."),
             ("Here: cup. I see mug 4 here.", "look", "Nothing happens.")]
    episode = {"task_id": COOL_ID, "won": False, "actions": [a for _, a, _ in steps],
               "feedback": [f for _, _, f in steps], "answers": [_answer(t, a) for t, a, _ in steps],
               "instruction": instruction}
    counts = transcript_counts([episode], thinking="task-list-act-here")
    # "I see mug 2 here." before any observation: false; after the countertop's listing: true; mug 4 at the
    # opened cabinet (a cup 4): false
    assert counts["named_true"] == {"rounds": 1, "of": 3, "share": pytest.approx(1 / 3)}
    # rounds 1 (apple, mug) and 4 (cup) answer a listing; the closed cabinet (round 3) lists nothing
    assert counts["listing_right"] == {"rounds": 2, "of": 2, "share": 1.0}
    assert transcript_counts([episode], thinking="plan")["listing_right"] == {"rounds": 0, "of": 0, "share": None}
    assert transcript_counts([episode], thinking="plan")["named_true"] == counts["named_true"]
    episode["answers"][4] = _answer("Here: cup, mug. I see mug 4 here.", "look")
    assert transcript_counts([episode], thinking="task-list-act-here")["listing_right"]["rounds"] == 1
    # the first listing said is the one read (as demo_fit reads it): a right one after a wrong one does not count
    episode["answers"][4] = _answer("Here: mug. Here: cup. I see mug 4 here.", "look")
    assert transcript_counts([episode], thinking="task-list-act-here")["listing_right"]["rounds"] == 1
