"""What a distillation method is to the training loop: its rollout strategy, its loss, and how its trajectories
become training samples.

Owns ``Method`` (one subclass per method, one file each: ``vanilla``, ``actfirst``, ``sti``, ``actionopd``) and
``RolloutResources``, the engines, scorer, pool, tokenizer and references a strategy is built from. A method
says whether it needs the teacher's generation engine (STI-OPD, ActionOPD), reference trajectories (ActFirst-OPD
guidance), teacher log-probabilities at train time (every loss but ActionOPD's), and whether it trains in
collections (ActionOPD: one behaviour snapshot, then one epoch of minibatches) or on a stream of samples.
"""
from __future__ import annotations

import abc
import dataclasses
from typing import Any, ClassVar, Mapping, Sequence

from jaxopd.methods.config import RunConfig
from jaxopd.rollout.strategies.base import RolloutConfig, RolloutStrategy
from jaxopd.rollout.thinking import ThinkingBudget
from jaxopd.rollout.trajectory import Trajectory, trajectory_samples
from jaxopd.sample import Sample
from jaxopd.train.step import LossConfig

__all__ = ["RolloutResources", "Method"]


@dataclasses.dataclass
class RolloutResources:
    """Everything a strategy is built from. ``teacher_engine`` generates teacher responses (STI-OPD's
    interventions, ActionOPD's teacher samples); ``teacher_scorer`` scores student proposals at rollout time
    (STI-OPD); ``references`` maps task ids to reference trajectories (ActFirst-OPD)."""

    engine: Any
    pool: Any
    tokenizer: Any
    teacher_engine: Any = None
    teacher_scorer: Any = None
    references: Mapping[str, Any] | None = None


class Method(abc.ABC):
    """One distillation method of a run (see the module docstring)."""

    name: ClassVar[str] = ""
    default_loss: ClassVar[str] = "opd"
    uses_teacher_engine: ClassVar[bool] = False
    needs_references: ClassVar[bool] = False
    trains_in_collections: ClassVar[bool] = False

    def __init__(self, config: RunConfig):
        self.config = config

    # ------------------------------------------------------------------ rollout
    def thinking_budget(self) -> ThinkingBudget:
        c = self.config
        return ThinkingBudget(first_stage_tokens=c.first_stage_tokens, total_tokens=c.total_tokens,
                              second_stage_max_tokens=c.second_stage_tokens)

    def rollout_fields(self) -> dict[str, Any]:
        """The ``RolloutConfig`` fields every strategy shares, from the run config."""
        c = self.config
        return dict(max_turns=c.max_turns, max_prompt_tokens=c.max_prompt_tokens,
                    thinking_budget=self.thinking_budget(), temperature=c.temperature, top_p=c.top_p,
                    top_k=c.top_k, seed=c.seed)

    def rollout_config(self) -> RolloutConfig:
        return RolloutConfig(**self.rollout_fields())

    @abc.abstractmethod
    def build_strategy(self, resources: RolloutResources) -> RolloutStrategy:
        """The method's rollout strategy over ``resources``."""

    # ------------------------------------------------------------------ training
    def loss_config(self) -> LossConfig:
        """The loss, at the temperature the trained tokens were sampled with."""
        c = self.config
        return LossConfig.for_rollout(self.rollout_config(), kind=c.loss or self.default_loss, clip_eps=c.clip_eps,
                                      dual_clip=c.dual_clip, logits_chunk_size=c.logits_chunk_size,
                                      max_supervised_tokens=c.max_supervised_tokens, exact_top_k=c.exact_top_k,
                                      advantage_logp=c.advantage_logp, remat_layers=c.remat_layers)

    def samples(self, trajectories: Sequence[Trajectory], *, collection_id: int = -1) -> list[Sample]:
        """The training samples of finished trajectories."""
        return trajectory_samples(trajectories)
