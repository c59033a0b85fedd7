"""Learning test: a tiny student trained by on-policy distillation (ActFirst-OPD / vanilla OPD loss)
against a fixed tiny teacher drives the exact reverse KL on its own samples down.

The whole trainer pipeline runs on the 8 simulated devices split 4 rollout / 2 teacher / 2 trainer:
on-policy samples on the rollout mesh, teacher log-probs on the teacher mesh, the sharded update on the
trainer mesh, weight sync back to the rollout mesh after every update, through the FIFO buffer.
"""
import pytest
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxopd.models.decoder import ModelConfig, abstract_model
from jaxopd.models.sharding import named_shardings
from jaxopd.train import (LossConfig, OptimizerConfig, RolePlan, Sample, SampleBuffer, WeightSync, batch_shardings,
                          build_meshes, collate_samples, init_train_state, make_optimizer, make_teacher_scorer,
                          make_train_step, score_batch, train_state_shardings)
from jaxopd.train.dense_sampling import sample_dense

pytestmark = pytest.mark.slow  # heavier than the README's test run allows (run in CI: pytest -m slow)

TINY = ModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64,
                   vocab_size=64, dtype="float32", param_dtype="float32")
PROMPT_LENGTH, RESPONSE_LENGTH, NUM_CONTEXTS = 4, 8, 16
UPDATES, LEARNING_RATE, EVAL_EVERY = 48, 4e-3, 4


def random_params(cfg, seed, *, final_norm_scale=1.0):
    """Host-drawn random parameters: N(0, 0.02) weights, norm scales 1 + N(0, 0.1) (final norm scaled)."""
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


def exact_reverse_kl(graphdef, student_params, teacher_params, tokens):
    """Mean over response positions of KL(π_student(·|c) || π_teacher(·|c)) summed over the whole
    vocabulary, computed in float64 numpy from both models' logits."""
    def log_softmax(params):
        logits = np.asarray(nnx.merge(graphdef, params)(jnp.asarray(tokens)), np.float64)
        logits = logits[:, PROMPT_LENGTH - 1:-1]            # the contexts that predict the response tokens
        logits -= logits.max(-1, keepdims=True)
        return logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    student, teacher = log_softmax(student_params), log_softmax(teacher_params)
    return float(np.mean(np.sum(np.exp(student) * (student - teacher), axis=-1)))


def test_opd_drives_the_exact_reverse_kl_down():
    graphdef, student = random_params(TINY, 0)
    _, teacher = random_params(TINY, 1, final_norm_scale=4.0)     # a peaked, context-dependent teacher
    meshes = build_meshes(RolePlan.disjoint(4, 2, 2))
    optimizer = make_optimizer(OptimizerConfig(learning_rate=LEARNING_RATE))
    state_shardings = train_state_shardings(student, optimizer, meshes.trainer)
    state = init_train_state(student, optimizer, state_shardings)
    trainer_rows = batch_shardings(meshes.trainer)
    train_step = make_train_step(graphdef, optimizer, LossConfig(kind="opd"), state_shardings, trainer_rows)
    teacher_shardings = named_shardings(teacher, meshes.teacher)
    teacher_on_mesh = jax.device_put(teacher, teacher_shardings)
    scorer = make_teacher_scorer(graphdef, teacher_shardings, meshes.teacher)
    sync = WeightSync.for_mesh(student, meshes.rollout)
    rollout = sync(state.params, version=0)
    buffer = SampleBuffer(max_version_lag=1)
    contexts = np.asarray(jax.random.randint(jax.random.key(7), (NUM_CONTEXTS, PROMPT_LENGTH), 0, TINY.vocab_size))
    host = jax.devices()[0]
    teacher_on_host = jax.device_put(teacher, host)
    supervised = np.arange(PROMPT_LENGTH + RESPONSE_LENGTH) >= PROMPT_LENGTH

    curve, sampled_kl = [], []
    for update in range(UPDATES + 1):
        if update % EVAL_EVERY == 0:    # fixed evaluation key: the student's own responses to the fixed contexts
            eval_tokens, _ = sample_dense(graphdef, rollout.params, contexts, jax.random.key(10_000),
                                          num_new_tokens=RESPONSE_LENGTH)
            curve.append(exact_reverse_kl(graphdef, jax.device_put(rollout.params, host), teacher_on_host,
                                          np.asarray(eval_tokens)))
        if update == UPDATES:
            break
        tokens, logp = sample_dense(graphdef, rollout.params, contexts, jax.random.key(update),
                                    num_new_tokens=RESPONSE_LENGTH)
        tokens, logp = np.asarray(tokens), np.asarray(logp)
        buffer.add(Sample(tokens[i], supervised, logp[i], rollout.version) for i in range(NUM_CONTEXTS))
        samples = buffer.take(NUM_CONTEXTS, current_version=int(state.step))
        assert len(samples) == NUM_CONTEXTS
        batch = score_batch(scorer, teacher_on_mesh, collate_samples(samples), trainer_rows)
        state, metrics = train_step(state, batch)
        sampled_kl.append(float(metrics["sampled_reverse_kl"]))
        rollout = sync(state.params, version=int(state.step))

    steps = np.arange(len(curve)) * EVAL_EVERY
    slope = np.polyfit(steps, curve, 1)[0]
    print("\nexact reverse KL (nats/token) at updates", steps.tolist())
    print([round(v, 4) for v in curve])
    print("sampled reverse KL of each update's batch:", [round(v, 3) for v in sampled_kl])
    assert curve[-1] < 0.5 * curve[0], curve
    assert slope < 0, slope
    assert np.mean(curve[-3:]) < np.mean(curve[:3])
    # the sampled estimate the loss uses tracks the exact value: it falls too
    assert np.mean(sampled_kl[-8:]) < 0.6 * np.mean(sampled_kl[:8])
