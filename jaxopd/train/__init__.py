"""The trainer side of distillation: role meshes, the sharded train step and teacher scorer, the sample
buffer, trainer → rollout weight sync, checkpoints and multi-process runs (one module each)."""
from jaxopd.train.buffer import BufferStats, Sample, SampleBuffer, TrainBatch, collate_samples
from jaxopd.train.checkpoint import RestoredRun, TrainCheckpointer
from jaxopd.train.distributed import (DistributedConfig, global_batch, host_params, initialize, is_primary,
                                      process_local_rows)
from jaxopd.train.mesh import RoleMeshes, RolePlan, RoleSpec, build_meshes
from jaxopd.train.step import (LOSS_KINDS, LossConfig, OptimizerConfig, TeacherScorer, TrainState,
                               abstract_train_state, batch_loss, batch_shardings, init_train_state,
                               make_optimizer, make_teacher_scorer, make_train_step, place_batch,
                               score_batch, sequence_log_probs, train_state_shardings)
from jaxopd.train.sync import RolloutWeights, WeightSync, sync_weights

__all__ = [
    "BufferStats", "Sample", "SampleBuffer", "TrainBatch", "collate_samples",
    "RestoredRun", "TrainCheckpointer",
    "DistributedConfig", "global_batch", "host_params", "initialize", "is_primary", "process_local_rows",
    "RoleMeshes", "RolePlan", "RoleSpec", "build_meshes",
    "LOSS_KINDS", "LossConfig", "OptimizerConfig", "TeacherScorer", "TrainState", "abstract_train_state",
    "batch_loss", "batch_shardings", "init_train_state", "make_optimizer", "make_teacher_scorer",
    "make_train_step", "place_batch", "score_batch", "sequence_log_probs", "train_state_shardings",
    "RolloutWeights", "WeightSync", "sync_weights",
]
