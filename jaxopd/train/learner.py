"""The student's side of a training run in one object, ``Learner``: used by the distillation loop and by SFT.

Owns the train state on the trainer mesh and the one compiled step over it, the teacher's scorer and parameters on
the teacher mesh (when the loss reads teacher log-probs), turning samples into a padded batch on the trainer mesh,
the run's checkpoints (state, sample buffer, metadata) and pushing the current weights to a rollout engine.

Multi-process (``jaxopd.train.distributed``): the trainer mesh spans every process, the teacher and rollout meshes
are each process's own (``build_process_meshes``); every process holds the same host batch, scores its own rows on
its own teacher and contributes them to the global batch, and gathers the updated weights for its own engine.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Mapping, Sequence

import dataclasses

import jax
import numpy as np
from flax import nnx

from jaxopd.models.decoder import CausalLM
from jaxopd.models.lora import LoraConfig, init_adapters, merge
from jaxopd.models.sharding import copy_to, named_shardings
from jaxopd.train.buffer import Sample, SampleBuffer, TrainBatch, collate_samples
from jaxopd.train.checkpoint import RestoredRun, TrainCheckpointer
from jaxopd.train.logprobs import check_supervised_fit
from jaxopd.train import distributed
from jaxopd.train.mesh import RoleMeshes, build_process_meshes
from jaxopd.train.scoring import make_teacher_scorer, score_batch
from jaxopd.train.state import (OptimizerConfig, TrainState, abstract_train_state, batch_shardings, init_train_state,
                                make_optimizer, place_batch, replicated, train_state_shardings)
from jaxopd.train.step import LossConfig, make_train_step
from jaxopd.train.sync import WeightSync


def batch_length(longest: int, limit: int) -> int:
    """Training batches are padded to a multiple of 128 tokens (at most ``limit`` rounded up to 16): few shapes,
    little padding."""
    return max(longest, min(-(-longest // 128) * 128, -(-limit // 16) * 16))


class Learner:
    """The student being trained: ``restore_or_init()``, then per update ``collate(samples)`` → ``place(batch)``
    (teacher-scored when the loss needs it) → ``step(batch)`` → ``push(engine)``; ``save(buffer, metadata)`` writes a
    checkpoint of ``version``, ``model()`` is the student with the current weights, ``close()`` ends the checkpoints.

    ``loss`` / ``optimizer``: the step's loss and AdamW settings; ``checkpoints``: the folder of the run's
    checkpoints (the newest ``keep_checkpoints`` kept); ``teacher``: the teacher model, needed when ``loss`` reads
    teacher log-probs; ``batch_size`` rows of at most ``max_train_tokens`` tokens make a batch. ``meshes`` default to
    the role plan of this host's devices. ``lora``: train LoRA adapters (fresh from ``seed``) over the frozen
    student instead of the whole model; the engine and ``model()`` get the base with the adapters merged.
    """

    def __init__(self, student: CausalLM, loss: LossConfig, optimizer: OptimizerConfig,
                 checkpoints: str | os.PathLike, *, batch_size: int, max_train_tokens: int,
                 teacher: CausalLM | None = None, keep_checkpoints: int | None = 3, meshes: RoleMeshes | None = None,
                 lora: LoraConfig | None = None, seed: int = 0, log: Callable[[str], None] = print):
        if loss.needs_teacher_logp and teacher is None:
            raise ValueError(f"the {loss.kind} loss reads the teacher's log-probabilities: give the Learner a teacher")
        self.loss_config, self.batch_size, self.max_train_tokens, self.log = loss, batch_size, max_train_tokens, log
        self.meshes = meshes or build_process_meshes()
        self.graphdef, student_params = nnx.split(student, nnx.Param)
        self._model_params = student_params                 # the structure the rollout engine takes
        self._optimizer = make_optimizer(optimizer)
        self.lora, self._base, self._merge = lora, None, None
        trainer = self.meshes.trainer
        if lora is None:
            self._initial_params = student_params
            self.state_shardings = train_state_shardings(student_params, self._optimizer, trainer)
        else:       # the student's weights stay frozen on the trainer mesh; the state trains adapters
            base_shardings = named_shardings(student_params, trainer)
            self._base = copy_to(student_params, base_shardings)
            self._initial_params = init_adapters(student_params, lora, jax.random.key(seed),
                                                 num_layers=student.config.num_layers)
            adapter_shardings = jax.tree.map(lambda _: replicated(trainer), self._initial_params)
            self.state_shardings = train_state_shardings(self._initial_params, self._optimizer, trainer,
                                                         param_shardings=adapter_shardings)
            self._merge = jax.jit(lambda base, adapters: merge(base, adapters, lora),
                                  in_shardings=(base_shardings, adapter_shardings), out_shardings=base_shardings)
        self.rows = batch_shardings(trainer)
        self._train_step = make_train_step(self.graphdef, self._optimizer, loss, self.state_shardings, self.rows,
                                           lora=lora, base_shardings=None if lora is None else base_shardings)
        self._sync: WeightSync | None = None
        self.scorer = self.teacher_params = None
        if loss.needs_teacher_logp:
            teacher_graphdef, teacher_state = nnx.split(teacher, nnx.Param)
            teacher_shardings = named_shardings(teacher_state, self.meshes.teacher)
            self.teacher_params = copy_to(teacher_state, teacher_shardings)
            self.scorer = make_teacher_scorer(teacher_graphdef, teacher_shardings, self.meshes.teacher,
                                              temperature=loss.temperature, logits_chunk_size=loss.logits_chunk_size,
                                              max_supervised_tokens=loss.max_supervised_tokens,
                                              dense=loss.needs_teacher_dense, top_k=loss.exact_top_k)
        self.checkpointer = TrainCheckpointer(checkpoints, max_to_keep=keep_checkpoints)
        self.state: TrainState | None = None
        self.version = 0

    def restore_or_init(self) -> RestoredRun | None:
        """The newest readable checkpoint's state (damaged newer ones are logged and passed over), else a fresh one;
        returns what was restored (its buffer and metadata), or None."""
        restored = self.checkpointer.restore_latest(
            abstract_train_state(self._initial_params, self._optimizer, self.state_shardings),
            warn=lambda message: self.log(f"warning: {message}"))
        self.state = (restored.state if restored is not None
                      else init_train_state(self._initial_params, self._optimizer, self.state_shardings))
        self.version = int(jax.device_get(self.state.step))
        return restored

    def collate(self, samples: Sequence[Sample]) -> TrainBatch:
        """The host batch of ``samples``: ``batch_size`` rows padded to :func:`batch_length`; ``ValueError`` when a
        row has more supervised tokens than the loss projects."""
        batch = collate_samples(samples, batch_size=self.batch_size,
                                length=batch_length(max(len(s) for s in samples), self.max_train_tokens))
        check_supervised_fit(batch.loss_mask, self.loss_config.max_supervised_tokens)
        return batch

    def place(self, batch: TrainBatch) -> TrainBatch:
        """``batch`` on the trainer mesh, with the teacher's log-probs filled in (and ready) when the loss reads
        them."""
        if distributed.is_multiprocess():
            return self._place_global(batch)
        if self.scorer is None:
            return place_batch(batch, self.rows)
        batch = score_batch(self.scorer, self.teacher_params, batch, self.rows)
        jax.block_until_ready(batch.teacher_logp)
        return batch

    def _place_global(self, batch: TrainBatch) -> TrainBatch:
        """Multi-process ``place``: ``batch`` is the same host batch on every process; this process scores its own
        rows of it on its own teacher mesh and contributes them to the global batch."""
        rows = batch.shape[0]
        mine = distributed.process_local_rows(rows, self.rows.tokens)
        local = TrainBatch(**{f.name: np.asarray(getattr(batch, f.name))[mine] for f in dataclasses.fields(batch)})
        if self.scorer is not None:
            scores = self.scorer(self.teacher_params, local.tokens, local.positions, local.attention_mask,
                                 local.loss_mask)
            local = local.replace(teacher_logp=np.asarray(scores.logp))
            if scores.dense_logp is not None:
                local = local.replace(teacher_dense_logp=np.asarray(scores.dense_logp))
            if scores.top_ids is not None:
                local = local.replace(teacher_top_ids=np.asarray(scores.top_ids))
        return distributed.global_batch(local, self.rows, rows)

    def step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer update on ``batch``; the policy version moves on by one. Returns the step's metrics."""
        base = () if self.lora is None else (self._base,)
        self.state, metrics = self._train_step(self.state, batch, *base)
        self.version += 1
        return {name: float(value) for name, value in jax.device_get(metrics).items()}

    def push(self, engine: Any) -> None:
        """The current weights to a rollout engine (``engine.update_weights``), tagged with the version."""
        if self._sync is None:
            self._sync = WeightSync.for_mesh(self._model_params, self.meshes.rollout)
        params = self.model_params()
        if distributed.is_multiprocess():       # the trainer's shards span processes: gathered by a collective
            params = distributed.host_params(params)
        engine.update_weights(self._sync(params, self.version).params, version=self.version)

    def save(self, buffer: SampleBuffer | None = None, metadata: Mapping[str, Any] | None = None) -> None:
        """A checkpoint of the current version: the state, ``buffer`` and ``metadata``."""
        self.checkpointer.save(self.state, buffer, dict(metadata or {}))

    def model_params(self) -> nnx.State:
        """The student's current parameters on the trainer mesh (with LoRA: the base with the adapters merged)."""
        return self.state.params if self.lora is None else self._merge(self._base, self.state.params)

    def adapters(self) -> Any:
        """The current LoRA adapters on the host (``jaxopd.models.folders.save_adapted`` writes them)."""
        if self.lora is None:
            raise ValueError("this Learner trains the whole model (no LoRA adapters)")
        if distributed.is_multiprocess():
            return distributed.host_params(self.state.params)
        return jax.device_get(self.state.params)

    def model(self) -> CausalLM:
        """The student with the current weights, on the host."""
        params = self.model_params()
        return nnx.merge(self.graphdef, distributed.host_params(params) if distributed.is_multiprocess()
                         else jax.device_get(params))

    def close(self) -> None:
        self.checkpointer.close()


__all__ = ["Learner", "batch_length"]
