"""STI-OPD: the teacher scores each student proposal and replaces it with probability α(s_t); the mixed-policy
turns are trained with the importance-weighted reverse KL in its practical clipped form (``sti-opd``)."""
from __future__ import annotations

from jaxopd.methods.base import Method, RolloutResources
from jaxopd.rollout.strategies.sti import STIConfig, STIStrategy


class STIOPD(Method):
    name = "sti"
    default_loss = "sti-opd"
    uses_teacher_engine = True

    def rollout_config(self) -> STIConfig:
        return STIConfig(**self.rollout_fields())

    def build_strategy(self, resources: RolloutResources) -> STIStrategy:
        if resources.teacher_engine is None or resources.teacher_scorer is None:
            raise ValueError("STI-OPD needs a teacher engine and a teacher scorer")
        return STIStrategy(resources.engine, resources.pool, resources.tokenizer, self.rollout_config(),
                           teacher_engine=resources.teacher_engine, teacher_scorer=resources.teacher_scorer)
