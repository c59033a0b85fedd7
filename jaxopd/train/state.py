"""The optimiser and the train state: AdamW with global-norm clipping and its learning-rate schedule, the
``TrainState`` an update changes, its shardings on the trainer mesh, and placing a batch on that mesh.

Owns what a train step reads and writes besides the loss: ``OptimizerConfig`` / ``make_optimizer``, ``TrainState``
(fresh, abstract for a restore, sharded) and ``batch_shardings`` / ``place_batch`` (rows over the data axis).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxopd.models.sharding import DATA_AXIS, DEFAULT_RULES, ShardingRules, copy_to, named_shardings
from jaxopd.train.buffer import TrainBatch

LR_SCHEDULES = ("constant", "cosine")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with global-norm gradient clipping; defaults are the papers' (ActFirst-OPD Table 6, ActionOPD
    Table 7): constant lr 1e-6, β = (0.9, 0.999), weight decay 0.01, clip 1.0.

    ``max_grad_norm=None`` disables clipping. Weight decay applies to every parameter, as torch's AdamW in
    verl does. ``schedule="cosine"`` (a fixed-length run such as SFT) warms the rate up linearly from 0 over
    ``warmup_steps`` and decays it along a half cosine to ``final_fraction`` of its peak at ``decay_steps``
    (constant after). ``decay_steps`` and ``warmup_steps`` are ignored by the constant schedule.
    """

    learning_rate: float = 1e-6
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01
    max_grad_norm: float | None = 1.0
    schedule: str = "constant"
    decay_steps: int | None = None
    warmup_steps: int = 0
    final_fraction: float = 0.1

    def __post_init__(self):
        if not self.learning_rate > 0:
            raise ValueError(f"OptimizerConfig.learning_rate must be > 0, got {self.learning_rate}")
        if not (0 <= self.b1 < 1 and 0 <= self.b2 < 1):
            raise ValueError(f"OptimizerConfig betas must lie in [0, 1), got b1={self.b1}, b2={self.b2}")
        if not self.eps > 0 or self.weight_decay < 0:
            raise ValueError(f"OptimizerConfig needs eps > 0 and weight_decay >= 0, got eps={self.eps}, "
                             f"weight_decay={self.weight_decay}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"OptimizerConfig.max_grad_norm must be > 0 or None, got {self.max_grad_norm}")
        if self.schedule not in LR_SCHEDULES:
            raise ValueError(f"OptimizerConfig.schedule must be one of {LR_SCHEDULES}, got {self.schedule!r}")
        if self.schedule == "cosine":
            if not isinstance(self.decay_steps, int) or isinstance(self.decay_steps, bool) or self.decay_steps < 1:
                raise ValueError(f"a cosine schedule needs decay_steps >= 1, got {self.decay_steps!r}")
            if not 0 <= self.warmup_steps < self.decay_steps:
                raise ValueError(f"warmup_steps must lie in [0, decay_steps={self.decay_steps}), "
                                 f"got {self.warmup_steps}")
            if not 0 <= self.final_fraction <= 1:
                raise ValueError(f"final_fraction must lie in [0, 1], got {self.final_fraction}")

    def learning_rate_schedule(self) -> float | optax.Schedule:
        """The rate optax's AdamW takes: the constant, or the warm-up + cosine schedule of the step count."""
        if self.schedule == "constant":
            return self.learning_rate
        return optax.warmup_cosine_decay_schedule(0.0, self.learning_rate, self.warmup_steps, self.decay_steps,
                                                  end_value=self.learning_rate * self.final_fraction)


def make_optimizer(config: OptimizerConfig = OptimizerConfig()) -> optax.GradientTransformation:
    """``clip_by_global_norm`` (if enabled) followed by AdamW at ``config``'s learning rate (or schedule)."""
    adamw = optax.adamw(config.learning_rate_schedule(), b1=config.b1, b2=config.b2, eps=config.eps,
                        weight_decay=config.weight_decay)
    if config.max_grad_norm is None:
        return adamw
    return optax.chain(optax.clip_by_global_norm(config.max_grad_norm), adamw)


@dataclasses.dataclass(frozen=True)
class TrainState:
    """Everything an update changes: ``step`` (int32 scalar, = number of updates = policy version),
    ``params`` (the student's ``nnx.State`` of parameters) and ``opt_state``."""

    step: Any
    params: Any
    opt_state: Any


jax.tree_util.register_dataclass(TrainState, data_fields=["step", "params", "opt_state"], meta_fields=[])


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def train_state_shardings(abstract_params: Any, optimizer: optax.GradientTransformation, mesh: Mesh,
                          rules: ShardingRules = DEFAULT_RULES, *, param_shardings: Any = None) -> TrainState:
    """Shardings of a ``TrainState`` on ``mesh``: parameters and every optimizer-state copy of them by the
    parameters' logical axes (or ``param_shardings``, for trained parameters that are no model state, such as LoRA
    adapters), scalars (step, Adam count) replicated."""
    if param_shardings is None:
        param_shardings = named_shardings(abstract_params, mesh, rules)
    abstract_opt_state = jax.eval_shape(optimizer.init, abstract_params)
    opt_shardings = optax.tree_map_params(optimizer, lambda _, sharding: sharding, abstract_opt_state,
                                          param_shardings, transform_non_params=lambda _: replicated(mesh))
    return TrainState(step=replicated(mesh), params=param_shardings, opt_state=opt_shardings)


def abstract_train_state(abstract_params: nnx.State, optimizer: optax.GradientTransformation,
                         shardings: TrainState) -> TrainState:
    """``jax.ShapeDtypeStruct`` of each leaf of the train state, with its sharding (a restore target)."""
    abstract = TrainState(jax.ShapeDtypeStruct((), jnp.int32), abstract_params,
                          jax.eval_shape(optimizer.init, abstract_params))
    return jax.tree.map(lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
                        abstract, shardings)


def init_train_state(params: nnx.State, optimizer: optax.GradientTransformation, shardings: TrainState) -> TrainState:
    """A fresh train state (step 0, optimizer initialised) laid out by ``shardings``.

    The parameters are copied, never aliased, so that a donating train step cannot delete the caller's arrays.
    """
    params = copy_to(params, shardings.params)
    opt_state = jax.device_put(optimizer.init(params), shardings.opt_state)
    return TrainState(jax.device_put(jnp.zeros((), jnp.int32), shardings.step), params, opt_state)


def batch_shardings(mesh: Mesh, data_axis: str = DATA_AXIS) -> TrainBatch:
    """A ``TrainBatch`` of shardings: rows split over ``data_axis``, replicated over the other axes."""
    rows = NamedSharding(mesh, PartitionSpec(data_axis))
    return TrainBatch(*([rows] * len(dataclasses.fields(TrainBatch))))


def check_rows_divide(rows: int, sharding: NamedSharding) -> None:
    axes = sharding.spec[0] if len(sharding.spec) else None
    axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    split = 1
    for axis in axes:
        split *= sharding.mesh.shape[axis]
    if rows % split:
        raise ValueError(f"a batch of {rows} rows cannot be split over the {split} data-parallel devices of the "
                         f"mesh; pad it to a multiple of {split} (collate_samples(batch_size=...))")


def place_batch(batch: TrainBatch, shardings: TrainBatch) -> TrainBatch:
    """Moves a host (or other-mesh) batch onto ``shardings``, checking that the rows divide evenly."""
    check_rows_divide(batch.tokens.shape[0], shardings.tokens)
    return jax.device_put(batch, shardings)



__all__ = ["LR_SCHEDULES", "OptimizerConfig", "make_optimizer", "TrainState", "replicated", "train_state_shardings",
           "abstract_train_state", "init_train_state", "batch_shardings", "check_rows_divide", "place_batch"]
