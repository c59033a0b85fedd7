"""ActionOPD: state-group candidates rewarded by agreement with a black-box teacher's actions, trained by the
clipped agreement-reward surrogate; one collection (one behaviour snapshot) feeds one epoch of minibatches."""
from __future__ import annotations

from typing import Sequence

from jaxopd.methods.base import Method, RolloutResources
from jaxopd.rollout.strategies.actionopd import ActionOPDConfig, ActionOPDStrategy, collection_samples
from jaxopd.rollout.trajectory import Trajectory
from jaxopd.sample import Sample


class ActionOPD(Method):
    name = "actionopd"
    default_loss = "action-opd"
    uses_teacher_engine = True
    trains_in_collections = True

    def rollout_config(self) -> ActionOPDConfig:
        c = self.config
        return ActionOPDConfig(**self.rollout_fields(), num_candidates=c.num_candidates,
                               num_teacher_samples=c.num_teacher_samples, match_bonus_scale=c.match_bonus_scale,
                               teacher_temperature=c.teacher_temperature, teacher_top_p=c.teacher_top_p)

    def build_strategy(self, resources: RolloutResources) -> ActionOPDStrategy:
        if resources.teacher_engine is None:
            raise ValueError("ActionOPD needs a teacher engine")
        return ActionOPDStrategy(resources.engine, resources.pool, resources.tokenizer, self.rollout_config(),
                                 teacher_engine=resources.teacher_engine)

    def samples(self, trajectories: Sequence[Trajectory], *, collection_id: int = -1) -> list[Sample]:
        # App. A.4: groups without a reward range carry no signal (advantage 0); only retained groups train
        return collection_samples(trajectories, retained_only=True, collection_id=collection_id)
