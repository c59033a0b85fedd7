"""Action strings of the agent protocol: extracting the action from a response, matching two actions, and
ActionOPD's action-agreement rewards computed from them on the host (Eq. 5-6).

Text is compared after the project's one normaliser, :func:`jaxopd_envs.text.normalize_text`; the array form of
the reward, r_λ from match counts, is :func:`jaxopd.losses.action_agreement_reward`.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

from jaxopd_envs.text import normalize_text
from jaxopd.rollout.tags import ACTION_END, ACTION_START, THINK_END, THINK_START

__all__ = ["extract_action", "actions_match", "action_match_count", "action_agreement_rewards"]


def extract_action(text: str) -> str | None:
    """The action of a response: the content of its last complete ``<action>…</action>``, stripped.

    Only the answer counts: when the response has reasoning, the text after its last ``</think>`` is
    searched, and a response whose ``<think>`` never closed has no action. None when there is no complete
    tag pair, or its content is empty after stripping (an invalid output).
    """
    if not isinstance(text, str):
        raise ValueError(f"extract_action expects a str, got {type(text).__name__}")
    think_end = text.rfind(THINK_END)
    if think_end >= 0:
        text = text[think_end + len(THINK_END):]
    elif THINK_START in text:
        return None
    close = text.rfind(ACTION_END)
    if close < 0:
        return None
    open_ = text.rfind(ACTION_START, 0, close)
    if open_ < 0:
        return None
    # the pair closes at the first closing tag after its opener: "<action>a</action>b</action>" is "a"
    close = text.find(ACTION_END, open_ + len(ACTION_START))
    action = text[open_ + len(ACTION_START):close].strip()
    return action or None


def actions_match(candidate: str, teacher: str) -> bool:
    """Default matcher m_s for text actions (ALFWorld / ScienceWorld commands): equal after normalisation."""
    return normalize_text(candidate, what="candidate") == normalize_text(teacher, what="teacher")


def action_match_count(candidate: Optional[str], teacher_actions: Sequence[str],
                       matcher: Callable[[str, str], bool] = actions_match) -> int:
    """c(s, y) = Σ_k m_s(y, y_k^T) (ActionOPD Eq. 5); repeated teacher samples count separately.

    ``candidate=None`` stands for an invalid output, which never matches.
    """
    if candidate is None:
        return 0
    return sum(1 for teacher in teacher_actions if matcher(candidate, teacher))


def action_agreement_rewards(candidates: Sequence[Optional[str]], teacher_actions: Sequence[str],
                             num_teacher_samples: int, match_bonus_scale: float = 0.5,
                             matcher: Callable[[str, str], bool] = actions_match) -> list[float]:
    """Host-side r_λ (ActionOPD Eq. 5-6) of each candidate against the retained teacher multiset.

    ``candidates[i] is None`` marks an invalid output (reward -1). ``teacher_actions`` holds the valid
    teacher samples (at most K, non-empty: an empty multiset supervises nothing and is a ValueError).
    """
    if not teacher_actions:
        raise ValueError("action_agreement_rewards: the teacher multiset is empty; the state has no supervision")
    if int(num_teacher_samples) != num_teacher_samples or num_teacher_samples < len(teacher_actions):
        raise ValueError(f"action_agreement_rewards: num_teacher_samples (K={num_teacher_samples}) must be an "
                         f"integer >= the {len(teacher_actions)} retained teacher samples")
    if any(teacher is None for teacher in teacher_actions):
        raise ValueError("action_agreement_rewards: teacher_actions must hold only valid (non-None) actions")
    rewards = []
    for candidate in candidates:
        if candidate is None:
            rewards.append(-1.0)
            continue
        count = action_match_count(candidate, teacher_actions, matcher)
        if count == 0:
            rewards.append(0.0)
        elif num_teacher_samples == 1:
            rewards.append(1.0)
        else:
            rewards.append(1.0 + match_bonus_scale * (count - 1) / (num_teacher_samples - 1))
    return rewards
