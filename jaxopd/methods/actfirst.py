"""ActFirst-OPD and its ablations: act-first fast actions (reference-conditioned inverse dynamics, next-action
prediction fallback) drive the environment; the asynchronous full responses are trained with the OPD loss."""
from __future__ import annotations

from jaxopd.methods.base import Method, RolloutResources
from jaxopd.rollout.strategies.actfirst import ABLATIONS, ActFirstConfig, ActFirstStrategy, actfirst_config


class ActFirstOPD(Method):
    name = "actfirst"
    default_loss = "opd"

    @property
    def ablation(self) -> str:
        suffix = self.config.method.removeprefix("actfirst").removeprefix("-")
        ablation = suffix or "actfirst"
        if ablation not in ABLATIONS:
            raise ValueError(f"unknown ActFirst-OPD ablation {ablation!r}; expected one of {sorted(ABLATIONS)}")
        return ablation

    @property
    def needs_references(self) -> bool:  # type: ignore[override]
        return self.rollout_config().uses_reference

    def rollout_config(self) -> ActFirstConfig:
        return actfirst_config(self.ablation, fast_action_max_tokens=self.config.fast_action_tokens,
                               **self.rollout_fields())

    def build_strategy(self, resources: RolloutResources) -> ActFirstStrategy:
        return ActFirstStrategy(resources.engine, resources.pool, resources.tokenizer, self.rollout_config())
