"""The train step and teacher scorer: per-token log-probs against a per-row reference, each loss against
hand-written formulas, the sharded step (8 simulated devices) against one device, scoring on the teacher
mesh, and the optimizer against a hand-computed AdamW update."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, Mesh, PartitionSpec as P

from jaxopd.models.decoder import ModelConfig, abstract_model
from jaxopd.models.sharding import named_shardings
from jaxopd.train.buffer import Sample, collate_samples
from jaxopd.train.mesh import RolePlan, build_meshes
from jaxopd.train.logprobs import sequence_log_probs
from jaxopd.train.scoring import make_teacher_scorer, score_batch
from jaxopd.train.state import (OptimizerConfig, batch_shardings, init_train_state, make_optimizer, place_batch,
                                train_state_shardings)
from jaxopd.train.step import LossConfig, batch_loss, make_train_step

TINY = ModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64,
                   vocab_size=64, dtype="float32", param_dtype="float32")
ROW_LENGTHS = (7, 10, 12, 7, 10, 12, 10, 7)
PROMPT_LENGTHS = (2, 3, 4, 3, 2, 4, 3, 2)


def random_params(cfg, seed, *, final_norm_scale=1.0):
    """Random parameters drawn on the host (fast: no per-shape device RNG compiles): N(0, 0.02) weights,
    norm scales 1 + N(0, 0.1)."""
    graphdef, abstract = nnx.split(abstract_model(cfg), nnx.Param)
    rng = np.random.default_rng(seed)
    flat = []
    for path, var in nnx.to_flat_state(abstract):
        shape = var.get_value().shape
        if path[-1] == "scale":
            value = 1.0 + 0.1 * rng.standard_normal(shape)
            value *= final_norm_scale if path[0] == "final_norm" else 1.0
        else:
            value = 0.02 * rng.standard_normal(shape)
        flat.append((path, var.replace(jnp.asarray(value, jnp.float32))))
    return graphdef, nnx.from_flat_state(flat)


def make_mesh(data, model, devices=None):
    devices = np.asarray((devices or jax.devices())[:data * model], dtype=object).reshape(data, model)
    return Mesh(devices, ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))


@pytest.fixture(scope="module")
def setup():
    graphdef, student_params = random_params(TINY, 0)
    _, teacher_params = random_params(TINY, 1, final_norm_scale=4.0)
    rng = np.random.default_rng(0)
    rows = [rng.integers(0, TINY.vocab_size, n) for n in ROW_LENGTHS]

    # Reference log-probs: each row alone, unpadded, read off its own logits in numpy.
    forward = jax.jit(lambda params, tokens: nnx.merge(graphdef, params)(tokens))

    def reference_logp(params):
        out = []
        for tokens in rows:
            logits = np.asarray(forward(params, jnp.asarray(tokens)[None]))[0].astype(np.float64)
            log_softmax = logits - logits.max(-1, keepdims=True)
            log_softmax -= np.log(np.exp(log_softmax).sum(-1, keepdims=True))
            out.append(np.concatenate([[0.0], log_softmax[np.arange(len(tokens) - 1), tokens[1:]]]))
        return out

    student_logp, teacher_logp = reference_logp(student_params), reference_logp(teacher_params)
    samples = []
    for i, tokens in enumerate(rows):
        mask = np.arange(len(tokens)) >= PROMPT_LENGTHS[i]
        if i == 6:
            mask[-2] = False            # an inserted token inside the response: not supervised
        behavior = np.where(mask, student_logp[i] + rng.normal(0, 0.3, len(tokens)), 0.0)
        teacher_generated = mask & (i % 3 == 0)          # STI: rows 0, 3, 6 were teacher turns
        samples.append(Sample(tokens, mask, behavior, 0, teacher_logp=teacher_logp[i],
                              teacher_generated=teacher_generated, advantage=rng.normal(),
                              retained=i != 5))
    batch = collate_samples(samples, length_multiple=4)
    return dict(graphdef=graphdef, student=student_params, teacher=teacher_params, batch=batch,
                student_logp=student_logp, teacher_logp=teacher_logp, samples=samples)


def padded(per_row, length):
    return np.stack([np.pad(r, (0, length - len(r))) for r in per_row])


@pytest.mark.parametrize("chunk", [None, 5])
def test_sequence_log_probs_match_unpadded_per_row_reference(setup, chunk):
    batch, graphdef = setup["batch"], setup["graphdef"]
    logp = jax.jit(lambda params, b: sequence_log_probs(nnx.merge(graphdef, params), b.tokens, b.positions,
                                                        b.attention_mask, 1.0, chunk))(setup["student"], batch)
    np.testing.assert_allclose(np.asarray(logp), padded(setup["student_logp"], batch.shape[1]), atol=2e-6)
    assert not np.asarray(logp)[~batch.attention_mask].any() and not np.asarray(logp)[:, 0].any()


def ppo_token_loss(logp, behavior, advantage, clip=0.2, dual=3.0):
    ratio = np.exp(np.clip(logp - behavior, -20, 20))
    loss = np.maximum(-advantage * ratio, -advantage * np.clip(ratio, 1 - clip, 1 + clip))
    return np.where(advantage < 0, np.minimum(loss, -dual * advantage), loss)


def hand_loss(kind, setup):
    """The four objectives written out per row in numpy from the reference log-probs."""
    token_losses, masks = [], []
    for i, sample in enumerate(setup["samples"]):
        lp, t, b, m = setup["student_logp"][i], setup["teacher_logp"][i], sample.behavior_logp, sample.loss_mask
        if kind == "opd":
            token_losses.append(ppo_token_loss(lp, b, -(lp - t)))
        elif kind == "sti-opd":
            token_losses.append(ppo_token_loss(lp, np.where(sample.teacher_generated, t, b), -(lp - t)))
        elif kind == "sti-iw-reverse-kl":
            token_losses.append(np.where(sample.teacher_generated, np.exp(lp - t) * (lp - t), lp - t))
        else:
            token_losses.append(ppo_token_loss(lp, b, np.full(len(lp), sample.advantage)))
            m = m & sample.retained
        masks.append(m)
    if kind == "opd":   # seq-mean-token-mean
        return np.mean([np.sum(l * m) / (m.sum() + 1e-8) for l, m in zip(token_losses, masks)])
    return sum(np.sum(l * m) for l, m in zip(token_losses, masks)) / sum(m.sum() for m in masks)


@pytest.mark.parametrize("kind", ["opd", "sti-opd", "sti-iw-reverse-kl", "action-opd"])
def test_batch_loss_of_each_method_matches_hand_formula(setup, kind):
    loss, metrics = jax.jit(lambda params, b: batch_loss(params, setup["graphdef"], b, LossConfig(kind=kind)))(
        setup["student"], setup["batch"])
    expected = hand_loss(kind, setup)
    np.testing.assert_allclose(float(loss), expected, rtol=1e-5, atol=1e-6)
    supervised = sum(s.loss_mask.sum() for i, s in enumerate(setup["samples"])
                     if kind != "action-opd" or s.retained)
    assert float(metrics["supervised_tokens"]) == supervised
    assert abs(expected) > 1e-3    # a non-trivial case


@pytest.mark.parametrize("config", [LossConfig(kind="opd", logits_chunk_size=5),
                                    LossConfig(kind="sti-opd", max_supervised_tokens=12),
                                    LossConfig(kind="sft", temperature=1.0, context_lm_weight=0.5,
                                               context_vocab=tuple(range(0, 64, 2)))],
                         ids=["opd-chunked", "sti-supervised", "sft-context"])
def test_rematerialised_layers_give_the_plain_loss_and_gradient(setup, config):
    """``remat_layers`` (the layers as a scan of checkpointed bodies) changes memory, not numbers: the loss, its
    metrics and the gradient of every parameter equal the unrolled forward's."""
    graphdef, params, batch = setup["graphdef"], setup["student"], setup["batch"]
    out = {}
    for remat in (False, True):
        loss_config = dataclasses.replace(config, remat_layers=remat)
        grad = jax.jit(jax.value_and_grad(lambda p, b, c=loss_config: batch_loss(p, graphdef, b, c), has_aux=True))
        (loss, metrics), grads = grad(params, batch)
        out[remat] = float(loss), {k: float(v) for k, v in metrics.items()}, jax.tree.map(np.asarray, grads)
    (plain_loss, plain_metrics, plain_grads), (remat_loss, remat_metrics, remat_grads) = out[False], out[True]
    assert abs(plain_loss) > 1e-3
    np.testing.assert_allclose(remat_loss, plain_loss, rtol=1e-6, atol=1e-7)
    assert remat_metrics.keys() == plain_metrics.keys()
    for name in plain_metrics:
        np.testing.assert_allclose(remat_metrics[name], plain_metrics[name], rtol=1e-5, atol=1e-6, err_msg=name)
    layer_grad = plain_grads["layers"][1]["attn"]["q_weight_dnh"].get_value()
    assert np.abs(layer_grad).max() > 1e-6                                      # the layers get a gradient
    for (path, a), (_, b) in zip(jax.tree_util.tree_leaves_with_path(plain_grads),
                                 jax.tree_util.tree_leaves_with_path(remat_grads)):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-7, err_msg=jax.tree_util.keystr(path))


def test_rematerialised_layers_cut_the_gradients_temporaries():
    """Compiled (not run) on XLA CPU: with the layers rematerialised the step's temporaries no longer hold every
    layer's [B, H, T, T] attention (here 8 layers of 4 x 4 x 256 x 256 float32: 4 MiB each, several copies), only
    one layer's backward working set (about 6 of those on XLA CPU: 25 MB against 161 MB)."""
    cfg = dataclasses.replace(TINY, num_layers=8)
    graphdef, params = random_params(cfg, 0)
    rows, length = 4, 256
    tokens = np.tile(np.arange(length) % cfg.vocab_size, (rows, 1))
    samples = [Sample(t, np.arange(length) >= 8, np.zeros(length), 0, teacher_logp=np.zeros(length)) for t in tokens]
    batch = collate_samples(samples, length_multiple=length)
    temporaries = {}
    for remat in (False, True):
        config = LossConfig(kind="opd", max_supervised_tokens=length, remat_layers=remat)
        grad = jax.jit(jax.grad(lambda p, b, c=config: batch_loss(p, graphdef, b, c)[0]))
        temporaries[remat] = grad.lower(params, batch).compile().memory_analysis().temp_size_in_bytes
    attention = rows * cfg.num_heads * length * length * 4
    assert temporaries[False] > cfg.num_layers * attention, temporaries       # every layer's attention is kept
    assert temporaries[True] < 8 * attention and temporaries[True] < temporaries[False] / 4, temporaries


def test_rematerialised_layers_refuse_caches_and_unlike_layers():
    from jaxopd.models.decoder import CausalLM, dense_causal_attend
    model = CausalLM(TINY, rngs=nnx.Rngs(0))
    tokens = jnp.zeros((1, 4), jnp.int32)
    positions = jnp.arange(4)[None]
    attend = dense_causal_attend(positions, jnp.ones((1, 4), bool))
    with pytest.raises(ValueError, match="threads no caches"):
        model.hidden_states(tokens, positions, attend, [None, None], remat=True)
    model.layers[1].mlp.up_weight_df = nnx.Param(jnp.zeros((TINY.hidden_size, 2 * TINY.intermediate_size)))
    with pytest.raises(ValueError, match="layer 1's differ from layer 0's"):
        model.hidden_states(tokens, positions, attend, remat=True)


def test_sharded_step_equals_single_device_step(setup):
    """The same train step on one device and on a 4 (data) x 2 (model) mesh of the 8 simulated devices.

    The optimizer is global-norm clipping (active: the gradient norm is above 0.05) then SGD, so that the
    parameter change is the clipped gradient itself: Adam would normalise each coordinate by |g| + eps and
    hide a scale error of the gradient. AdamW itself is checked by hand in test_optimizer_is_adamw_....
    """
    graphdef, params, batch = setup["graphdef"], setup["student"], setup["batch"]
    optimizer = optax.chain(optax.clip_by_global_norm(0.05), optax.sgd(1.0))
    results = {}
    # the sharded run also computes the vocabulary projection in rematerialised chunks of 5 positions
    for name, mesh, config in [("single", make_mesh(1, 1), LossConfig(kind="opd")),
                               ("sharded", make_mesh(4, 2), LossConfig(kind="opd", logits_chunk_size=5))]:
        state_shardings = train_state_shardings(params, optimizer, mesh)
        row_sharding = batch_shardings(mesh)
        device_batch = place_batch(batch, row_sharding)
        step = make_train_step(graphdef, optimizer, config, state_shardings, row_sharding)
        state = init_train_state(params, optimizer, state_shardings)
        step_metrics, deltas = [], []
        for _ in range(2):
            before = jax.tree.map(np.asarray, state.params)
            state, step_metric = step(state, device_batch)
            step_metrics.append({k: float(v) for k, v in step_metric.items()})
            deltas.append(jax.tree.map(lambda a, b: np.asarray(b) - a, before, state.params))
        results[name] = dict(metrics=step_metrics, deltas=deltas, params=jax.tree.map(np.asarray, state.params),
                             state=state)
    single, sharded = results["single"], results["sharded"]
    for a, b in zip(single["metrics"], sharded["metrics"]):
        assert abs(a["loss"] - b["loss"]) < 1e-5 and abs(a["grad_norm"] - b["grad_norm"]) < 1e-5
        assert a["grad_norm"] > 0.05                                   # clipping is active
    assert abs(single["metrics"][1]["loss"] - single["metrics"][0]["loss"]) > 1e-4   # the update changed the policy
    for a, b in zip(single["deltas"], sharded["deltas"]):             # the clipped gradients, step by step
        assert max(jax.tree.leaves(jax.tree.map(lambda x, y: np.abs(x - y).max(), a, b))) < 1e-6
        norm = np.sqrt(sum(np.sum(x.astype(np.float64) ** 2) for x in jax.tree.leaves(a)))
        np.testing.assert_allclose(norm, 0.05, rtol=1e-4)
    param_diff = max(jax.tree.leaves(jax.tree.map(lambda a, b: np.abs(a - b).max(), single["params"],
                                                  sharded["params"])))
    assert param_diff < 1e-5, param_diff
    sharded_state = sharded["state"]
    assert int(sharded_state.step) == 2
    embedding = sharded_state.params["embedding_vd"].get_value()
    assert embedding.sharding.spec == P("model", "data") and len(embedding.sharding.device_set) == 8
    # AdamW's moments are laid out like the parameters they follow
    adamw = make_optimizer(OptimizerConfig())
    mu = train_state_shardings(params, adamw, make_mesh(4, 2)).opt_state[1][0].mu["embedding_vd"].get_value()
    assert mu.spec == P("model", "data")


def test_teacher_scores_on_teacher_devices_and_arrives_on_trainer_devices(setup):
    meshes = build_meshes(RolePlan.disjoint(4, 2, 2, trainer_tensor_parallel=2))
    graphdef, batch = setup["graphdef"], setup["batch"]
    teacher_shardings = named_shardings(setup["teacher"], meshes.teacher)
    teacher_params = jax.device_put(setup["teacher"], teacher_shardings)
    scorer = make_teacher_scorer(graphdef, teacher_shardings, meshes.teacher, logits_chunk_size=4)
    on_teacher = scorer(teacher_params, batch.tokens, batch.positions, batch.attention_mask).logp
    assert on_teacher.sharding.device_set == meshes.devices_of("teacher")
    trainer_rows = batch_shardings(meshes.trainer)
    scored = score_batch(scorer, teacher_params, batch.replace(teacher_logp=np.zeros_like(batch.teacher_logp)),
                         trainer_rows)
    for field in dataclasses.fields(scored):
        assert getattr(scored, field.name).sharding.device_set == meshes.devices_of("trainer"), field.name
    np.testing.assert_allclose(np.asarray(scored.teacher_logp), padded(setup["teacher_logp"], batch.shape[1]),
                               atol=2e-6)
    with pytest.raises(ValueError, match="cannot be split over the 2 data-parallel devices"):
        scorer(teacher_params, batch.tokens[:3], batch.positions[:3], batch.attention_mask[:3])


def test_optimizer_is_adamw_after_global_norm_clipping():
    config = OptimizerConfig(learning_rate=0.1, weight_decay=0.01, max_grad_norm=1.0)
    optimizer = make_optimizer(config)
    params = {"w": jnp.array([1.0, -2.0])}
    state = optimizer.init(params)
    grads = [np.array([3.0, 4.0]), np.array([0.3, -0.4])]      # norms 5 (clipped to 1) and 0.5 (kept)
    p, m, v = np.array([1.0, -2.0]), np.zeros(2), np.zeros(2)
    for t, g in enumerate(grads, start=1):
        updates, state = optimizer.update({"w": jnp.asarray(g)}, state, params)
        params = optax.apply_updates(params, updates)
        g = g * min(1.0, 1.0 / np.linalg.norm(g))
        m = 0.9 * m + 0.1 * g
        v = 0.999 * v + 0.001 * g * g
        m_hat, v_hat = m / (1 - 0.9 ** t), v / (1 - 0.999 ** t)
        p = p - 0.1 * (m_hat / (np.sqrt(v_hat) + 1e-8) + 0.01 * p)
        np.testing.assert_allclose(np.asarray(params["w"]), p, rtol=1e-5)
    defaults = OptimizerConfig()
    assert (defaults.learning_rate, defaults.b1, defaults.b2, defaults.weight_decay, defaults.max_grad_norm) == \
        (1e-6, 0.9, 0.999, 0.01, 1.0)


def test_configs_and_batches_are_validated(setup):
    with pytest.raises(ValueError, match="kind must be one of"):
        LossConfig(kind="ppo")
    with pytest.raises(ValueError, match="active-token mean"):
        LossConfig(kind="action-opd", aggregation="seq-mean-token-mean")
    with pytest.raises(ValueError, match="learning_rate"):
        OptimizerConfig(learning_rate=0.0)
    with pytest.raises(ValueError, match="max_grad_norm"):
        OptimizerConfig(max_grad_norm=-1.0)
    assert LossConfig().resolved_aggregation == "seq-mean-token-mean"
    assert LossConfig(kind="sti-opd").resolved_aggregation == "token-mean"
    batch = setup["batch"]
    rows6 = jax.tree.map(lambda x: x[:6], batch)
    with pytest.raises(ValueError, match="6 rows cannot be split over the 4"):
        place_batch(rows6, batch_shardings(make_mesh(4, 2)))


def test_cosine_schedule_warms_up_then_decays_to_its_floor():
    config = OptimizerConfig(learning_rate=1e-3, schedule="cosine", decay_steps=100, warmup_steps=10,
                             final_fraction=0.1)
    rate = config.learning_rate_schedule()
    np.testing.assert_allclose([float(rate(s)) for s in (0, 5, 10, 55, 100, 200)],
                               [0.0, 5e-4, 1e-3, 1e-4 + 0.9e-3 * 0.5 * (1 + np.cos(np.pi * 0.5)), 1e-4, 1e-4],
                               rtol=1e-5)
    assert OptimizerConfig(learning_rate=1e-3).learning_rate_schedule() == 1e-3
    # the optimizer takes the scheduled rate: with warm-up the first update is zero, the second is not
    optimizer = make_optimizer(config)
    params = {"w": jnp.array([1.0])}
    state = optimizer.init(params)
    first, state = optimizer.update({"w": jnp.array([1.0])}, state, params)
    second, _ = optimizer.update({"w": jnp.array([1.0])}, state, params)
    assert float(first["w"][0]) == 0.0 and float(second["w"][0]) < 0.0
    with pytest.raises(ValueError, match="decay_steps"):
        OptimizerConfig(schedule="cosine")
    with pytest.raises(ValueError, match="warmup_steps"):
        OptimizerConfig(schedule="cosine", decay_steps=10, warmup_steps=10)
    with pytest.raises(ValueError, match="schedule must be one of"):
        OptimizerConfig(schedule="linear")
