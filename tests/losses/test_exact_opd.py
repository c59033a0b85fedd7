"""OPD with each sampled state's reverse KL computed over the whole vocabulary (``losses.exact_opd_loss``, the
``opd-exact`` loss kind): the loss and its gradient against hand-written numpy over a small vocabulary, the dense
teacher scorer against a per-row reference, the train step's loss against ``divergence.exact_reverse_kl`` of the
same samples, and the configuration errors."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxopd import losses
from jaxopd.models.decoder import dense_causal_attend
from jaxopd.methods.config import build_config
from jaxopd.methods.divergence import exact_reverse_kl
from jaxopd.train.buffer import collate_samples
from jaxopd.train.logprobs import supervised_dense_log_probs
from jaxopd.train.scoring import make_teacher_scorer, score_batch
from jaxopd.train.state import batch_shardings, init_train_state, place_batch, train_state_shardings
from jaxopd.train.step import LossConfig, batch_loss, make_train_step
from tests.train.test_train_step import TINY, make_mesh, padded
from tests.train.test_train_step import setup  # noqa: F401  (the module fixture: 8 rows of random tokens, two random models)

pytestmark = pytest.mark.slow  # heavier than the README's test run allows (run in CI: pytest -m slow)


def log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


@pytest.fixture(scope="module")
def arrays():
    rng = np.random.default_rng(3)
    student_logits = rng.normal(0, 2, (3, 4, 5))
    teacher_logits = rng.normal(0, 2, (3, 4, 5))
    mask = np.array([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], bool)      # row 2: padding
    targets = rng.integers(0, 5, (3, 4))
    return student_logits, teacher_logits, mask, targets


@pytest.mark.parametrize("aggregation", losses.AGGREGATION_MODES)
def test_exact_opd_loss_is_the_enumerated_reverse_kl(arrays, aggregation):
    student_logits, teacher_logits, mask, targets = arrays
    s, t = log_softmax(student_logits), log_softmax(teacher_logits)
    kl = (np.exp(s) * (s - t)).sum(-1)                                     # [3, 4], by enumeration of the 5 ids
    rows = [kl[r][mask[r]] for r in range(2)]
    expected = {"token-mean": np.concatenate(rows).mean(), "seq-mean-token-mean": np.mean([r.mean() for r in rows]),
                "seq-mean-token-sum": np.mean([r.sum() for r in rows])}[aggregation]
    loss, metrics = losses.exact_opd_loss(jnp.asarray(s, jnp.float32), jnp.asarray(t, jnp.float32), mask,
                                          targets=targets, aggregation=aggregation)
    np.testing.assert_allclose(float(loss), expected, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["exact_reverse_kl"]), kl[mask].mean(), rtol=1e-5)
    sampled = np.take_along_axis(s - t, targets[..., None], -1)[..., 0]
    np.testing.assert_allclose(float(metrics["sampled_reverse_kl"]), sampled[mask].mean(), rtol=1e-5)
    assert float(metrics["supervised_tokens"]) == 4 and expected > 0.1


def test_exact_opd_gradient_is_the_reverse_kl_gradient(arrays):
    """d KL(softmax(z) || q) / dz_i = p_i (log p_i - log q_i - KL), per state, weighted by the token-mean."""
    student_logits, teacher_logits, mask, _ = arrays
    t = log_softmax(teacher_logits)

    def loss_of(z):
        return losses.exact_opd_loss(jax.nn.log_softmax(z, -1), jnp.asarray(t, jnp.float32), mask,
                                     aggregation="token-mean")[0]

    grad = np.asarray(jax.grad(loss_of)(jnp.asarray(student_logits, jnp.float32)))
    s = log_softmax(student_logits)
    p = np.exp(s)
    kl = (p * (s - t)).sum(-1, keepdims=True)
    expected = p * (s - t - kl) * mask[..., None] / mask.sum()
    np.testing.assert_allclose(grad, expected, atol=1e-6)
    # the teacher's side is a constant
    teacher_grad = jax.grad(lambda q: losses.exact_opd_loss(jnp.asarray(s, jnp.float32), q, mask)[0])(
        jnp.asarray(t, jnp.float32))
    assert not np.asarray(teacher_grad).any()


def test_dense_scorer_and_step_give_the_exact_reverse_kl_of_the_samples(setup):  # noqa: F811
    graphdef, batch = setup["graphdef"], setup["batch"]
    width = max(int(m.sum()) for m in batch.loss_mask)
    mesh = make_mesh(1, 1)
    teacher_shardings = jax.tree.map(lambda x: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()),
                                     setup["teacher"])
    teacher_params = jax.device_put(setup["teacher"], teacher_shardings)
    scorer = make_teacher_scorer(graphdef, teacher_shardings, mesh, max_supervised_tokens=width, dense=True)
    rows = batch_shardings(mesh)
    scored = score_batch(scorer, teacher_params, batch, rows)
    # the token log-probs come out as the plain scorer's: the per-row reference
    expected_logp = padded([np.where(s.loss_mask, lp, 0.0) for s, lp in zip(setup["samples"], setup["teacher_logp"])],
                           batch.shape[1])
    np.testing.assert_allclose(np.asarray(scored.teacher_logp), expected_logp, atol=2e-6)
    dense = np.asarray(scored.teacher_dense_logp)
    assert dense.shape == (batch.shape[0], width, TINY.vocab_size)
    np.testing.assert_allclose(np.exp(dense).sum(-1), 1.0, atol=1e-5)

    config = LossConfig(kind="opd-exact", temperature=1.0, max_supervised_tokens=width, aggregation="token-mean")
    loss, metrics = jax.jit(lambda p, b: batch_loss(p, graphdef, b, config))(setup["student"], scored)
    reference = exact_reverse_kl((graphdef, setup["student"]), (graphdef, setup["teacher"]), setup["samples"],
                                 batch_size=8, length_multiple=4)
    np.testing.assert_allclose(float(loss), reference, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["exact_reverse_kl"]), reference, rtol=1e-5)
    sampled = np.mean(np.concatenate([(lp - t)[s.loss_mask] for s, lp, t in zip(
        setup["samples"], setup["student_logp"], setup["teacher_logp"])]))
    np.testing.assert_allclose(float(metrics["sampled_reverse_kl"]), sampled, rtol=1e-4, atol=1e-6)

    # a few AdamW steps on this batch lower the exact reverse KL of these samples
    optimizer = optax.adamw(3e-3)
    state_shardings = train_state_shardings(setup["student"], optimizer, mesh)
    step = make_train_step(graphdef, optimizer, config, state_shardings, rows)
    state = init_train_state(setup["student"], optimizer, state_shardings)
    device_batch = place_batch(scored, rows)
    for _ in range(5):
        state, step_metrics = step(state, device_batch)
    after = exact_reverse_kl((graphdef, state.params), (graphdef, setup["teacher"]), setup["samples"],
                             batch_size=8, length_multiple=4)
    assert after < 0.9 * reference, (reference, after)


def test_unscored_batch_and_bad_configs_are_refused(setup):  # noqa: F811
    config = LossConfig(kind="opd-exact", max_supervised_tokens=16)
    with pytest.raises(ValueError, match="teacher_dense_logp has shape"):
        batch_loss(setup["student"], setup["graphdef"], setup["batch"], config)
    with pytest.raises(ValueError, match="needs max_supervised_tokens"):
        LossConfig(kind="opd-exact")
    with pytest.raises(ValueError, match="dense teacher scorer needs max_supervised_tokens"):
        make_teacher_scorer(setup["graphdef"], None, make_mesh(1, 1), dense=True)
    with pytest.raises(ValueError, match="sti trains its own objective"):
        build_config("sti", preset="cpu", loss="opd-exact")
    assert build_config("actfirst", preset="cpu", loss="opd-exact").loss == "opd-exact"
    batch = collate_samples(setup["samples"], length_multiple=4)
    assert batch.teacher_dense_logp.shape == (8, 0, 0)



# ----------------------------------------------------------------------------------------------------------
# The top-K form (``LossConfig.exact_top_k``): the teacher's K most probable ids and the rest as one outcome
# ----------------------------------------------------------------------------------------------------------
def bucketed_reverse_kl(s, t, k):
    """numpy, float64: the reverse KL of p = exp(s) and q = exp(t) merged onto q's top k ids and one "rest"."""
    ids = np.argsort(-t, axis=-1, kind="stable")[..., :k]
    p, q = np.exp(s), np.exp(t)
    p_top, q_top = np.take_along_axis(p, ids, -1), np.take_along_axis(q, ids, -1)
    p_rest, q_rest = 1 - p_top.sum(-1), 1 - q_top.sum(-1)
    return (p_top * np.log(p_top / q_top)).sum(-1) + p_rest * np.log(p_rest / q_rest), ids


def test_top_k_reverse_kl_is_the_enumerated_coarse_kl_and_bounds_the_exact_one(arrays):
    student_logits, teacher_logits, mask, _ = arrays
    s, t = log_softmax(student_logits.astype(np.float64)), log_softmax(teacher_logits.astype(np.float64))
    exact = (np.exp(s) * (s - t)).sum(-1)
    for k in (1, 2, 4):
        expected, ids = bucketed_reverse_kl(s, t, k)
        values, top_ids = losses.top_k_with_rest(jnp.asarray(t, jnp.float32), k)
        np.testing.assert_array_equal(np.asarray(top_ids), ids)
        np.testing.assert_allclose(np.asarray(values[..., :k]), np.take_along_axis(t, ids, -1), rtol=1e-6)
        np.testing.assert_allclose(np.exp(np.asarray(values)).sum(-1), 1.0, rtol=1e-5)
        kl = np.asarray(losses.top_k_reverse_kl(jnp.asarray(s, jnp.float32), values, top_ids))
        np.testing.assert_allclose(kl, expected, rtol=1e-4, atol=1e-6)
        assert np.all(kl <= exact + 1e-6) and kl.max() > 0.05       # merging outcomes never raises a KL
        loss, metrics = losses.exact_opd_loss(jnp.asarray(s, jnp.float32), values, mask, teacher_ids=top_ids,
                                              aggregation="token-mean")
        np.testing.assert_allclose(float(loss), expected[mask].mean(), rtol=1e-4)
        np.testing.assert_allclose(float(metrics["exact_reverse_kl"]), expected[mask].mean(), rtol=1e-4)


def test_top_k_rest_mass_survives_a_confident_teacher():
    """The rest's log-mass by logsumexp: finite and right where log(1 - sum of the top K) cancels to log 0."""
    logits = np.array([[30.0, 0.0, -1.0, -2.0, -3.0]])
    t = log_softmax(logits)                                        # float64 reference: rest ~ e^-30
    values, ids = losses.top_k_with_rest(jnp.asarray(t, jnp.float32), 1)
    rest = np.log(np.exp(t[0, 1:]).sum())
    assert np.float32(1) - np.exp(np.float32(t[0, 0])) == 0        # the cancelling form would give log 0
    np.testing.assert_allclose(float(values[0, 1]), rest, rtol=1e-5)
    assert int(ids[0, 0]) == 0


def test_top_k_gradient_matches_finite_differences(arrays):
    student_logits, teacher_logits, _, _ = arrays
    t = log_softmax(teacher_logits[0, 0].astype(np.float64))
    values, ids = losses.top_k_with_rest(jnp.asarray(t, jnp.float32), 2)

    def reference(z):
        return bucketed_reverse_kl(log_softmax(z), t, 2)[0]

    z = student_logits[0, 0].astype(np.float64)
    numeric = np.array([(reference(z + e) - reference(z - e)) / 2e-5 for e in np.eye(5) * 1e-5])
    grad = jax.grad(lambda x: losses.top_k_reverse_kl(jax.nn.log_softmax(x), values, ids))(jnp.asarray(z, jnp.float32))
    np.testing.assert_allclose(np.asarray(grad), numeric, atol=2e-4)


def test_top_k_over_every_id_is_the_exact_kl_with_finite_gradients(arrays):
    """ids covering the vocabulary leave no rest: the coarse KL is the exact one and no NaN appears."""
    student_logits, teacher_logits, _, _ = arrays
    t = jax.nn.log_softmax(jnp.asarray(teacher_logits, jnp.float32))
    ids = jnp.argsort(-t, axis=-1)
    values = jnp.concatenate([jnp.take_along_axis(t, ids, -1), losses.log_mass_outside(t, ids)[..., None]], -1)
    assert float(values[..., -1].max()) < -1e29

    def kl(z):
        return losses.top_k_reverse_kl(jax.nn.log_softmax(z), values, ids)

    z = jnp.asarray(student_logits, jnp.float32)
    np.testing.assert_allclose(np.asarray(kl(z)), np.asarray(losses.reverse_kl_from_log_probs(
        jax.nn.log_softmax(z), t)), rtol=1e-5, atol=1e-7)
    grad = jax.grad(lambda x: kl(x).sum())(z)
    exact = jax.grad(lambda x: losses.reverse_kl_from_log_probs(jax.nn.log_softmax(x), t).sum())(z)
    assert np.isfinite(np.asarray(grad)).all()
    np.testing.assert_allclose(np.asarray(grad), np.asarray(exact), atol=1e-5)


def test_top_k_scorer_and_step(setup):  # noqa: F811
    """The top-K scorer sends the dense scorer's top K and rest; the step's loss is the coarse KL of those; its
    sampled metric is the dense run's."""
    graphdef, batch, k = setup["graphdef"], setup["batch"], 6
    width = max(int(m.sum()) for m in batch.loss_mask)
    mesh = make_mesh(1, 1)
    teacher_shardings = jax.tree.map(lambda x: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()),
                                     setup["teacher"])
    teacher_params = jax.device_put(setup["teacher"], teacher_shardings)
    rows = batch_shardings(mesh)
    dense = score_batch(make_teacher_scorer(graphdef, teacher_shardings, mesh, max_supervised_tokens=width,
                                            dense=True), teacher_params, batch, rows)
    top = score_batch(make_teacher_scorer(graphdef, teacher_shardings, mesh, max_supervised_tokens=width,
                                          dense=True, top_k=k), teacher_params, batch, rows)
    values, ids = losses.top_k_with_rest(dense.teacher_dense_logp, k)
    assert top.teacher_dense_logp.shape == (batch.shape[0], width, k + 1) and top.teacher_top_ids.shape[-1] == k
    np.testing.assert_array_equal(np.asarray(top.teacher_top_ids), np.asarray(ids))
    np.testing.assert_allclose(np.asarray(top.teacher_dense_logp), np.asarray(values), atol=1e-6)
    np.testing.assert_allclose(np.asarray(top.teacher_logp), np.asarray(dense.teacher_logp), atol=1e-6)

    loss_of = {}
    for name, config, scored in (
            ("dense", LossConfig(kind="opd-exact", temperature=1.0, max_supervised_tokens=width), dense),
            ("top", LossConfig(kind="opd-exact", temperature=1.0, max_supervised_tokens=width, exact_top_k=k), top)):
        loss_of[name] = jax.jit(lambda p, b, c=config: batch_loss(p, graphdef, b, c))(setup["student"], scored)
    (dense_loss, dense_metrics), (top_loss, top_metrics) = loss_of["dense"], loss_of["top"]
    # the coarse KL recomputed from the student's dense log-softmax at the same positions
    model = nnx.merge(graphdef, setup["student"])
    positions = jnp.asarray(batch.positions)
    hidden, _ = model.hidden_states(jnp.asarray(batch.tokens), positions,
                                    dense_causal_attend(positions, jnp.asarray(batch.attention_mask)))
    student, _, _, valid = supervised_dense_log_probs(model, hidden, jnp.asarray(batch.tokens),
                                                      jnp.asarray(batch.loss_mask), width, 1.0)
    expected, _ = losses.exact_opd_loss(student, values, valid, teacher_ids=ids)
    np.testing.assert_allclose(float(top_loss), float(expected), rtol=1e-5)
    assert 0 < float(top_loss) <= float(dense_loss) + 1e-6
    np.testing.assert_allclose(float(top_metrics["sampled_reverse_kl"]), float(dense_metrics["sampled_reverse_kl"]),
                               rtol=1e-4, atol=1e-6)


def test_top_k_refusals(setup):  # noqa: F811
    with pytest.raises(ValueError, match="exact_top_k sizes the opd-exact loss"):
        LossConfig(kind="opd", exact_top_k=8)
    with pytest.raises(ValueError, match="positive int"):
        LossConfig(kind="opd-exact", max_supervised_tokens=8, exact_top_k=0)
    with pytest.raises(ValueError, match="pass --loss opd-exact"):
        build_config("vanilla-opd", preset="cpu", exact_top_k=8)
    with pytest.raises(ValueError, match="pass dense=True"):
        make_teacher_scorer(setup["graphdef"], None, make_mesh(1, 1), max_supervised_tokens=8, top_k=4)
    values, ids = losses.top_k_with_rest(jnp.zeros((1, 2, 8)), 3)
    with pytest.raises(ValueError, match="needs teacher_target_log_probs"):
        losses.exact_opd_loss(jnp.zeros((1, 2, 8)), values, jnp.ones((1, 2)), teacher_ids=ids,
                              targets=jnp.zeros((1, 2), jnp.int32))
    with pytest.raises(ValueError, match=r"k must be in \[1, 64\)"):
        losses.top_k_with_rest(jnp.zeros((2, 64)), 64)
    config = LossConfig(kind="opd-exact", max_supervised_tokens=16, exact_top_k=4)
    with pytest.raises(ValueError, match="top_k=4"):
        batch_loss(setup["student"], setup["graphdef"], setup["batch"], config)
    assert collate_samples(setup["samples"], length_multiple=4).teacher_top_ids.shape == (8, 0, 0)


def test_top_k_agreement_on_held_out_states(setup):  # noqa: F811
    """divergence.top_k_agreement: K = V - 1 leaves one id as the rest, so the coarse KL is the exact one (share
    1, cosine 1); smaller K keep the share the numpy coarse KL of the two models' log-softmax gives."""
    from jaxopd.methods.divergence import supervised_log_softmax, top_k_agreement
    from jaxopd.train.logprobs import supervised_order

    graphdef, samples = setup["graphdef"], setup["samples"]
    result = top_k_agreement((graphdef, setup["student"]), (graphdef, setup["teacher"]), samples,
                             (2, 16, TINY.vocab_size - 1), batch_size=8, length_multiple=4)
    full = result[TINY.vocab_size - 1]
    np.testing.assert_allclose([full["kl_fraction"], full["gradient_cosine"]], [1.0, 1.0], rtol=1e-4)
    reference = exact_reverse_kl((graphdef, setup["student"]), (graphdef, setup["teacher"]), samples,
                                 batch_size=8, length_multiple=4)
    np.testing.assert_allclose(full["exact_reverse_kl"], reference, rtol=1e-5)

    batch = collate_samples(samples, batch_size=8, length_multiple=4)
    width = max(s.num_supervised for s in samples)
    order, valid = supervised_order(jnp.asarray(batch.loss_mask), width)
    arrays = [jnp.asarray(a) for a in (batch.tokens, batch.positions, batch.attention_mask)]
    s, t = (np.asarray(supervised_log_softmax(graphdef, params, *arrays, order, 1.0), np.float64)
            for params in (setup["student"], setup["teacher"]))
    valid = np.asarray(valid)
    exact = (np.exp(s) * (s - t)).sum(-1)[valid].sum()
    for k in (2, 16):
        coarse = bucketed_reverse_kl(s, t, k)[0][valid].sum()
        np.testing.assert_allclose(result[k]["kl_fraction"], coarse / exact, rtol=1e-3)
        assert 0 < result[k]["kl_fraction"] < 1 and 0 < result[k]["gradient_cosine"] < 1
    assert result[2]["kl_fraction"] < result[16]["kl_fraction"]
