"""Checkpoint → kill → resume: a run restored from an orbax checkpoint (params, optimizer state, step and
sample buffer) computes exactly the losses of the uninterrupted run."""
import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, Mesh

from jaxopd.models.decoder import ModelConfig, abstract_model
from jaxopd.models.sharding import named_shardings
from jaxopd.train import (LossConfig, OptimizerConfig, RolePlan, Sample, SampleBuffer, TrainCheckpointer,
                          WeightSync, abstract_train_state, batch_shardings, build_meshes, collate_samples,
                          init_train_state, make_optimizer, make_teacher_scorer, make_train_step, score_batch,
                          train_state_shardings)
from jaxopd.train.dense_sampling import sample_dense

TINY = ModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64,
                   vocab_size=64, dtype="float32", param_dtype="float32")
PROMPT_LENGTH, RESPONSE_LENGTH = 3, 5
ROLLOUT_BATCH, TRAIN_BATCH = 12, 8      # more samples than an update consumes: the buffer carries leftovers
TOTAL_UPDATES, CHECKPOINT_AT = 5, 2


def random_params(cfg, seed, *, final_norm_scale=1.0):
    graphdef, abstract = nnx.split(abstract_model(cfg), nnx.Param)
    rng = np.random.default_rng(seed)
    flat = []
    for path, var in nnx.to_flat_state(abstract):
        shape = var.get_value().shape
        if path[-1] == "scale":
            value = (1.0 + 0.1 * rng.standard_normal(shape)) * (final_norm_scale if path[0] == "final_norm" else 1.0)
        else:
            value = 0.02 * rng.standard_normal(shape)
        flat.append((path, var.replace(jnp.asarray(value, jnp.float32))))
    return graphdef, nnx.from_flat_state(flat)


GRAPHDEF, STUDENT = random_params(TINY, 0)
_, TEACHER = random_params(TINY, 1, final_norm_scale=4.0)
CONTEXTS = np.random.default_rng(3).integers(0, TINY.vocab_size, (ROLLOUT_BATCH, PROMPT_LENGTH))


class Run:
    """Everything a training process builds from scratch: meshes, compiled programs, teacher, sync."""

    def __init__(self):
        self.meshes = build_meshes(RolePlan.disjoint(4, 2, 2))
        self.optimizer = make_optimizer(OptimizerConfig(learning_rate=3e-3))
        self.state_shardings = train_state_shardings(STUDENT, self.optimizer, self.meshes.trainer)
        self.rows = batch_shardings(self.meshes.trainer)
        self.train_step = make_train_step(GRAPHDEF, self.optimizer, LossConfig(kind="opd"), self.state_shardings,
                                          self.rows)
        teacher_shardings = named_shardings(TEACHER, self.meshes.teacher)
        self.teacher = jax.device_put(TEACHER, teacher_shardings)
        self.scorer = make_teacher_scorer(GRAPHDEF, teacher_shardings, self.meshes.teacher)
        self.sync = WeightSync.for_mesh(STUDENT, self.meshes.rollout)

    def update(self, state, rollout, buffer):
        """One iteration: sample on-policy (key = update index), buffer, take a batch, score, update, sync."""
        update = int(state.step)
        tokens, logp = sample_dense(GRAPHDEF, rollout.params, CONTEXTS, jax.random.key(update),
                                    num_new_tokens=RESPONSE_LENGTH)
        tokens, logp = np.asarray(tokens), np.asarray(logp)
        mask = np.arange(tokens.shape[1]) >= PROMPT_LENGTH
        buffer.add(Sample(tokens[i], mask, logp[i], rollout.version) for i in range(ROLLOUT_BATCH))
        samples = buffer.take(TRAIN_BATCH, current_version=update)
        batch = score_batch(self.scorer, self.teacher, collate_samples(samples), self.rows)
        state, metrics = self.train_step(state, batch)
        return state, self.sync(state.params, int(state.step)), float(metrics["loss"])


@pytest.mark.slow  # heavier than the README's test run allows (run in CI: pytest -m slow)
def test_resume_reproduces_the_uninterrupted_run(tmp_path):
    run = Run()
    # the uninterrupted run
    state = init_train_state(STUDENT, run.optimizer, run.state_shardings)
    rollout, buffer = run.sync(state.params, 0), SampleBuffer()
    uninterrupted = []
    for _ in range(TOTAL_UPDATES):
        state, rollout, loss = run.update(state, rollout, buffer)
        uninterrupted.append(loss)
    # 12 in, 8 out per update: version-1 leftovers are consumed first; the 4 version-2 samples still buffered
    # at update 4 are two versions old and dropped
    assert buffer.stats.dropped_stale == 4 and len(buffer) == 16
    # the same run up to the checkpoint
    state = init_train_state(STUDENT, run.optimizer, run.state_shardings)
    rollout, buffer = run.sync(state.params, 0), SampleBuffer()
    for _ in range(CHECKPOINT_AT):
        state, rollout, loss = run.update(state, rollout, buffer)
    with TrainCheckpointer(tmp_path / "ckpt") as checkpointer:
        assert checkpointer.save(state, buffer, {"contexts_seed": 3}) == CHECKPOINT_AT
    saved_params = jax.tree.map(np.asarray, state.params)
    saved_opt_state = jax.tree.map(np.asarray, state.opt_state)
    saved_buffer = [(s.sample_id, s.policy_version, s.tokens.tolist()) for s in buffer._queue]
    assert len(saved_buffer) == 2 * (ROLLOUT_BATCH - TRAIN_BATCH)   # leftovers the next update consumes
    # "kill": drop every object of the process, build a new one from scratch and resume
    del run, state, rollout, buffer
    gc.collect()
    run = Run()
    with TrainCheckpointer(tmp_path / "ckpt") as checkpointer:
        restored = checkpointer.restore(abstract_train_state(STUDENT, run.optimizer, run.state_shardings))
    assert restored.step == CHECKPOINT_AT and int(restored.state.step) == CHECKPOINT_AT
    assert restored.metadata == {"contexts_seed": 3}
    jax.tree.map(np.testing.assert_array_equal, saved_params, jax.tree.map(np.asarray, restored.state.params))
    jax.tree.map(np.testing.assert_array_equal, saved_opt_state, jax.tree.map(np.asarray, restored.state.opt_state))
    assert [(s.sample_id, s.policy_version, s.tokens.tolist()) for s in restored.buffer._queue] == saved_buffer
    embedding = restored.state.params["embedding_vd"].get_value()
    assert embedding.sharding == run.state_shardings.params["embedding_vd"].get_value()
    state, buffer = restored.state, restored.buffer
    rollout = run.sync(state.params, int(state.step))
    resumed = []
    for _ in range(TOTAL_UPDATES - CHECKPOINT_AT):
        state, rollout, loss = run.update(state, rollout, buffer)
        resumed.append(loss)
    print("\nuninterrupted losses", uninterrupted, "\nresumed losses      ", resumed)
    np.testing.assert_allclose(resumed, uninterrupted[CHECKPOINT_AT:], rtol=0, atol=1e-6)
    assert len(set(uninterrupted)) == TOTAL_UPDATES      # the losses differ from update to update


def test_restore_onto_another_mesh_and_missing_checkpoints(tmp_path):
    optimizer = make_optimizer(OptimizerConfig())
    eight = Mesh(np.asarray(jax.devices(), dtype=object).reshape(4, 2), ("data", "model"),
                 axis_types=(AxisType.Auto,) * 2)
    one = Mesh(np.asarray(jax.devices()[:1], dtype=object).reshape(1, 1), ("data", "model"),
               axis_types=(AxisType.Auto,) * 2)
    state = init_train_state(STUDENT, optimizer, train_state_shardings(STUDENT, optimizer, eight))
    single = train_state_shardings(STUDENT, optimizer, one)
    with TrainCheckpointer(tmp_path, max_to_keep=2) as checkpointer:
        with pytest.raises(FileNotFoundError, match="no checkpoint"):
            checkpointer.restore(abstract_train_state(STUDENT, optimizer, single))
        for step in (1, 2, 3):
            checkpointer.save(state, step=step)
        assert checkpointer.all_steps() == [2, 3]
        restored = checkpointer.restore(abstract_train_state(STUDENT, optimizer, single), step=2)
        with pytest.raises(FileNotFoundError, match="no checkpoint of step 1"):
            checkpointer.restore(abstract_train_state(STUDENT, optimizer, single), step=1)
    assert restored.buffer is None and restored.step == 2
    leaf = restored.state.params["layers"][0]["mlp"]["gate_weight_df"].get_value()
    assert leaf.sharding.device_set == {jax.devices()[0]}
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, state.params),
                 jax.tree.map(np.asarray, restored.state.params))
