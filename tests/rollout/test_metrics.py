"""App. C.5 rollout-quality metrics against hand-computed values."""
from __future__ import annotations

import pytest

from jaxopd_envs.text import normalize_text
from jaxopd.rollout.metrics import (
    RolloutQuality,
    StepRecord,
    TrajectoryRecord,
    has_unproductive_repetition,
    is_executed_action_valid,
    mean_turns,
    repeat_percent,
    rollout_quality,
    successful_yield,
    unproductive_repetition_steps,
)

S0, S1 = frozenset({"at(agent, hall)"}), frozenset({"at(agent, kitchen)"})

# Trajectory A (hand-traced):
#  0 s0 go north  -> "Room B"           new       pair P first executed at 0
#  1 s1 go south  -> "start"            (o_1)     not new
#  2 s0 go north  -> "room  b"          not new   P seen at 0, no new obs since 0 -> REPETITION
#  3 s1 look      -> "Nothing happens." new
#  4 s1 xyz (invalid) -> "nothing happens." not new, invalid: ignored as a pair
#  5 s0 go north  -> "Room B"           not new   P seen at 2, but obs at 3 was new -> not a repetition
#  6 s0 "Go  North" -> "Room B"         not new   P (normalised action) seen at 5, nothing new since -> REPETITION
TRAJ_A = TrajectoryRecord(
    initial_observation="Start",
    steps=(StepRecord(S0, "go north", "Room B"),
           StepRecord(S1, "go south", "start"),
           StepRecord(S0, "go north", "room  b"),
           StepRecord(S1, "look", "Nothing happens."),
           StepRecord(S1, "xyz", "nothing happens.", valid=False),
           StepRecord(S0, "go north", "Room B"),
           StepRecord(S0, "Go  North", "Room B")))

# Trajectory B: nothing counts.
#  0 k wait -> "tick 1" new; 1 k wait -> "tick 2" new (the repeat itself produced something new);
#  2 k wait invalid -> "tick 2"; 3 k open door -> "Done!" new, won;
#  4 k open door -> "done!" not new, but the state's success flag is now True: a different pair.
TRAJ_B = TrajectoryRecord(
    initial_observation="start",
    steps=(("k", "wait", "tick 1", False),
           ("k", "wait", "tick 2", False),
           ("k", "wait", "tick 2", False, False),
           ("k", "open door", "Done!", True),
           ("k", "open door", "done!", True)))


def test_repetition_steps_hand_traced():
    assert unproductive_repetition_steps(TRAJ_A) == (2, 6)
    assert has_unproductive_repetition(TRAJ_A)
    assert unproductive_repetition_steps(TRAJ_B) == ()
    assert not has_unproductive_repetition(TRAJ_B)


def test_repetition_needs_no_new_observation_since_the_pair_ended():
    # the pair's own (new) observation does not reset the window; a later new observation does
    own_new = TrajectoryRecord("o1", (StepRecord("s", "a", "x"), StepRecord("s", "a", "x")))
    assert unproductive_repetition_steps(own_new) == (1,)
    later_new = TrajectoryRecord("o1", (StepRecord("s", "a", "x"), StepRecord("t", "b", "y"),
                                        StepRecord("s", "a", "x")))
    assert unproductive_repetition_steps(later_new) == ()
    # feedback of an invalid attempt is part of the observation record
    invalid_new = TrajectoryRecord("o1", (StepRecord("s", "a", "x"), StepRecord("s", None, "bad", valid=False),
                                          StepRecord("s", "a", "x")))
    assert unproductive_repetition_steps(invalid_new) == ()
    # o_1 counts as already seen: returning to it is not new
    back_to_start = TrajectoryRecord("o1", (StepRecord("s", "a", "O1"), StepRecord("s", "a", "o1")))
    assert unproductive_repetition_steps(back_to_start) == (1,)


def test_aggregate_metrics_hand_computed():
    trajectories = [TRAJ_A, TRAJ_B]
    assert TRAJ_A.turns == 7 and TRAJ_B.turns == 5
    assert TRAJ_A.success is False and TRAJ_B.success is True      # default: last step's won flag
    assert repeat_percent(trajectories) == pytest.approx(50.0)
    assert successful_yield(trajectories) == pytest.approx(100.0 * 1 / 12)   # 8.333...
    assert mean_turns(trajectories) == pytest.approx(6.0)
    assert rollout_quality(trajectories) == RolloutQuality(num_tasks=2, num_transitions=12, repeat_percent=50.0,
                                                           successful_yield=pytest.approx(100 / 12),
                                                           mean_turns=6.0)
    failed_30 = TrajectoryRecord("o", tuple(StepRecord(i, "a", f"o{i}") for i in range(30)))
    explicit_success = TrajectoryRecord("o", (StepRecord(0, "a", "x"),), success=True)
    assert successful_yield([failed_30, explicit_success]) == pytest.approx(100 * 1 / 31)
    assert mean_turns([failed_30, explicit_success]) == pytest.approx(15.5)
    assert repeat_percent([failed_30, explicit_success]) == 0.0


def test_normalisation_and_validity_helpers():
    assert normalize_text("  Ｒoom\tB \r\n x ") == "room b x"
    assert is_executed_action_valid(" open door ", ["open door", "look"])
    assert not is_executed_action_valid("Open door", ["open door"])     # exact match after strip (C.5)
    assert not is_executed_action_valid(None, ["open door"])


def test_bad_input():
    with pytest.raises(ValueError, match="at least one trajectory"):
        repeat_percent([])
    with pytest.raises(ValueError, match="no transitions"):
        successful_yield([TrajectoryRecord("o", ())])
    with pytest.raises(ValueError, match="cannot be valid"):
        StepRecord("s", None, "x")
    with pytest.raises(ValueError, match="a step must be"):
        TrajectoryRecord("o", (("s", "a"),))
    with pytest.raises(ValueError, match="expected TrajectoryRecord"):
        mean_turns([("o", ())])
