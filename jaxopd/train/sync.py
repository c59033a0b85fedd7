"""Weight synchronisation from the trainer mesh to the rollout mesh after each update.

Owns copying the student's parameters onto the rollout engines' shardings (optionally cast to the
rollout dtype on the way) and tagging them with the policy version they represent.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jaxopd.models.sharding import DEFAULT_RULES, ShardingRules, copy_to, named_shardings


@dataclasses.dataclass(frozen=True)
class RolloutWeights:
    """The rollout-side copy of the student: an ``nnx.State`` on the rollout mesh and its policy version."""

    params: nnx.State
    version: int


class WeightSync:
    """Copies trainer parameters to fixed rollout shardings: ``sync(params, version) -> RolloutWeights``.

    ``dtype`` (e.g. ``'bfloat16'``) casts on the trainer devices before the transfer, so a float32 master
    copy can feed a bfloat16 rollout engine; ``None`` keeps each parameter's dtype. The rollout copy never
    shares buffers with the trainer's, also when the roles are colocated on the same devices.
    """

    def __init__(self, rollout_shardings: nnx.State, dtype: str | jnp.dtype | None = None):
        self.rollout_shardings = rollout_shardings
        self.dtype = None if dtype is None else jnp.dtype(dtype)

    @classmethod
    def for_mesh(cls, abstract_params: nnx.State, rollout_mesh: Mesh, rules: ShardingRules = DEFAULT_RULES,
                 dtype: str | jnp.dtype | None = None) -> "WeightSync":
        """Rollout shardings from the parameters' logical axes on ``rollout_mesh``."""
        return cls(named_shardings(abstract_params, rollout_mesh, rules), dtype)

    def __call__(self, params: nnx.State, version: int) -> RolloutWeights:
        if jax.tree.structure(params) != jax.tree.structure(self.rollout_shardings):
            raise ValueError("WeightSync: the parameters do not have the structure of the rollout shardings "
                             "(different model architecture?)")
        if self.dtype is not None:
            params = _cast(params, self.dtype)
        # new buffers even when the roles share devices: the next (donating) train step must not delete them
        return RolloutWeights(copy_to(params, self.rollout_shardings), int(version))


def _cast(params: Any, dtype: jnp.dtype) -> Any:
    return jax.tree.map(lambda x: x if x.dtype == dtype else x.astype(dtype), params)


def sync_weights(params: nnx.State, rollout_shardings: nnx.State, dtype: str | jnp.dtype | None = None) -> nnx.State:
    """One-shot form of :class:`WeightSync`: the parameters placed on ``rollout_shardings``."""
    return WeightSync(rollout_shardings, dtype)(params, 0).params


__all__ = ["RolloutWeights", "WeightSync", "sync_weights"]
