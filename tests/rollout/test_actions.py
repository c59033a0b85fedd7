"""Action strings of jaxopd.rollout.actions: ActionOPD's host-side agreement rewards (Eq. 5-6); extraction is
tested with the prompts (tests/rollout/test_prompts.py)."""
import pytest

from jaxopd.rollout import actions


def test_host_rewards_paper_example():
    teacher = ["go to desk 1", "Go to  Desk 1", "open drawer 2"]  # multiset [A, A, B]
    candidates = ["go to desk 1", "open drawer 2", "look", None]
    assert actions.action_agreement_rewards(candidates, teacher, num_teacher_samples=3,
                                            match_bonus_scale=0.5) == [1.25, 1.0, 0.0, -1.0]
    assert actions.action_match_count("GO TO DESK 1 ", teacher) == 2
    assert actions.action_match_count(None, teacher) == 0
    # two retained copies of A with nominal K = 3 (App. A.3); K = 1 gives unit reward
    assert actions.action_agreement_rewards(["a", "b"], ["a", "a"], 3) == [1.25, 0.0]
    assert actions.action_agreement_rewards(["a", "b", None], ["a"], 1) == [1.0, 0.0, -1.0]
    with pytest.raises(ValueError, match="empty"):
        actions.action_agreement_rewards(["a"], [], 3)
    with pytest.raises(ValueError, match="num_teacher_samples"):
        actions.action_agreement_rewards(["a"], ["a", "a", "b"], 2)
