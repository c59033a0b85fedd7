"""ActionOPD rollouts: state groups of student candidates scored against teacher samples, the best one executed
(ActionOPD Sec. 2.2-2.3, Algorithm 1, App. A.3-A.4, B.4).

At each state s_g of the task's single rollout:

* **Teacher samples** (App. A.3): K = 3 teacher responses from the same public context, each with "two
  retries for parser/schema-invalid output; valid samples are retained without regeneration". The valid ones
  form the multiset M_T(s_g) (nominal K kept in the bonus denominator). "With no valid samples, collection
  ends without a student group": the rollout ends here (``end_reason='no_teacher_sample'``).
* **Candidates** (Sec. 2.3, Table 8): N = 4 full think-then-act student responses at temperature 0.6, top-p
  0.95, top-k 20; their log-probs are the engine's, taken at the rollout temperature over the full
  vocabulary, without top-p/top-k truncation (App. A.4, Eq. 8).
* **Rewards** (Eq. 5-6): c = exact matches of normalised actions against the multiset, r_λ with λ = 0.5;
  an invalid candidate gets -1 and stays in the group.
* **Execution**: the parsed action of an argmax candidate, "uniform tie-breaking among maximum-reward
  candidates" (App. B.4); an unparsable winner executes the empty action.

The candidates are the training responses. Group centering and batch whitening (Eq. 7, App. A.4) need the
whole collection: ``assign_group_advantages`` runs ``losses.action_group_advantages`` over every group of a
batch of trajectories and stores A_{g,i} and the retained flag on the candidates (before that they are
not retained, so an unassigned candidate never trains). Teacher and candidate requests are submitted
together: the multiset does not depend on the candidates, so this changes timing only.

Validity: a response is valid when its ``<action>`` parses (``require_admissible``: and is admissible in
the state, App. B.5's rule); the same rule filters teacher samples and marks invalid candidates.
"""
from __future__ import annotations

import dataclasses
from concurrent.futures import Future
from typing import Any, Sequence

import numpy as np

from jaxopd import losses
from jaxopd.rollout.actions import action_agreement_rewards
from jaxopd.rollout.strategies.base import (
    Decision,
    Episode,
    GenerationEngine,
    RolloutConfig,
    RolloutStrategy,
    is_action_valid,
)
from jaxopd.rollout.thinking import ThinkingBudget
from jaxopd.rollout.trajectory import Response, Trajectory, trajectory_samples
from jaxopd.sample import Sample

__all__ = ["ActionOPDConfig", "ActionOPDStrategy", "assign_group_advantages", "collection_samples"]


@dataclasses.dataclass(frozen=True)
class ActionOPDConfig(RolloutConfig):
    """ActionOPD options; defaults from Table 7-8 and App. A.3-A.4 (N = 4, K = 3, λ = 0.5, two retries).

    Student candidates sample at 0.6 / 0.95 / top-k 20; the teacher at 0.6 / 0.95 without top-k.
    ``teacher_thinking_budget``: the teacher's budget (None: the student's).
    """

    temperature: float = 0.6
    top_p: float = 0.95
    top_k: int = 20
    num_candidates: int = 4
    num_teacher_samples: int = 3
    teacher_retries: int = 2
    match_bonus_scale: float = 0.5
    teacher_temperature: float = 0.6
    teacher_top_p: float = 0.95
    teacher_top_k: int = 0
    teacher_thinking_budget: ThinkingBudget | None = None
    require_admissible: bool = False

    def __post_init__(self):
        super().__post_init__()
        for name in ("num_candidates", "num_teacher_samples"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.teacher_retries < 0:
            raise ValueError(f"teacher_retries must be >= 0, got {self.teacher_retries}")


class ActionOPDStrategy(RolloutStrategy):
    """State-group rollouts against a black-box teacher engine (``teacher_engine``; generation only).

    ``teacher_tokenizer``: the teacher's own tokenizer for its native prompt (default: the student's).
    """

    name = "actionopd"
    config: ActionOPDConfig

    def __init__(self, engine: GenerationEngine, pool, tokenizer, config: ActionOPDConfig | None = None, *,
                 teacher_engine: GenerationEngine, teacher_tokenizer: Any = None, **kwargs):
        config = config if config is not None else ActionOPDConfig()
        if not isinstance(config, ActionOPDConfig):
            raise ValueError(f"ActionOPDStrategy needs an ActionOPDConfig, got {type(config).__name__}")
        if not callable(getattr(teacher_engine, "submit", None)):
            raise ValueError("teacher_engine must have submit(Request) -> Future")
        super().__init__(engine, pool, tokenizer, config, **kwargs)
        self.teacher_engine = teacher_engine
        self.teacher_tokenizer = teacher_tokenizer or tokenizer

    def is_valid(self, episode: Episode, response: Response) -> bool:
        if response.action is None:
            return False
        return not self.config.require_admissible or is_action_valid(episode.benchmark, response.action,
                                                                     episode.observation)

    def _submit_teacher(self, episode: Episode, prompt_ids: list[int], sample: int, attempt: int) -> Future:
        config = self.config
        index = sample * (config.teacher_retries + 1) + attempt
        params = self.sampling_params(1, self.seed(episode, "teacher", index), temperature=config.teacher_temperature,
                                      top_p=config.teacher_top_p, top_k=config.teacher_top_k)
        return self.submit_full(episode, prompt_ids, engine=self.teacher_engine, tokenizer=self.teacher_tokenizer,
                                kind=self.TEACHER_KIND, params=params, budget=config.teacher_thinking_budget,
                                teacher_generated=True)

    def decide(self, episode: Episode) -> Decision | None:
        config = self.config
        inputs = self.prompt_inputs(episode)
        prompt_ids = self.render("full", inputs)
        teacher_prompt = (prompt_ids if self.teacher_tokenizer is self.tokenizer
                          else self.render("full", inputs, self.teacher_tokenizer))
        teacher_futures = [self._submit_teacher(episode, teacher_prompt, k, 0)
                           for k in range(config.num_teacher_samples)]
        candidate_futures = [self.submit_full(episode, prompt_ids, role="candidate", index=i,
                                              kind=self.CANDIDATE_KIND) for i in range(config.num_candidates)]
        teacher_responses: list[Response] = []
        teacher_actions: list[str] = []
        for k, future in enumerate(teacher_futures):
            for attempt in range(config.teacher_retries + 1):
                if attempt:
                    future = self._submit_teacher(episode, teacher_prompt, k, attempt)
                response = future.result()
                teacher_responses.append(response)
                if self.is_valid(episode, response):
                    teacher_actions.append(response.action)
                    break
        candidates = [future.result() for future in candidate_futures]
        if not teacher_actions:                   # App. A.3: no valid sample ends the collection, no group
            episode.end_reason = "no_teacher_sample"
            episode.state["teacher_requests_last_state"] = len(teacher_responses)
            return None
        parsed = [c.action if self.is_valid(episode, c) else None for c in candidates]
        rewards = action_agreement_rewards(parsed, teacher_actions, config.num_teacher_samples,
                                           config.match_bonus_scale)
        best = max(rewards)
        ties = [i for i, reward in enumerate(rewards) if reward == best]
        selected = int(self.rng(episode, "tie_break").choice(ties))            # uniform tie-break
        responses = tuple(c.replace(reward=float(r), advantage=0.0, retained=False)
                          for c, r in zip(candidates, rewards))
        info = {"rewards": tuple(float(r) for r in rewards), "selected": selected, "ties": tuple(ties),
                "teacher_actions": tuple(teacher_actions), "teacher_requests": len(teacher_responses)}
        return Decision(action=candidates[selected].executable_action, source="candidate", responses=responses,
                        action_responses=tuple(teacher_responses), info=info)


def assign_group_advantages(trajectories: Sequence[Trajectory], *, epsilon: float = 1e-8, min_candidates: int = 2,
                            min_reward_range: float = 1e-8) -> list[Trajectory]:
    """Eq. 7 / App. A.4 over one collection: every state group (a turn's candidates) is centred on its mean
    and the centred rewards of all retained groups are divided by their shared population std + ε.

    Returns the trajectories with each candidate's ``advantage`` and ``retained`` set (groups without a
    reward range, or with fewer than ``min_candidates`` candidates, are not retained). Every group of a
    collection has supervision (a state without a valid teacher sample forms no group).
    """
    trajectories = list(trajectories)
    groups = [(ti, ui) for ti, trajectory in enumerate(trajectories) for ui, turn in enumerate(trajectory.turns)
              if turn.responses]
    if not groups:
        return trajectories
    width = max(len(trajectories[ti].turns[ui].responses) for ti, ui in groups)
    rewards = np.zeros((len(groups), width), np.float32)
    mask = np.zeros((len(groups), width), bool)
    for g, (ti, ui) in enumerate(groups):
        for i, response in enumerate(trajectories[ti].turns[ui].responses):
            if response.reward is None:
                raise ValueError(f"{trajectories[ti].task.task_id} turn {ui + 1}: a candidate without a reward "
                                 "(not an ActionOPD trajectory?)")
            rewards[g, i], mask[g, i] = response.reward, True
    result = losses.action_group_advantages(rewards, mask, epsilon=epsilon, min_candidates=min_candidates,
                                            min_reward_range=min_reward_range)
    advantages, retained = np.asarray(result.advantages), np.asarray(result.retained)
    turns = [list(t.turns) for t in trajectories]
    for g, (ti, ui) in enumerate(groups):
        turn = turns[ti][ui]
        responses = tuple(r.replace(advantage=float(advantages[g, i]), retained=bool(retained[g, i]))
                          for i, r in enumerate(turn.responses))
        turns[ti][ui] = turn.replace(responses=responses,
                                     info={**turn.info, "retained": bool(retained[g].any()),
                                           "reward_std": float(result.reward_std)})
    return [t.replace(turns=tuple(new)) for t, new in zip(trajectories, turns)]


def collection_samples(trajectories: Sequence[Trajectory], *, retained_only: bool = False,
                       collection_id: int = -1) -> list[Sample]:
    """The training samples of one ActionOPD collection: advantages assigned, then every candidate (or only
    those of retained groups) converted. The collection is one behaviour snapshot trained for one epoch of
    minibatches (App. A.4): ``collection_id >= 0`` tags its samples so that ``train.buffer.SampleBuffer``
    keeps the whole collection once its first minibatch is taken, whatever the number of updates it feeds."""
    samples = trajectory_samples(assign_group_advantages(trajectories))
    if collection_id >= 0:
        samples = [dataclasses.replace(s, collection=collection_id) for s in samples]
    return [s for s in samples if s.retained] if retained_only else samples
