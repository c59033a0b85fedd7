"""The teacher's scoring of a training batch, compiled for the teacher mesh.

Owns ``TeacherScorer`` (the teacher's log-prob of every token, or only of the supervised ones, optionally with its
whole log-softmax or top K there for ``opd-exact``), the named ``TeacherScores`` it returns, and ``score_batch``,
which fills a batch's teacher fields and places it on the trainer mesh.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxopd import losses
from jaxopd.models.decoder import dense_causal_attend
from jaxopd.models.logprobs import ROLLOUT_TEMPERATURE
from jaxopd.models.sharding import DATA_AXIS
from jaxopd.train.buffer import TrainBatch
from jaxopd.train.logprobs import (check_supervised_fit, sequence_log_probs, supervised_dense_log_probs,
                                   supervised_log_probs, target_log_probs)
from jaxopd.train.state import check_rows_divide, place_batch


class TeacherScores(NamedTuple):
    """What a ``TeacherScorer`` returns, on the teacher mesh: ``logp`` ``[B, T]`` the teacher's log-prob of every
    token; a dense scorer (``opd-exact``) also ``dense_logp``, its log-softmax at the supervised positions
    (``[B, S, V]``, or ``[B, S, K + 1]`` over its top K ids and the rest), and a top-K one ``top_ids`` ``[B, S, K]``."""

    logp: Any
    dense_logp: Any = None
    top_ids: Any = None


@dataclasses.dataclass(frozen=True)
class TeacherScorer:
    """Per-token log-probs of token sequences under the teacher, compiled for the teacher mesh.

    ``scorer(params, tokens, positions, attention_mask[, loss_mask]) -> TeacherScores``: inputs (host arrays or
    arrays on any devices) are first moved to the teacher mesh, rows split over its data axis; the result stays
    there.
    """

    compiled: Callable[..., Any]
    row_sharding: NamedSharding
    max_supervised_tokens: int | None = None
    dense: bool = False
    top_k: int | None = None

    def __call__(self, params: nnx.State, tokens: Any, positions: Any, attention_mask: Any,
                 loss_mask: Any = None) -> TeacherScores:
        check_rows_divide(tokens.shape[0], self.row_sharding)
        if self.max_supervised_tokens is None:
            tokens, positions, attention_mask = jax.device_put((tokens, positions, attention_mask), self.row_sharding)
            return self._scores(self.compiled(params, tokens, positions, attention_mask))
        if loss_mask is None:
            raise ValueError("a scorer of supervised positions only (max_supervised_tokens) needs the loss mask")
        check_supervised_fit(loss_mask, self.max_supervised_tokens)
        arrays = jax.device_put((tokens, positions, attention_mask, loss_mask), self.row_sharding)
        return self._scores(self.compiled(params, *arrays))

    def _scores(self, out: Any) -> TeacherScores:
        if not self.dense:
            return TeacherScores(out)
        logp, dense_logp, *top_ids = out
        return TeacherScores(logp, dense_logp, top_ids[0] if top_ids else None)


def make_teacher_scorer(graphdef: nnx.GraphDef, param_shardings: nnx.State, mesh: Mesh, *,
                        temperature: float = ROLLOUT_TEMPERATURE, logits_chunk_size: int | None = None,
                        max_supervised_tokens: int | None = None, dense: bool = False, top_k: int | None = None,
                        data_axis: str = DATA_AXIS) -> TeacherScorer:
    """The teacher's scorer on ``mesh`` with the teacher's parameter shardings (see :class:`TeacherScorer`).
    With ``max_supervised_tokens`` only the supervised positions are scored (0 elsewhere; the loss reads no
    other), by :func:`supervised_log_probs`. ``dense`` (needs ``max_supervised_tokens``; for the ``opd-exact``
    loss) returns ``(token_logp [B, T], log_softmax [B, W, V])``: also the teacher's whole tempered log-softmax at
    each row's first W supervised positions (:func:`supervised_dense_log_probs`); that array is B·W·V floats
    (over Qwen3's 151,936 ids: 1.2 GB). ``top_k`` (dense only)
    returns ``(token_logp, values [B, W, K + 1], ids [B, W, K])`` instead, the top K and the rest of
    :func:`jaxopd.losses.top_k_with_rest` (16 × 128 × 64: 1 MB)."""
    rows = NamedSharding(mesh, PartitionSpec(data_axis))
    if top_k is not None and not dense:
        raise ValueError("top_k sizes a dense scorer's output; pass dense=True")

    if dense:
        if max_supervised_tokens is None:
            raise ValueError("a dense teacher scorer needs max_supervised_tokens (the positions it returns the "
                             "log-softmax at)")

        def score(params, tokens, positions, attention_mask, loss_mask):
            model = nnx.merge(graphdef, params)
            hidden, _ = model.hidden_states(tokens, positions, dense_causal_attend(positions, attention_mask))
            dense = supervised_dense_log_probs(model, hidden, tokens, loss_mask, max_supervised_tokens, temperature)
            token_logp = target_log_probs(*dense, tokens.shape[1])
            if top_k is None:
                return token_logp, dense[0]
            return (token_logp, *losses.top_k_with_rest(dense[0], top_k))

        outputs = (rows, rows) if top_k is None else (rows, rows, rows)
        compiled = jax.jit(score, in_shardings=(param_shardings, rows, rows, rows, rows), out_shardings=outputs)
    elif max_supervised_tokens is None:
        def score(params, tokens, positions, attention_mask):
            model = nnx.merge(graphdef, params)
            return sequence_log_probs(model, tokens, positions, attention_mask, temperature, logits_chunk_size)

        compiled = jax.jit(score, in_shardings=(param_shardings, rows, rows, rows), out_shardings=rows)
    else:
        def score(params, tokens, positions, attention_mask, loss_mask):
            model = nnx.merge(graphdef, params)
            return supervised_log_probs(model, tokens, positions, attention_mask, loss_mask, max_supervised_tokens,
                                        temperature)

        compiled = jax.jit(score, in_shardings=(param_shardings, rows, rows, rows, rows), out_shardings=rows)
    return TeacherScorer(compiled, rows, max_supervised_tokens, dense, top_k)


def score_batch(scorer: TeacherScorer, teacher_params: nnx.State, batch: TrainBatch,
                trainer_batch_sharding: TrainBatch) -> TrainBatch:
    """Fills ``teacher_logp`` with the teacher's log-probs of the batch's tokens (computed on the teacher
    mesh, then transferred) and returns the whole batch placed on ``trainer_batch_sharding``.

    A dense scorer (``opd-exact``) also fills ``teacher_dense_logp`` (and a top-K one ``teacher_top_ids``). Any
    ``teacher_logp`` already in the batch is replaced; to train on log-probs the rollout computed
    itself, or for ActionOPD and SFT (``LossConfig.needs_teacher_logp`` is False), call :func:`place_batch`.
    """
    scores = scorer(teacher_params, batch.tokens, batch.positions, batch.attention_mask, batch.loss_mask)
    batch = batch.replace(teacher_logp=scores.logp)
    if scores.dense_logp is not None:
        batch = batch.replace(teacher_dense_logp=scores.dense_logp)
    if scores.top_ids is not None:
        batch = batch.replace(teacher_top_ids=scores.top_ids)
    return place_batch(batch, trainer_batch_sharding)



__all__ = ["TeacherScores", "TeacherScorer", "make_teacher_scorer", "score_batch"]
