"""The ``Learner``: its update equals the hand-assembled pieces' (teacher scoring, the compiled step), a learner
restored from its checkpoint takes the same next step, the weights it pushes carry its version, and a loss that
reads the teacher is refused without one."""
import jax
import numpy as np
import pytest
from flax import nnx

from jaxopd.models.decoder import CausalLM, ModelConfig
from jaxopd.models.sharding import copy_to, named_shardings
from jaxopd.train import (Learner, LossConfig, OptimizerConfig, RolePlan, Sample, SampleBuffer, batch_length,
                          batch_shardings, build_meshes, collate_samples, init_train_state, make_optimizer,
                          make_teacher_scorer, make_train_step, score_batch, train_state_shardings)

TINY = ModelConfig(hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64,
                   vocab_size=64, dtype="float32", param_dtype="float32")
OPTIMIZER = OptimizerConfig(learning_rate=3e-3)
BATCH, MAX_TOKENS = 4, 64


def samples(seed, count=BATCH):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        length = int(rng.integers(6, 12))
        tokens = rng.integers(0, TINY.vocab_size, length).astype(np.int32)
        mask = np.zeros(length, bool)
        mask[3:] = True
        out.append(Sample(tokens, mask, np.where(mask, -3.0, 0.0).astype(np.float32), 0))
    return out


def learner(folder, meshes):
    return Learner(CausalLM(TINY, rngs=nnx.Rngs(0)), LossConfig(kind="opd"), OPTIMIZER, folder, batch_size=BATCH,
                   max_train_tokens=MAX_TOKENS, teacher=CausalLM(TINY, rngs=nnx.Rngs(1)), meshes=meshes,
                   log=lambda message: None)


@pytest.fixture(scope="module")
def meshes():
    return build_meshes(RolePlan.disjoint(4, 2, 2))


@pytest.mark.slow  # two compiled steps, a scorer and a restore (run in CI: pytest -m slow)
def test_learner_step_equals_the_pieces_and_resumes(meshes, tmp_path):
    first = learner(tmp_path / "checkpoints", meshes)
    assert first.restore_or_init() is None and first.version == 0
    host = first.collate(samples(0))
    assert host.tokens.shape == (BATCH, batch_length(11, MAX_TOKENS))

    # the same update by hand: the teacher's scores, then the compiled step on a fresh state
    graphdef, params = nnx.split(CausalLM(TINY, rngs=nnx.Rngs(0)), nnx.Param)
    teacher_graphdef, teacher = nnx.split(CausalLM(TINY, rngs=nnx.Rngs(1)), nnx.Param)
    optimizer = make_optimizer(OPTIMIZER)
    shardings = train_state_shardings(params, optimizer, meshes.trainer)
    rows = batch_shardings(meshes.trainer)
    teacher_shardings = named_shardings(teacher, meshes.teacher)
    scorer = make_teacher_scorer(teacher_graphdef, teacher_shardings, meshes.teacher)
    step = make_train_step(graphdef, optimizer, LossConfig(kind="opd"), shardings, rows)
    batch = score_batch(scorer, copy_to(teacher, teacher_shardings),
                        collate_samples(samples(0), batch_size=BATCH, length=host.tokens.shape[1]), rows)
    _, expected = step(init_train_state(params, optimizer, shardings), batch)

    metrics = first.step(first.place(host))
    assert first.version == 1
    assert metrics["loss"] == pytest.approx(float(expected["loss"]), abs=1e-6)
    assert metrics["grad_norm"] == pytest.approx(float(expected["grad_norm"]), rel=1e-5)

    buffer = SampleBuffer()
    buffer.add(samples(1))
    first.save(buffer, {"cursor": 7})
    following = first.step(first.place(first.collate(buffer.take(BATCH, 1))))
    first.close()

    again = learner(tmp_path / "checkpoints", meshes)
    restored = again.restore_or_init()
    assert restored.step == 1 and restored.metadata == {"cursor": 7} and again.version == 1
    resumed = again.step(again.place(again.collate(restored.buffer.take(BATCH, 1))))
    assert resumed["loss"] == following["loss"] and again.version == 2
    again.close()


class Engine:
    def __init__(self):
        self.updates = []

    def update_weights(self, params, version=None):
        self.updates.append((params, version))


def test_pushed_weights_carry_the_version(meshes, tmp_path):
    sft = Learner(CausalLM(TINY, rngs=nnx.Rngs(0)), LossConfig(kind="sft", temperature=1.0), OPTIMIZER,
                  tmp_path / "checkpoints", batch_size=BATCH, max_train_tokens=MAX_TOKENS, meshes=meshes)
    sft.restore_or_init()
    assert sft.scorer is None           # SFT reads no teacher
    engine = Engine()
    sft.step(sft.place(sft.collate(samples(2))))
    sft.push(engine)
    (params, version), = engine.updates
    assert version == 1
    served = jax.tree.leaves(jax.device_get(params))
    trained = jax.tree.leaves(jax.device_get(sft.state.params))
    assert all(np.array_equal(a, b) for a, b in zip(served, trained))
    trained_model = jax.tree.leaves(jax.device_get(nnx.state(sft.model(), nnx.Param)))
    assert all(np.array_equal(a, b) for a, b in zip(trained_model, trained))
    sft.close()


def test_a_loss_that_reads_the_teacher_needs_one(meshes, tmp_path):
    with pytest.raises(ValueError, match="teacher"):
        Learner(CausalLM(TINY, rngs=nnx.Rngs(0)), LossConfig(kind="opd"), OPTIMIZER, tmp_path, batch_size=BATCH,
                max_train_tokens=MAX_TOKENS, meshes=meshes)
