"""The exact reverse KL of the student to the teacher on held-out states: the quantity on-policy distillation
minimises, computed over the whole vocabulary rather than sampled.

Owns ``exact_reverse_kl``: for held-out turn-level samples (e.g. walkthrough turns of unseen games,
``jaxopd.methods.sft_data.walkthrough_samples``), KL(π_student(·|c) || π_teacher(·|c)) summed over the vocabulary at
every supervised position c (the response positions, teacher-forced), at a given temperature, averaged over
positions. Both models run a dense forward; only the supervised positions are projected onto the vocabulary.
"""
from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxopd.losses import reverse_kl_from_log_probs
from jaxopd.models.logprobs import tempered_log_softmax
from jaxopd.models.qwen3 import dense_causal_attend
from jaxopd.train.buffer import Sample, collate_samples
from jaxopd.train.step import supervised_order

__all__ = ["exact_reverse_kl", "supervised_log_softmax"]


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

    ``student`` / ``teacher``: ``(graphdef, params)`` of two Qwen3 models over one vocabulary.
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
