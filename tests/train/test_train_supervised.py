"""The supervised-positions path of the train step and the teacher scorer (``LossConfig.max_supervised_tokens``):
projecting only the positions that predict supervised tokens gives the same log-probs, losses and gradients as the
full projection, and a row with too many supervised tokens is refused, never silently cut."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxopd.models.decoder import CausalLM, ModelConfig
from jaxopd.models.sharding import named_shardings
from jaxopd.train import RolePlan, build_meshes, make_teacher_scorer
from jaxopd.train.buffer import Sample, collate_samples
from jaxopd.train.logprobs import check_supervised_fit, sequence_log_probs, supervised_log_probs
from jaxopd.train.step import LossConfig, batch_loss

CFG = ModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64,
                  vocab_size=64, dtype="float32", param_dtype="float32")


def batch():
    rng = np.random.default_rng(0)
    samples = []
    for length, supervised in [(20, 5), (13, 7), (30, 1)]:
        tokens = rng.integers(0, 64, length)
        mask = np.zeros(length, bool)
        mask[length - supervised:] = True
        mask[3] = length == 20          # a supervised token inside the context too (STI's mixed turns)
        samples.append(Sample(tokens, mask, np.where(mask, -1.0, 0.0), 0, teacher_logp=np.where(mask, -2.0, 0.0),
                              teacher_generated=mask & (np.arange(length) % 2 == 0)))
    return collate_samples(samples, batch_size=4)


def test_supervised_log_probs_equal_the_full_projection_on_supervised_tokens():
    model = CausalLM(CFG, rngs=nnx.Rngs(0))
    b = batch()
    full = np.asarray(sequence_log_probs(model, b.tokens, b.positions, b.attention_mask, 0.7))
    sup = np.asarray(supervised_log_probs(model, b.tokens, b.positions, b.attention_mask, b.loss_mask, 8, 0.7))
    np.testing.assert_allclose(sup[b.loss_mask], full[b.loss_mask], atol=2e-6)
    assert np.all(sup[~b.loss_mask] == 0.0)


@pytest.mark.slow  # heavier than the README's test run allows (run in CI: pytest -m slow)
@pytest.mark.parametrize("kind", ["opd", "sti-opd", "sft"])
def test_losses_and_gradients_match(kind):
    graphdef, params = nnx.split(CausalLM(CFG, rngs=nnx.Rngs(0)))
    b = batch()
    (loss, _), grads = jax.value_and_grad(batch_loss, has_aux=True)(params, graphdef, b, LossConfig(kind=kind))
    (loss2, _), grads2 = jax.value_and_grad(batch_loss, has_aux=True)(
        params, graphdef, b, LossConfig(kind=kind, max_supervised_tokens=8))
    np.testing.assert_allclose(float(loss2), float(loss), rtol=1e-6, atol=1e-7)
    for a, c in zip(jax.tree.leaves(grads), jax.tree.leaves(grads2)):
        np.testing.assert_allclose(np.asarray(c), np.asarray(a), atol=1e-6)
    assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(grads)) > 1e-4


def test_teacher_scorer_on_supervised_positions():
    graphdef, params = nnx.split(CausalLM(CFG, rngs=nnx.Rngs(1)))
    meshes = build_meshes(RolePlan.colocated_on(1))
    shardings = named_shardings(params, meshes.teacher)
    b = batch()
    full = np.asarray(make_teacher_scorer(graphdef, shardings, meshes.teacher)(params, b.tokens, b.positions,
                                                                              b.attention_mask).logp)
    scorer = make_teacher_scorer(graphdef, shardings, meshes.teacher, max_supervised_tokens=8)
    sup = np.asarray(scorer(params, b.tokens, b.positions, b.attention_mask, b.loss_mask).logp)
    np.testing.assert_allclose(sup[b.loss_mask], full[b.loss_mask], atol=2e-6)
    with pytest.raises(ValueError, match="loss mask"):
        scorer(params, b.tokens, b.positions, b.attention_mask)
    with pytest.raises(ValueError, match="supervised tokens"):
        make_teacher_scorer(graphdef, shardings, meshes.teacher, max_supervised_tokens=4)(
            params, b.tokens, b.positions, b.attention_mask, b.loss_mask)


def test_check_supervised_fit():
    mask = np.zeros((2, 10), bool)
    mask[1, 2:9] = True
    check_supervised_fit(mask, 7)
    check_supervised_fit(mask, None)
    with pytest.raises(ValueError, match="7 supervised tokens, more than max_supervised_tokens 6"):
        check_supervised_fit(mask, 6)
