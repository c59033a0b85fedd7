"""The exact reverse KL of the student to the teacher on held-out states: the quantity on-policy distillation
minimises, computed over the whole vocabulary rather than sampled.

Owns ``exact_reverse_kl``: for held-out turn-level samples (e.g. walkthrough turns of unseen games,
``jaxopd.methods.sft_data.walkthrough_samples``), KL(π_student(·|c) || π_teacher(·|c)) summed over the vocabulary at
every supervised position c (the response positions, teacher-forced), at a given temperature, averaged over
positions. Both models run a dense forward; only the supervised positions are projected onto the vocabulary.

Owns ``response_nll`` too: a model's mean negative log-likelihood of those responses (how well it fits the answers
themselves, e.g. which layers a student cut from its teacher should keep), and ``top_k_agreement``: on the same
states, how much of that KL the ``opd-exact`` loss's top-K form (``losses.top_k_reverse_kl``, the teacher's K most
probable ids and the rest) keeps, and how closely its gradient with respect to the student's logits points where the
exact one does.
"""
from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxopd.losses import reverse_kl_from_log_probs, top_k_reverse_kl, top_k_with_rest
from jaxopd.models.logprobs import tempered_log_softmax
from jaxopd.models.decoder import dense_causal_attend
from jaxopd.train.buffer import Sample, collate_samples
from jaxopd.train.logprobs import supervised_order

__all__ = ["exact_reverse_kl", "response_nll", "supervised_log_softmax", "top_k_agreement"]


def supervised_log_softmax(graphdef, params, tokens, positions, attention_mask, order, temperature):
    """Tempered log-softmax ``[B, W, V]`` of the model's next-token logits at the positions ``order`` ``[B, W]``
    (the logits that predict ``tokens[order]``), from one dense forward pass."""
    model = nnx.merge(graphdef, params)
    hidden, _ = model.hidden_states(tokens, positions, dense_causal_attend(positions, attention_mask))
    context = jnp.take_along_axis(hidden, jnp.maximum(order - 1, 0)[..., None], axis=1)
    return tempered_log_softmax(model.logits(context), temperature)


@functools.partial(jax.jit, static_argnames=("student_graphdef", "teacher_graphdef", "width", "temperature"))
def _batch_kl(student_graphdef, student_params, teacher_graphdef, teacher_params, tokens, positions, attention_mask,
              loss_mask, *, width: int, temperature: float):
    order, valid = supervised_order(loss_mask, width)
    student = supervised_log_softmax(student_graphdef, student_params, tokens, positions, attention_mask, order,
                                      temperature)
    teacher = supervised_log_softmax(teacher_graphdef, teacher_params, tokens, positions, attention_mask, order,
                                      temperature)
    kl = reverse_kl_from_log_probs(student, teacher)
    return jnp.sum(jnp.where(valid, kl, 0.0)), jnp.sum(valid)


def exact_reverse_kl(student: tuple[nnx.GraphDef, nnx.State], teacher: tuple[nnx.GraphDef, nnx.State],
                     samples: Sequence[Sample], *, temperature: float = 1.0, batch_size: int = 8,
                     length_multiple: int = 128) -> float:
    """Mean exact KL(student || teacher) over every supervised position of ``samples`` (nats per token).

    ``student`` / ``teacher``: ``(graphdef, params)`` of two models over one vocabulary.
    """
    if not samples:
        raise ValueError("exact_reverse_kl needs at least one sample")
    width = max(s.num_supervised for s in samples)
    total, count = 0.0, 0
    for start in range(0, len(samples), batch_size):
        chunk = samples[start:start + batch_size]
        batch = collate_samples(chunk, batch_size=batch_size, length_multiple=length_multiple)
        value, n = _batch_kl(student[0], student[1], teacher[0], teacher[1], jnp.asarray(batch.tokens),
                             jnp.asarray(batch.positions), jnp.asarray(batch.attention_mask),
                             jnp.asarray(batch.loss_mask), width=width, temperature=float(temperature))
        total += float(value)
        count += int(n)
    return float(np.float64(total) / max(count, 1))


@functools.partial(jax.jit, static_argnames=("graphdef", "width"))
def _batch_nll(graphdef, params, tokens, positions, attention_mask, loss_mask, *, width: int):
    order, valid = supervised_order(loss_mask, width)
    logp = supervised_log_softmax(graphdef, params, tokens, positions, attention_mask, order, 1.0)
    target = jnp.take_along_axis(tokens, order, axis=1)
    token_logp = jnp.take_along_axis(logp, target[..., None], axis=-1)[..., 0]
    return -jnp.sum(jnp.where(valid, token_logp, 0.0)), jnp.sum(valid)


def response_nll(model: tuple[nnx.GraphDef, nnx.State], samples: Sequence[Sample], *, batch_size: int = 8,
                 length_multiple: int = 128) -> float:
    """Mean negative log-likelihood (nats per token, temperature 1) of the supervised tokens of ``samples`` under
    ``model`` (``(graphdef, params)``), teacher-forced."""
    if not samples:
        raise ValueError("response_nll needs at least one sample")
    width = max(s.num_supervised for s in samples)
    total, count = 0.0, 0
    for start in range(0, len(samples), batch_size):
        batch = collate_samples(samples[start:start + batch_size], batch_size=batch_size,
                                length_multiple=length_multiple)
        value, n = _batch_nll(model[0], model[1], jnp.asarray(batch.tokens), jnp.asarray(batch.positions),
                              jnp.asarray(batch.attention_mask), jnp.asarray(batch.loss_mask), width=width)
        total += float(value)
        count += int(n)
    return float(np.float64(total) / max(count, 1))


@functools.partial(jax.jit, static_argnames=("student_graphdef", "teacher_graphdef", "width", "temperature", "ks"))
def _batch_top_k(student_graphdef, student_params, teacher_graphdef, teacher_params, tokens, positions,
                 attention_mask, loss_mask, *, width: int, temperature: float, ks: tuple[int, ...]):
    order, valid = supervised_order(loss_mask, width)
    student = supervised_log_softmax(student_graphdef, student_params, tokens, positions, attention_mask, order,
                                      temperature)
    teacher = supervised_log_softmax(teacher_graphdef, teacher_params, tokens, positions, attention_mask, order,
                                      temperature)

    def summed(kl_of):   # the summed KL over the valid states as a function of the student's logits
        return lambda logits: jnp.sum(jnp.where(valid, kl_of(jax.nn.log_softmax(logits, axis=-1)), 0.0))

    exact, exact_grad = jax.value_and_grad(summed(lambda s: reverse_kl_from_log_probs(s, teacher)))(student)
    out = {"exact": exact, "exact_grad_sq": jnp.sum(exact_grad ** 2), "states": jnp.sum(valid)}
    for k in ks:
        values, ids = top_k_with_rest(teacher, k)
        kl, grad = jax.value_and_grad(summed(lambda s, v=values, i=ids: top_k_reverse_kl(s, v, i)))(student)
        out[f"top{k}"], out[f"top{k}_dot"], out[f"top{k}_grad_sq"] = kl, jnp.sum(grad * exact_grad), jnp.sum(grad ** 2)
    return out


_SAME_MODEL_KL = 1e-7      # nats per state: float rounding of the exact KL between identical models


def top_k_agreement(student: tuple[nnx.GraphDef, nnx.State], teacher: tuple[nnx.GraphDef, nnx.State],
                    samples: Sequence[Sample], ks: Sequence[int], *, temperature: float = 1.0, batch_size: int = 8,
                    length_multiple: int = 128) -> dict[int, dict[str, float]]:
    """For each K of ``ks``: ``kl_fraction``, the top-K form's reverse KL over the exact one (summed over every
    supervised position of ``samples``; at most 1), and ``gradient_cosine``, the cosine between the two losses'
    gradients with respect to the student's logits at all those positions (1: the same direction). Both are None
    where the exact KL is 0 (the student is the teacher)."""
    if not samples:
        raise ValueError("top_k_agreement needs at least one sample")
    ks = tuple(int(k) for k in ks)
    width = max(s.num_supervised for s in samples)
    totals: dict[str, float] = {}
    for start in range(0, len(samples), batch_size):
        batch = collate_samples(samples[start:start + batch_size], batch_size=batch_size,
                                length_multiple=length_multiple)
        values = _batch_top_k(student[0], student[1], teacher[0], teacher[1], jnp.asarray(batch.tokens),
                              jnp.asarray(batch.positions), jnp.asarray(batch.attention_mask),
                              jnp.asarray(batch.loss_mask), width=width, temperature=float(temperature), ks=ks)
        for name, value in values.items():
            totals[name] = totals.get(name, 0.0) + float(value)
    # the KL of a model to itself is 0, and two forward passes round it to ~1e-10 nats either side: below this
    # mean per state the student is taken for the teacher and no share is reported
    identical = totals["exact"] <= _SAME_MODEL_KL * totals["states"]

    def ratio(numerator: float, denominator: float) -> float | None:
        return None if identical or denominator <= 0 else numerator / denominator

    return {k: {"kl_fraction": ratio(totals[f"top{k}"], totals["exact"]),
                "gradient_cosine": ratio(totals[f"top{k}_dot"],
                                         float(np.sqrt(totals[f"top{k}_grad_sq"] * totals["exact_grad_sq"]))),
                "exact_reverse_kl": totals["exact"] / totals["states"],
                "top_k_reverse_kl": totals[f"top{k}"] / totals["states"]} for k in ks}
