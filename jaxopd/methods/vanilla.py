"""Vanilla multi-turn OPD: think-then-act rollouts, every full response trained with the dual-clip surrogate of the
sampled reverse KL (the baseline of all three papers)."""
from __future__ import annotations

from jaxopd.methods.base import Method, RolloutResources
from jaxopd.rollout.strategies.vanilla import VanillaStrategy


class VanillaOPD(Method):
    name = "vanilla-opd"
    default_loss = "opd"

    def build_strategy(self, resources: RolloutResources) -> VanillaStrategy:
        return VanillaStrategy(resources.engine, resources.pool, resources.tokenizer, self.rollout_config())
