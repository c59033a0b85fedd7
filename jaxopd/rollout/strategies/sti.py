"""STI-OPD rollouts: stochastic teacher intervention guided by the teacher-student discrepancy (STI-OPD
Sec. 3.2, Eq. 4-8; Algorithm 1; App. B.3).

At every turn t the rollout student proposes a complete response ã_t ~ π_θ̄(·|h_t) (a full think-then-act
response under the App. B.3 thinking budget of ActFirst-OPD, this project's common protocol). The teacher
scores the proposal's tokens at the rollout temperature (a ``TeacherScorer``), giving r_{t,k} = π_T / π_θ̄
(Eq. 5), the k3 terms g_{t,k} = r - 1 - log r (Eq. 6), the length-normalised turn score s_t = mean_k g_{t,k}
over the model-generated tokens (Eq. 7) and α_t = s_t / (1 + s_t) (Eq. 8). Every turn draws
z_t ~ Bernoulli(α_t), with no threshold. When z_t = 1 "the teacher regenerates the entire turn" from the same
history and it replaces the proposal: "A discarded student proposal is neither appended to the history nor
included in the training buffer." The executed response is the turn's training sample: a teacher turn
carries ``teacher_generated`` with the teacher's sampling log-probs as behaviour (and as ``teacher_logp``);
a student turn carries the rollout-time teacher scores as ``teacher_logp`` (Eq. 11 needs them both).
``intervention_probability`` replaces Eq. 8's mapping (App. C.3's thresholds, or forcing α in tests).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

from jaxopd import losses
from jaxopd.rollout.scoring import TeacherScorer, as_teacher_scorer, checked_scores
from jaxopd.rollout.strategies.base import Decision, Episode, GenerationEngine, RolloutConfig, RolloutStrategy
from jaxopd.rollout.thinking import ThinkingBudget

__all__ = ["STIConfig", "STIStrategy", "turn_discrepancy"]


@dataclasses.dataclass(frozen=True)
class STIConfig(RolloutConfig):
    """STI-OPD options. Sampling: temperature 1.0, top-p 1.0 for student and teacher (App. B.3).

    ``teacher_thinking_budget``: the teacher turn's budget (None: the student's). ``intervention_probability``:
    a map s_t -> α_t in [0, 1] replacing Eq. 8 (None: α = s / (1 + s)).
    """

    teacher_thinking_budget: ThinkingBudget | None = None
    intervention_probability: Callable[[float], float] | None = None


def turn_discrepancy(student_logp: np.ndarray, teacher_logp: np.ndarray, model_generated: np.ndarray) -> float:
    """s_t of Eq. 7: the mean k3 estimate over the proposal's model-generated tokens (``losses``' estimator)."""
    score = losses.sti_turn_discrepancy(np.asarray(student_logp, np.float32)[None],
                                        np.asarray(teacher_logp, np.float32)[None],
                                        np.asarray(model_generated, np.float32)[None])
    return float(np.asarray(score)[0])


class STIStrategy(RolloutStrategy):
    """Stochastic teacher intervention; ``teacher_engine`` generates teacher turns, ``teacher_scorer`` scores
    proposals (any ``TeacherScorer`` or callable ``(prompt_ids, completion_ids) -> log-probs``). The teacher
    shares the student's tokenizer and prompts (scoring needs the same tokens)."""

    name = "sti"
    config: STIConfig

    def __init__(self, engine: GenerationEngine, pool, tokenizer, config: STIConfig | None = None, *,
                 teacher_engine: GenerationEngine, teacher_scorer: TeacherScorer | Callable[..., Any], **kwargs):
        config = config if config is not None else STIConfig()
        if not isinstance(config, STIConfig):
            raise ValueError(f"STIStrategy needs an STIConfig, got {type(config).__name__}")
        if not callable(getattr(teacher_engine, "submit", None)):
            raise ValueError("teacher_engine must have submit(Request) -> Future")
        super().__init__(engine, pool, tokenizer, config, **kwargs)
        self.teacher_engine = teacher_engine
        self.teacher_scorer = as_teacher_scorer(teacher_scorer)

    def intervention_probability(self, score: float) -> float:
        if self.config.intervention_probability is None:
            return float(losses.sti_intervention_probability(score))
        alpha = float(self.config.intervention_probability(score))
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"intervention_probability({score}) = {alpha} is not a probability")
        return alpha

    def decide(self, episode: Episode) -> Decision:
        prompt_ids = self.render("full", self.prompt_inputs(episode))
        proposal = self.submit_full(episode, prompt_ids, role="full").result()     # Vanilla's seeds
        scores = checked_scores(self.teacher_scorer.score(prompt_ids, proposal.response_ids),
                                len(proposal.response_ids))
        scores = np.where(proposal.model_generated, scores, 0.0).astype(np.float32)
        discrepancy = turn_discrepancy(proposal.logprobs, scores, proposal.model_generated)
        alpha = self.intervention_probability(discrepancy)
        intervened = bool(self.rng(episode, "intervention").random() < alpha)     # z_t ~ Bernoulli(α_t)
        info = {"discrepancy": discrepancy, "intervention_probability": alpha, "intervened": intervened,
                "proposal_tokens": len(proposal.response_ids), "proposal_action": proposal.action}
        if not intervened:
            response = proposal.replace(teacher_logp=scores)
            return Decision(action=response.executable_action, source="full", responses=(response,), info=info)
        teacher = self.submit_full(episode, prompt_ids, engine=self.teacher_engine, role="teacher",
                                   kind=self.TEACHER_KIND, budget=self.config.teacher_thinking_budget,
                                   teacher_generated=True).result()
        response = teacher.replace(teacher_logp=np.where(teacher.model_generated, teacher.logprobs, 0.0))
        return Decision(action=response.executable_action, source="teacher", responses=(response,), info=info)
