"""Rollout-quality metrics of the ActFirst-OPD paper, App. C.5: unproductive repetition, successful
yield per 100 transitions, and mean executed turns.

Pure functions over trajectory records; nothing here touches an environment or a model. Text is compared
after the project's one normaliser, :func:`jaxopd_envs.text.normalize_text`.
"""
from __future__ import annotations

import dataclasses
from typing import Hashable, Iterable, Sequence

from jaxopd_envs.text import normalize_text  # App. C.5: "Unicode NFKC, case folding, and whitespace normalization"

__all__ = [
    "StepRecord",
    "TrajectoryRecord",
    "RolloutQuality",
    "is_executed_action_valid",
    "unproductive_repetition_steps",
    "has_unproductive_repetition",
    "repeat_percent",
    "successful_yield",
    "mean_turns",
    "rollout_quality",
]


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One executed interaction turn (valid or not).

    ``state`` is a hashable key of the environment state in which the action was executed; App. C.5:
    "state equality requires identical sets of positive environment facts and the same task-success
    flag" — pass e.g. a ``frozenset`` of positive facts; the success flag of that state (the previous
    step's ``won``, False at the start) is added to the pair key here. ``won`` is the task-success
    flag after this step. ``valid``: App. C.5 "An executed action is valid if parsing succeeds and the
    action, after stripping surrounding whitespace, exactly matches an entry in the admissible-action
    list" (see :func:`is_executed_action_valid`). ``action`` is None when parsing failed.
    """

    state: Hashable
    action: str | None
    next_observation: str
    won: bool = False
    valid: bool = True

    def __post_init__(self):
        if self.valid and self.action is None:
            raise ValueError("a step without a parsed action (action=None) cannot be valid")
        if not isinstance(self.next_observation, str):
            raise ValueError(f"next_observation must be a str, got {type(self.next_observation).__name__}")


@dataclasses.dataclass(frozen=True)
class TrajectoryRecord:
    """One rollout: o_1 and its executed turns. ``success`` (u_i) defaults to the last step's ``won``."""

    initial_observation: str
    steps: tuple[StepRecord, ...]
    success: bool | None = None

    def __post_init__(self):
        steps = tuple(_as_step(s) for s in self.steps)
        object.__setattr__(self, "steps", steps)
        if self.success is None:
            object.__setattr__(self, "success", bool(steps and steps[-1].won))

    @property
    def turns(self) -> int:
        """T_i: executed interaction turns, invalid attempts included (App. C.1, C.5)."""
        return len(self.steps)


@dataclasses.dataclass(frozen=True)
class RolloutQuality:
    """The three App. C.5 metrics over N tasks (Figure 4 a–c)."""

    num_tasks: int
    num_transitions: int
    repeat_percent: float       # 100 · mean_i r_i
    successful_yield: float     # 100 · Σ u_i / Σ T_i
    mean_turns: float           # Σ T_i / N


def _as_step(step) -> StepRecord:
    if isinstance(step, StepRecord):
        return step
    if isinstance(step, tuple) and len(step) in (4, 5):
        return StepRecord(*step)
    raise ValueError("a step must be a StepRecord or a tuple (state, action, next_observation, won[, valid]), "
                     f"got {step!r}")


def is_executed_action_valid(action: str | None, admissible_actions: Iterable[str]) -> bool:
    """App. C.5 validity: parsing succeeded and ``action.strip()`` exactly matches an admissible entry."""
    return action is not None and action.strip() in set(admissible_actions)


def unproductive_repetition_steps(trajectory: TrajectoryRecord) -> tuple[int, ...]:
    """Indices (0-based) of the steps that are unproductive repetitions, App. C.5.

    "A valid action counts as an unproductive repetition if the same state–action pair was previously
    executed validly, no new normalized observation has appeared since the end of that pair's most
    recent valid execution, and the current action also produces no new observation. An observation
    is new if its normalized text has not appeared earlier in the rollout." The observation record
    starts with o_1 and includes feedback from invalid attempts; actions are normalised for the pair.
    """
    seen_observations = {normalize_text(trajectory.initial_observation)}
    last_new_observation_step = -1          # o_1 counts as appearing before step 0
    last_valid_execution: dict[tuple, int] = {}
    state_success = False
    repetitions: list[int] = []
    for index, step in enumerate(trajectory.steps):
        observation = normalize_text(step.next_observation)
        is_new = observation not in seen_observations
        seen_observations.add(observation)
        if step.valid:
            pair = (step.state, state_success, normalize_text(step.action))
            previous = last_valid_execution.get(pair)
            if previous is not None and last_new_observation_step <= previous and not is_new:
                repetitions.append(index)
            last_valid_execution[pair] = index
        if is_new:
            last_new_observation_step = index
        state_success = bool(step.won)
    return tuple(repetitions)


def has_unproductive_repetition(trajectory: TrajectoryRecord) -> bool:
    """r_i of App. C.5: whether the trajectory contains at least one unproductive repetition."""
    return bool(unproductive_repetition_steps(trajectory))


def _checked(trajectories: Sequence[TrajectoryRecord]) -> Sequence[TrajectoryRecord]:
    trajectories = list(trajectories)
    if not trajectories:
        raise ValueError("rollout-quality metrics need at least one trajectory")
    for t in trajectories:
        if not isinstance(t, TrajectoryRecord):
            raise ValueError(f"expected TrajectoryRecord, got {type(t).__name__}")
    return trajectories


def repeat_percent(trajectories: Sequence[TrajectoryRecord]) -> float:
    """Repeat = 100 · (1/N) Σ r_i: percentage of tasks with at least one unproductive repetition."""
    trajectories = _checked(trajectories)
    return 100.0 * sum(has_unproductive_repetition(t) for t in trajectories) / len(trajectories)


def successful_yield(trajectories: Sequence[TrajectoryRecord]) -> float:
    """Yield = 100 · Σ u_i / Σ T_i: successful trajectories per 100 executed transitions."""
    trajectories = _checked(trajectories)
    transitions = sum(t.turns for t in trajectories)
    if transitions == 0:
        raise ValueError("successful yield is undefined: the trajectories contain no transitions")
    return 100.0 * sum(bool(t.success) for t in trajectories) / transitions


def mean_turns(trajectories: Sequence[TrajectoryRecord]) -> float:
    """T̄ = (1/N) Σ T_i, turns counting invalid attempts and failed trajectories."""
    trajectories = _checked(trajectories)
    return sum(t.turns for t in trajectories) / len(trajectories)


def rollout_quality(trajectories: Sequence[TrajectoryRecord]) -> RolloutQuality:
    """All three App. C.5 metrics at once."""
    trajectories = _checked(trajectories)
    return RolloutQuality(num_tasks=len(trajectories),
                          num_transitions=sum(t.turns for t in trajectories),
                          repeat_percent=repeat_percent(trajectories),
                          successful_yield=successful_yield(trajectories),
                          mean_turns=mean_turns(trajectories))
