"""The trainer side of distillation, one module each: role meshes, the optimiser and train state, per-token
log-probs, the losses and the sharded step, teacher scoring, the sample buffer, trainer → rollout weight sync,
checkpoints, the ``Learner`` that holds them together for a run, and multi-process runs."""
from jaxopd.train.buffer import BufferStats, Sample, SampleBuffer, TrainBatch, collate_samples
from jaxopd.train.checkpoint import RestoredRun, TrainCheckpointer
from jaxopd.train.distributed import (DistributedConfig, global_batch, host_params, initialize, is_primary,
                                      process_local_rows)
from jaxopd.train.learner import Learner, batch_length
from jaxopd.train.logprobs import sequence_log_probs
from jaxopd.train.mesh import RoleMeshes, RolePlan, RoleSpec, build_meshes
from jaxopd.train.scoring import TeacherScorer, TeacherScores, make_teacher_scorer, score_batch
from jaxopd.train.state import (OptimizerConfig, TrainState, abstract_train_state, batch_shardings, init_train_state,
                                make_optimizer, place_batch, train_state_shardings)
from jaxopd.train.step import LOSS_KINDS, LossConfig, batch_loss, make_train_step
from jaxopd.train.sync import RolloutWeights, WeightSync, sync_weights

__all__ = [
    "BufferStats", "Sample", "SampleBuffer", "TrainBatch", "collate_samples",
    "RestoredRun", "TrainCheckpointer",
    "DistributedConfig", "global_batch", "host_params", "initialize", "is_primary", "process_local_rows",
    "Learner", "batch_length",
    "RoleMeshes", "RolePlan", "RoleSpec", "build_meshes",
    "LOSS_KINDS", "LossConfig", "OptimizerConfig", "TeacherScorer", "TeacherScores", "TrainState",
    "abstract_train_state", "batch_loss", "batch_shardings", "init_train_state", "make_optimizer",
    "make_teacher_scorer", "make_train_step", "place_batch", "score_batch", "sequence_log_probs",
    "train_state_shardings",
    "RolloutWeights", "WeightSync", "sync_weights",
]
