"""Per-token log-probabilities of a batch under a model, as the train step and the teacher scorer compute them.

Owns the three exact paths: every position (``sequence_log_probs``, optionally in vocabulary-sized chunks), the
supervised positions only (``supervised_log_probs`` and its dense form, the whole log-softmax there), and the
prompt tokens under a restricted softmax (``context_log_probs``, the SFT context term); plus the host-side check
that a batch fits the supervised width.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxopd.models.decoder import CausalLM, dense_causal_attend
from jaxopd.models.logprobs import ROLLOUT_TEMPERATURE, tempered_log_softmax, token_log_probs


def sequence_log_probs(model: CausalLM, tokens: jax.Array, positions: jax.Array, attention_mask: jax.Array,
                       temperature: float = ROLLOUT_TEMPERATURE, logits_chunk_size: int | None = None, *,
                       remat_layers: bool = False) -> jax.Array:
    """``[B, T]`` log-probability of each token given the tokens before it; position 0 (no context) is 0.

    With ``logits_chunk_size`` the vocabulary projection and log-softmax run over that many positions
    at a time inside a rematerialised ``lax.map``; ``remat_layers`` rematerialises the layers likewise
    (``CausalLM.hidden_states(remat=True)``).
    """
    hidden, _ = model.hidden_states(tokens, positions, dense_causal_attend(positions, attention_mask),
                                    remat=remat_layers)
    hidden, targets = hidden[:, :-1], tokens[:, 1:]
    length = hidden.shape[1]
    if logits_chunk_size is None or logits_chunk_size >= length:
        logp = token_log_probs(model.logits(hidden), targets, temperature)
    else:
        chunks = -(-length // logits_chunk_size)
        pad = chunks * logits_chunk_size - length
        hidden_chunks = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
        target_chunks = jnp.pad(targets, ((0, 0), (0, pad)))
        batch = hidden.shape[0]
        hidden_chunks = hidden_chunks.reshape(batch, chunks, logits_chunk_size, -1).swapaxes(0, 1)
        target_chunks = target_chunks.reshape(batch, chunks, logits_chunk_size).swapaxes(0, 1)

        @jax.checkpoint
        def chunk_log_probs(args):
            chunk_hidden, chunk_targets = args
            return token_log_probs(model.logits(chunk_hidden), chunk_targets, temperature)

        logp = jax.lax.map(chunk_log_probs, (hidden_chunks, target_chunks))
        logp = logp.swapaxes(0, 1).reshape(batch, -1)[:, :length]
    logp = jnp.where(attention_mask[:, 1:].astype(bool), logp, 0.0)
    return jnp.pad(logp, ((0, 0), (1, 0)))


def supervised_log_probs(model: CausalLM, tokens: jax.Array, positions: jax.Array, attention_mask: jax.Array,
                         loss_mask: jax.Array, max_supervised_tokens: int,
                         temperature: float = ROLLOUT_TEMPERATURE, *, remat_layers: bool = False) -> jax.Array:
    """``sequence_log_probs`` on the supervised positions only (0 elsewhere): the first ``max_supervised_tokens``
    True entries of each row of ``loss_mask`` are gathered, projected onto the vocabulary and scattered back.

    Exact when no row has more supervised tokens than ``max_supervised_tokens`` (check on the host with
    :func:`check_supervised_fit`); further ones would read 0.
    """
    hidden, _ = model.hidden_states(tokens, positions, dense_causal_attend(positions, attention_mask),
                                    remat=remat_layers)
    return supervised_from_hidden(model, hidden, tokens, loss_mask, max_supervised_tokens, temperature)


def supervised_order(loss_mask: jax.Array, max_supervised_tokens: int) -> tuple[jax.Array, jax.Array]:
    """Each row's first ``W = min(max_supervised_tokens, T)`` supervised positions ``order`` ``[B, W]`` (the
    supervised positions first, in position order; then unsupervised ones) and ``valid`` ``[B, W]``, whether
    each is supervised."""
    width = min(int(max_supervised_tokens), loss_mask.shape[1])
    mask = loss_mask.astype(bool)
    order = jnp.argsort(jnp.logical_not(mask), axis=1, stable=True)[:, :width]
    return order, jnp.take_along_axis(mask, order, axis=1)


def supervised_dense_log_probs(model: CausalLM, hidden: jax.Array, tokens: jax.Array, loss_mask: jax.Array,
                               max_supervised_tokens: int, temperature: float
                               ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The tempered log-softmax ``[B, W, V]`` of the logits that predict each row's first W supervised tokens
    (:func:`supervised_order`), from the final hidden states ``hidden`` ``[B, T, D]`` of ``tokens``; with those
    tokens ``targets`` ``[B, W]``, ``order`` and ``valid``."""
    order, valid = supervised_order(loss_mask, max_supervised_tokens)
    context = jnp.take_along_axis(hidden, jnp.maximum(order - 1, 0)[..., None], axis=1)   # predicts tokens[order]
    targets = jnp.take_along_axis(tokens, order, axis=1)
    return tempered_log_softmax(model.logits(context), temperature), targets, order, valid


def target_log_probs(log_probs: jax.Array, targets: jax.Array, order: jax.Array, valid: jax.Array,
                      length: int) -> jax.Array:
    """``[B, length]``: the log-probabilities ``log_probs`` ``[B, W, V]`` give the tokens ``targets``, put back at
    their positions ``order`` (0 elsewhere and where not ``valid``)."""
    values = jnp.where(valid, jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0], 0.0)
    rows = jnp.arange(values.shape[0])[:, None]
    return jnp.zeros((values.shape[0], length), values.dtype).at[rows, order].add(values)


def supervised_from_hidden(model: CausalLM, hidden: jax.Array, tokens: jax.Array, loss_mask: jax.Array,
                            max_supervised_tokens: int, temperature: float) -> jax.Array:
    return target_log_probs(*supervised_dense_log_probs(model, hidden, tokens, loss_mask, max_supervised_tokens,
                                                         temperature), tokens.shape[1])


def context_log_probs(model: CausalLM, hidden: jax.Array, tokens: jax.Array, attention_mask: jax.Array,
                      loss_mask: jax.Array, vocab_ids: Any) -> tuple[jax.Array, jax.Array]:
    """Log-probabilities of the context (prompt) tokens under the softmax restricted to ``vocab_ids``.

    ``hidden``: the final hidden states ``[B, T, D]`` of ``tokens``; ``vocab_ids``: sorted token ids ``[V']``.
    Returns ``(logp, mask)``, both ``[B, T]``: at position t >= 1, log softmax(h_{t-1} · E[vocab_ids])[index of
    tokens[t]], and mask True where t is a real token outside ``loss_mask`` whose id lies in ``vocab_ids``
    (position 0, padding, supervised and out-of-vocabulary tokens read 0 with mask False). Restricted to
    a corpus vocabulary (298 ids for the searching expert's 2,329 ALFWorld turns) the projection costs a fraction
    of the full one over 151,936 rows, so every prompt position can be trained.
    """
    vocab = jnp.asarray(vocab_ids, jnp.int32)
    index = jnp.full((model.config.vocab_size,), -1, jnp.int32).at[vocab].set(jnp.arange(vocab.shape[0],
                                                                                          dtype=jnp.int32))
    targets = index[tokens[:, 1:]]
    mask = (attention_mask[:, 1:].astype(bool) & attention_mask[:, :-1].astype(bool)
            & jnp.logical_not(loss_mask[:, 1:].astype(bool)) & (targets >= 0))
    logits = model.logits(hidden[:, :-1], head_dv=model.head_rows(vocab))
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), jnp.maximum(targets, 0)[..., None],
                               axis=-1)[..., 0]
    logp = jnp.where(mask, logp, 0.0)
    return jnp.pad(logp, ((0, 0), (1, 0))), jnp.pad(mask, ((0, 0), (1, 0)))


def check_supervised_fit(loss_mask: Any, max_supervised_tokens: int | None) -> None:
    """``ValueError`` when a row of ``loss_mask`` has more supervised tokens than ``max_supervised_tokens``."""
    if max_supervised_tokens is None:
        return
    import numpy as np
    most = int(np.asarray(loss_mask).sum(axis=1).max(initial=0))
    if most > max_supervised_tokens:
        raise ValueError(f"a sample has {most} supervised tokens, more than max_supervised_tokens "
                         f"{max_supervised_tokens}; raise it (or set it to None)")



__all__ = ["sequence_log_probs", "supervised_log_probs", "supervised_order", "supervised_dense_log_probs",
           "target_log_probs", "supervised_from_hidden", "context_log_probs", "check_supervised_fit"]
