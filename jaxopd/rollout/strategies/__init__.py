"""Rollout strategies, one file per strategy: ``vanilla`` (think-then-act), ``actfirst`` (ActFirst-OPD and its
ablations), ``sti`` (STI-OPD's stochastic teacher intervention), ``actionopd`` (ActionOPD's state groups).

Each runs episodes over an engine (``submit(Request) -> Future[Result]``) and a ``jaxopd_envs.pool.EnvPool`` and yields
``jaxopd.rollout.trajectory.Trajectory`` records, whose training responses convert to ``train.buffer.Sample``.
"""
from jaxopd.rollout.strategies.actfirst import ABLATIONS, ActFirstConfig, ActFirstStrategy, actfirst_config
from jaxopd.rollout.strategies.actionopd import (
                                                 ActionOPDConfig,
                                                 ActionOPDStrategy,
                                                 assign_group_advantages,
                                                 collection_samples,
)
from jaxopd.rollout.strategies.base import Decision, Episode, RolloutConfig, RolloutStrategy, request_seed
from jaxopd.rollout.strategies.sti import STIConfig, STIStrategy
from jaxopd.rollout.strategies.vanilla import VanillaStrategy

STRATEGIES = {cls.name: cls for cls in (VanillaStrategy, ActFirstStrategy, STIStrategy, ActionOPDStrategy)}

__all__ = ["STRATEGIES", "RolloutConfig", "RolloutStrategy", "Decision", "Episode", "request_seed",
           "VanillaStrategy", "ActFirstConfig", "ActFirstStrategy", "ABLATIONS", "actfirst_config",
           "STIConfig", "STIStrategy", "ActionOPDConfig", "ActionOPDStrategy", "assign_group_advantages",
           "collection_samples"]
