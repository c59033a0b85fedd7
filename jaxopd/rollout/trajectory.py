"""The rollout record: generated responses, executed turns and trajectories, and their one conversion to
training samples (``jaxopd.sample.Sample``).

Owns ``Response`` (one generated response in its context: prompt ids, response ids, sampling log-probs, the
``model_generated`` mask of ActFirst-OPD App. B.3/B.4, the generation mode, the policy version, the teacher
flag), ``Turn`` (one executed interaction step: the state, the executed action, the environment outcome, the
responses trained on and the ones only used to choose the action), ``Trajectory`` (one task's rollout),
``response_to_sample`` (the only place a response becomes a ``Sample``), the App. C.5 quality record, and
``EpisodeOutcome`` / ``EpisodesFailed`` (what a batch of episodes gave per task: a trajectory, or the reason it
failed).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Hashable, Iterable, Mapping, Sequence

import numpy as np

from jaxopd_envs.base import Observation, Task
from jaxopd_envs.checks import TransitionCheck, normalize_observation
from jaxopd_envs.text import normalize_text
from jaxopd.rollout import metrics
from jaxopd.rollout.actions import extract_action
from jaxopd.rollout.prompts import GENERATION_MODES
from jaxopd.rollout.tags import ACTION_END
from jaxopd.sample import Sample

__all__ = ["END_REASONS", "ACTION_SOURCES", "Response", "Turn", "Trajectory", "response_to_sample",
           "trajectory_samples", "default_state_key", "rollout_quality", "EpisodeOutcome", "EpisodesFailed",
           "error_reason"]

END_REASONS: tuple[str, ...] = (
    "done",                 # the environment terminated (success or terminal failure)
    "max_turns",            # the interaction limit was reached (30 turns on ALFWorld and ScienceWorld)
    "check_failed",         # ActFirst-OPD w/o NAP fallback: the first failed transition check ends the rollout
    "no_teacher_sample",    # ActionOPD App. A.3: no valid teacher sample at a state ends the collection
    "prompt_over_budget",   # even the no-history prompt exceeds the prompt budget (App. B.2; ActionOPD App. A.3)
)

ACTION_SOURCES: tuple[str, ...] = (
    "full",                 # the action of a full think-then-act response (Vanilla, STI student turns)
    "inverse_dynamics",     # ActFirst-OPD: a reference-conditioned inverse-dynamics fast action (Sec. 4.1)
    "next_action",          # ActFirst-OPD: an autonomous next-action prediction (Sec. 4.2, invalid-proposal fallback)
    "reference",            # ActFirst-OPD reference-prefix replay: the reference action itself
    "teacher",              # STI-OPD: the teacher's regenerated turn (z_t = 1)
    "candidate",            # ActionOPD: the selected student candidate of the state group
)


def _int_array(values: Any, name: str) -> np.ndarray:
    array = np.asarray(values)
    if array.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {array.shape}")
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"{name} must hold integers, got {array.dtype}")
    return array.astype(np.int32)


# ----------------------------------------------------------------------------------------------------------
# Response
# ----------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, eq=False)
class Response:
    """One generated response and the context it was generated in.

    ``response_ids[i]`` was sampled with log-probability ``logprobs[i]`` at the rollout temperature, before any
    top-p/top-k truncation (the behaviour policy of the ratios), when ``model_generated[i]``; tokens inserted
    by budgeted thinking (ActFirst-OPD App. B.3) have ``model_generated`` False and log-probability 0: they
    stay in the context but out of the loss and its normalisation (App. B.4).

    ``mode``: the prompt's generation mode (``prompts.GENERATION_MODES``). ``policy_version``: the student
    version the rollout ran with (for a teacher-generated turn too: it dates the sample for the buffer's lag
    rule). ``teacher_generated``: STI-OPD, the teacher wrote this turn and ``logprobs`` are the teacher's.
    ``teacher_logp``: the teacher's log-probabilities of the tokens when the rollout computed them (STI-OPD's
    discrepancy score), else None. ``action``: the parsed ``<action>`` (None when unparsable or truncated).
    ``truncated``: the response ran out of its budget without closing its action (App. B.3: an empty action).
    ``reward`` / ``advantage`` / ``retained``: ActionOPD's r_λ, A_{g,i} and group retention.
    """

    prompt_ids: np.ndarray
    response_ids: np.ndarray
    logprobs: np.ndarray
    model_generated: np.ndarray
    mode: str
    policy_version: int
    text: str = ""
    action: str | None = None
    truncated: bool = False
    teacher_generated: bool = False
    teacher_logp: np.ndarray | None = None
    kind: str = ""
    finish_reason: str = ""
    request_id: str = ""
    reward: float | None = None
    advantage: float = 0.0
    retained: bool = True

    def __post_init__(self):
        prompt = _int_array(self.prompt_ids, "Response.prompt_ids")
        response = _int_array(self.response_ids, "Response.response_ids")
        if prompt.size == 0:
            raise ValueError("Response.prompt_ids is empty: a response needs a context")
        object.__setattr__(self, "prompt_ids", prompt)
        object.__setattr__(self, "response_ids", response)
        length = response.shape[0]
        for name, dtype in (("logprobs", np.float32), ("model_generated", bool), ("teacher_logp", np.float32)):
            value = getattr(self, name)
            if value is None:
                if name == "teacher_logp":
                    continue
                raise ValueError(f"Response.{name} is required")
            value = np.asarray(value).astype(dtype)
            if value.shape != (length,):
                raise ValueError(f"Response.{name} must have shape ({length},) like response_ids, got {value.shape}")
            object.__setattr__(self, name, value)
        if self.mode not in GENERATION_MODES:
            raise ValueError(f"Response.mode must be one of {GENERATION_MODES}, got {self.mode!r}")
        if int(self.policy_version) != self.policy_version or self.policy_version < 0:
            raise ValueError(f"Response.policy_version must be a non-negative integer, got {self.policy_version!r}")
        object.__setattr__(self, "policy_version", int(self.policy_version))
        if not np.all(np.isfinite(self.logprobs[self.model_generated])):
            raise ValueError("Response.logprobs must be finite on model-generated tokens")

    # -- construction from the sampler's outputs ----------------------------------------------------------
    @classmethod
    def from_result(cls, result: Any, *, mode: str, policy_version: int, tokenizer: Any = None,
                    teacher_generated: bool = False, **fields) -> "Response":
        """A single-request response (an action-only request, or any ``Result``): every token model-generated.

        The text is the engine's (cut after a stop string) or, when the engine has no tokenizer, ``tokenizer``'s
        decoding. Truncated: the request hit its length limit without closing ``</action>``.
        """
        text = result.text or (tokenizer.decode(result.token_ids) if tokenizer is not None else "")
        truncated = result.finish_reason == "length" and ACTION_END not in text
        ids = list(result.token_ids)
        if not teacher_generated:
            policy_version = engine_policy_version([result], policy_version)
        return cls(prompt_ids=np.asarray(result.prompt_ids), response_ids=np.asarray(ids, np.int32),
                   logprobs=np.asarray(result.logprobs, np.float32), model_generated=np.ones(len(ids), bool),
                   mode=mode, policy_version=policy_version, text=text,
                   action=None if truncated else extract_action(text), truncated=truncated,
                   teacher_generated=teacher_generated, kind=str(result.kind),
                   finish_reason=str(result.finish_reason), request_id=str(result.request_id), **fields)

    @classmethod
    def from_budgeted(cls, budgeted: Any, *, prompt_ids: Sequence[int], mode: str, policy_version: int,
                      teacher_generated: bool = False, **fields) -> "Response":
        """A full response of budgeted thinking (``BudgetedResponse``, App. B.3): inserted tokens masked out;
        a truncated response has no action (App. B.3: "responses marked as truncated are treated as empty
        actions")."""
        last = budgeted.stages[-1]
        if not teacher_generated:
            policy_version = engine_policy_version(budgeted.stages, policy_version)
        return cls(prompt_ids=np.asarray(prompt_ids), response_ids=np.asarray(budgeted.token_ids, np.int32),
                   logprobs=budgeted.logprobs, model_generated=budgeted.model_generated, mode=mode,
                   policy_version=policy_version, text=budgeted.text,
                   action=None if budgeted.truncated else extract_action(budgeted.text),
                   truncated=bool(budgeted.truncated), teacher_generated=teacher_generated,
                   kind=str(last.kind), finish_reason=str(last.finish_reason),
                   request_id=str(budgeted.stages[0].request_id), **fields)

    # -- views -------------------------------------------------------------------------------------------
    @property
    def num_generated(self) -> int:
        return int(self.model_generated.sum())

    @property
    def executable_action(self) -> str:
        """What executing this response submits: its action, or the empty action when it has none."""
        return self.action if self.action is not None else ""

    def replace(self, **changes) -> "Response":
        return dataclasses.replace(self, **changes)

    def to_sample(self) -> Sample:
        return response_to_sample(self)


def engine_policy_version(results: Sequence[Any], fallback: int) -> int:
    """The student version a response was sampled with, as the engine recorded it: the oldest first-token
    version among its requests (``Result.policy_versions = (first, last)``). A response that spans a weight
    update is dated by its oldest weights, so the buffer's lag rule is never too lenient. Results without
    versions (scripted engines) keep ``fallback``, the version the strategy believed it was serving."""
    firsts = [r.policy_versions[0] for r in results if getattr(r, "policy_versions", None) is not None]
    return int(min(firsts)) if firsts else int(fallback)


def response_to_sample(response: Response) -> Sample:
    """The one conversion of a response to a training sample.

    tokens = prompt + response; ``loss_mask`` covers only the model-generated response tokens (never the
    prompt, never inserted tokens); ``behavior_logp`` is the sampling log-probability there (0 elsewhere);
    ``teacher_logp`` comes along when the rollout computed it; ``teacher_generated`` marks every response
    token of a teacher turn (STI-OPD); ``advantage`` / ``retained`` are ActionOPD's.
    """
    if not isinstance(response, Response):
        raise ValueError(f"response_to_sample takes a Response, got {type(response).__name__}")
    prompt_length, length = response.prompt_ids.shape[0], response.response_ids.shape[0]
    if length == 0:
        raise ValueError("a response without tokens cannot become a training sample")
    context = np.zeros(prompt_length, np.float32)
    generated = response.model_generated
    teacher_logp = None
    if response.teacher_logp is not None:
        teacher_logp = np.concatenate([context, np.where(generated, response.teacher_logp, 0.0)])
    return Sample(
        tokens=np.concatenate([response.prompt_ids, response.response_ids]),
        loss_mask=np.concatenate([np.zeros(prompt_length, bool), generated]),
        behavior_logp=np.concatenate([context, np.where(generated, response.logprobs, 0.0)]),
        policy_version=response.policy_version,
        teacher_logp=teacher_logp,
        teacher_generated=np.concatenate([np.zeros(prompt_length, bool),
                                          np.full(length, response.teacher_generated, bool)]),
        advantage=response.advantage,
        retained=response.retained,
    )


# ----------------------------------------------------------------------------------------------------------
# Turn and trajectory
# ----------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, eq=False)
class Turn:
    """One executed interaction step t: in state ``observation`` (o_t) the agent executed ``action``
    (the empty string for an empty action) and the environment answered ``next_observation`` (o_{t+1}).

    ``responses``: the turn's training responses (Vanilla: the full response; ActFirst-OPD: the asynchronous
    full response, whose own action is not executed; STI-OPD: the executed student or teacher turn;
    ActionOPD: the N candidates of the state group). ``action_responses``: responses generated to choose the
    action and never trained on (ActFirst-OPD's fast actions; ActionOPD's valid and invalid teacher samples).
    ``action_source``: one of ``ACTION_SOURCES``. ``guided``: ActFirst-OPD reference guidance held at this
    turn; ``check``: the App. B.5 transition check run after it. ``info``: strategy details (STI-OPD's
    score and intervention draw, ActionOPD's rewards and selection).
    """

    index: int
    observation: Observation
    action: str
    next_observation: Observation
    action_source: str
    responses: tuple[Response, ...] = ()
    action_responses: tuple[Response, ...] = ()
    guided: bool = False
    check: TransitionCheck | None = None
    info: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if self.index < 1:
            raise ValueError(f"Turn.index is 1-based, got {self.index}")
        if self.action_source not in ACTION_SOURCES:
            raise ValueError(f"Turn.action_source must be one of {ACTION_SOURCES}, got {self.action_source!r}")
        if not isinstance(self.action, str):
            raise ValueError(f"Turn.action must be a str (the empty action is ''), got {type(self.action).__name__}")
        object.__setattr__(self, "responses", tuple(self.responses))
        object.__setattr__(self, "action_responses", tuple(self.action_responses))

    @property
    def won(self) -> bool:
        return bool(self.next_observation.won)

    def replace(self, **changes) -> "Turn":
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True, eq=False)
class Trajectory:
    """One task's rollout under one strategy: o_1, the executed turns and why it ended (``END_REASONS``)."""

    task: Task
    strategy: str
    initial_observation: Observation
    turns: tuple[Turn, ...]
    end_reason: str
    info: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        object.__setattr__(self, "turns", tuple(self.turns))
        if self.end_reason not in END_REASONS:
            raise ValueError(f"Trajectory.end_reason must be one of {END_REASONS}, got {self.end_reason!r}")
        for position, turn in enumerate(self.turns, start=1):
            if turn.index != position:
                raise ValueError(f"turn {position} of {self.task.task_id} has index {turn.index}")

    @property
    def num_turns(self) -> int:
        return len(self.turns)

    @property
    def final_observation(self) -> Observation:
        return self.turns[-1].next_observation if self.turns else self.initial_observation

    @property
    def won(self) -> bool:
        return bool(self.final_observation.won)

    @property
    def score(self) -> float:
        return float(self.final_observation.score)

    @property
    def actions(self) -> tuple[str, ...]:
        return tuple(turn.action for turn in self.turns)

    def responses(self) -> list[Response]:
        """The training responses, in turn order."""
        return [response for turn in self.turns for response in turn.responses]

    def samples(self) -> list[Sample]:
        """``response_to_sample`` of every training response, in turn order. A response the engine failed
        (``finish_reason == "error"``: a host-side error cut it short) is not trained on."""
        return [response_to_sample(response) for response in self.responses() if response.finish_reason != "error"]

    def replace(self, **changes) -> "Trajectory":
        return dataclasses.replace(self, **changes)

    def quality_record(self, state_key: Callable[[Observation, Observation], Hashable] | None = None
                       ) -> metrics.TrajectoryRecord:
        """The App. C.5 record of the executed turns (invalid attempts included).

        ``state_key(observation, last_informative_observation)`` names the state an action was executed in.
        App. C.5 compares "identical sets of positive environment facts"; neither environment exposes its
        facts today, so the default (:func:`default_state_key`) uses an observable proxy.
        """
        state_key = state_key or default_state_key
        informative = self.initial_observation
        steps = []
        for turn in self.turns:
            action = turn.action or None
            valid = metrics.is_executed_action_valid(action, turn.observation.admissible_actions)
            steps.append(metrics.StepRecord(state=state_key(turn.observation, informative), action=action,
                                            next_observation=turn.next_observation.text,
                                            won=bool(turn.next_observation.won), valid=valid))
            if turn.next_observation.last_action_valid:
                informative = turn.next_observation
        return metrics.TrajectoryRecord(self.initial_observation.text, tuple(steps), success=self.won)


def default_state_key(observation: Observation, last_informative: Observation) -> Hashable:
    """An observable proxy of the state an action is executed in.

    ``observation.info["facts"]`` when the environment provides its positive facts (App. C.5's definition);
    otherwise the normalised text of the last observation produced by a valid action (or o_1) with the
    normalised admissible set of the current observation: an invalid attempt ("Nothing happens.") leaves
    the state, hence the key, unchanged.
    """
    facts = observation.info.get("facts") if observation.info else None
    if facts is not None:
        return frozenset(facts)
    return (normalize_observation(last_informative.text),
            frozenset(normalize_text(a) for a in observation.admissible_actions))


def trajectory_samples(trajectories: Iterable[Trajectory]) -> list[Sample]:
    """Every training sample of ``trajectories``, trajectory by trajectory, in turn order."""
    return [sample for trajectory in trajectories for sample in trajectory.samples()]


def rollout_quality(trajectories: Sequence[Trajectory],
                    state_key: Callable[[Observation, Observation], Hashable] | None = None
                    ) -> metrics.RolloutQuality:
    """App. C.5's Repeat / Yield / mean turns over ``trajectories``."""
    return metrics.rollout_quality([t.quality_record(state_key) for t in trajectories])


# ----------------------------------------------------------------------------------------------------------
# Outcomes of a batch of episodes
# ----------------------------------------------------------------------------------------------------------
def error_reason(error: BaseException) -> str:
    """An exception as a failure reason: ``"ExcType: message"`` (just the type when the message is empty)."""
    message = str(error)
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


@dataclasses.dataclass(frozen=True, eq=False)
class EpisodeOutcome:
    """What one task of a batch gave (``RolloutStrategy.play``): its ``trajectory``, or, when the episode
    failed, ``error`` (``"ExcType: message"``). Exactly one of the two is set. ``index``: the task's position in
    the batch (a task may be listed twice). ``exception``: the exception itself when there is one (for
    chaining; not part of the record)."""

    index: int
    task: Task
    trajectory: Trajectory | None = None
    error: str | None = None
    exception: BaseException | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self):
        if (self.trajectory is None) == (self.error is None):
            raise ValueError("an EpisodeOutcome holds exactly one of a trajectory and an error")
        if self.error is not None and not (isinstance(self.error, str) and self.error):
            raise ValueError(f"EpisodeOutcome.error must be a non-empty reason, got {self.error!r}")
        if self.trajectory is not None and self.trajectory.task.task_id != self.task.task_id:
            raise ValueError(f"trajectory of {self.trajectory.task.task_id!r} reported for task {self.task.task_id!r}")
        if isinstance(self.index, bool) or not isinstance(self.index, int) or self.index < 0:
            raise ValueError(f"EpisodeOutcome.index must be a non-negative int, got {self.index!r}")

    @classmethod
    def failed(cls, index: int, task: Task, error: BaseException) -> "EpisodeOutcome":
        return cls(index=index, task=task, error=error_reason(error), exception=error)

    @property
    def ok(self) -> bool:
        """The episode completed and ``trajectory`` holds it."""
        return self.trajectory is not None


class EpisodesFailed(RuntimeError):
    """Some episodes of a batch failed (``RolloutStrategy.collect``, raised after every episode finished).

    ``outcomes``: every task's ``EpisodeOutcome`` in batch order, the completed trajectories included;
    ``failed``: the failed ones. The message names each failed task id with its reason."""

    def __init__(self, outcomes: Sequence[EpisodeOutcome]):
        self.outcomes = list(outcomes)
        self.failed = [outcome for outcome in self.outcomes if not outcome.ok]
        lines = [f"  [{o.index}] {o.task.task_id}: {o.error}" for o in self.failed]
        super().__init__(f"{len(self.failed)} of {len(self.outcomes)} episodes failed:\n" + "\n".join(lines))

    def __reduce__(self):
        return (type(self), (self.outcomes,))

    @property
    def trajectories(self) -> list[Trajectory]:
        """The trajectories that completed, in batch order."""
        return [outcome.trajectory for outcome in self.outcomes if outcome.ok]
