"""OPD with each sampled state's reverse KL computed over the whole vocabulary (``losses.exact_opd_loss``, the
``opd-exact`` loss kind): the loss and its gradient against hand-written numpy over a small vocabulary, the dense
teacher scorer against a per-row reference, the train step's loss against ``divergence.exact_reverse_kl`` of the
same samples, and the configuration errors."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxopd import losses
from jaxopd.methods.config import build_config
from jaxopd.methods.divergence import exact_reverse_kl
from jaxopd.train.buffer import collate_samples
from jaxopd.train.step import (LossConfig, batch_loss, batch_shardings, init_train_state, make_teacher_scorer,
                               make_train_step, place_batch, score_batch, train_state_shardings)
from test_train_step import TINY, make_mesh, padded
from test_train_step import setup  # noqa: F401  (the module fixture: 8 rows of random tokens, two random models)


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

