"""The three distillation losses (ActFirst-OPD / vanilla OPD, STI-OPD, ActionOPD) as pure functions of arrays.

Owns the shared clipped-surrogate primitive and its loss aggregation modes, the per-method advantages
(sampled reverse KL, importance-weighted reverse KL, action-agreement rewards with group centering and
batch whitening), STI-OPD's turn-level discrepancy score, OPD's reverse KL computed exactly over the vocabulary
at the sampled states (``exact_opd_loss``, an option beside the papers' sampled form; over a large
vocabulary on the teacher's top K ids and the rest, ``top_k_reverse_kl``), and the supervised
fine-tuning loss (the negative log-likelihood of demonstration tokens) that trains a teacher on walkthroughs.
Imports nothing from the project; the action strings that ActionOPD's match counts come from are handled in
``jaxopd.rollout.actions``.

Conventions: token arrays are ``[batch, length]`` (one row per turn-level response), ``mask`` marks the
supervised tokens (model-generated; inserted tokens, prompts and padding are 0), log-probabilities are
natural-log probabilities of the sampled tokens; values at masked positions are ignored but must be
finite where they are differentiated (``logp``), as masking uses ``jnp.where``. Every loss returns
``(scalar_loss, metrics)``; the loss is minimised.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional, Sequence

import chex
import jax
import jax.numpy as jnp

AGGREGATION_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
ADVANTAGE_LOGP = ("current", "sampled")
"""Which student log-prob the reverse-KL advantage A = -(log π_θ - log π_T) of OPD and STI-OPD reads: ``current``
(the forward pass being differentiated, under stop-gradient: the formula ActFirst-OPD App. B.4 and STI-OPD App. B.3
write) or ``sampled`` (the rollout's stored sampling log-prob, as Trinity-RFT, which both papers trained with,
computes it before the update). ``jaxopd.train.step.LossConfig.advantage_logp`` says which is the default and why."""
LOG_RATIO_BOUND = 20.0
"""Log-ratios are clipped to [-20, 20] before exponentiation (ActFirst-OPD App. B.4, as in verl)."""
SEQ_MEAN_EPSILON = 1e-8
"""The epsilon of seq-mean-token-mean's per-response denominator (ActFirst-OPD App. B.4)."""

_sg = jax.lax.stop_gradient


# --------------------------------------------------------------------------------------------------
# input checks


def _check(where: str, assertion: Callable, *args, **kwargs) -> None:
    """Runs a chex assertion, re-raising its failure as a ValueError that names the function."""
    try:
        assertion(*args, **kwargs)
    except AssertionError as error:
        raise ValueError(f"{where}: {error}") from error


def _check_token_inputs(where: str, float_arrays: Sequence[chex.Array], mask: chex.Array) -> None:
    _check(where, chex.assert_rank, list(float_arrays) + [mask], 2)
    _check(where, chex.assert_equal_shape, list(float_arrays) + [mask])
    _check(where, chex.assert_type, list(float_arrays), float)


def _check_surrogate_config(where: str, clip_eps: float, clip_eps_high: Optional[float],
                            dual_clip: Optional[float], aggregation: str) -> None:
    if not clip_eps > 0:
        raise ValueError(f"{where}: clip_eps must be > 0, got {clip_eps}")
    if clip_eps_high is not None and not clip_eps_high > 0:
        raise ValueError(f"{where}: clip_eps_high must be > 0, got {clip_eps_high}")
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"{where}: dual_clip must be > 1 (or None to disable), got {dual_clip}")
    if aggregation not in AGGREGATION_MODES:
        raise ValueError(f"{where}: aggregation must be one of {AGGREGATION_MODES}, got {aggregation!r}")


def _as_float(x: chex.Array) -> jax.Array:
    return jnp.asarray(x).astype(jnp.float32)


def _masked_mean(values: chex.Array, mask: chex.Array) -> jax.Array:
    """Mean of ``values`` over ``mask``; 0 when the mask is empty."""
    return jnp.sum(jnp.where(mask > 0, values, 0.0) * mask) / jnp.maximum(jnp.sum(mask), 1.0)


# --------------------------------------------------------------------------------------------------
# shared clipped surrogate


class SurrogateTokenTerms(NamedTuple):
    """Per-token pieces of the dual-clipped surrogate, all ``[batch, length]``."""
    loss: jax.Array  # the minimised token loss l_DC
    ratio: jax.Array  # exp(clip(logp - behavior_logp, -20, 20))
    clipped: jax.Array  # bool: the PPO clip branch is the active one
    dual_clipped: jax.Array  # bool: the dual-clip cap -kappa * A is the active one (A < 0 only)


def clipped_surrogate_token_loss(logp: chex.Array, behavior_logp: chex.Array, advantages: chex.Array,
                                 *, clip_eps: float = 0.2, clip_eps_high: Optional[float] = None,
                                 dual_clip: Optional[float] = 3.0) -> SurrogateTokenTerms:
    """Token loss of the PPO clipped surrogate with dual clipping (Schulman et al. 2017; Ye et al. 2020).

    ratio r = exp(clip(logp - behavior_logp, -20, 20)); with the clipped ratio c(r) = clip(r, 1-δ, 1+δ_high):

      l = max(-A r, -A c(r))                 for A >= 0
      l = min(max(-A r, -A c(r)), -κ A)      for A < 0     (dual clip, verl's ``clip_ratio_c``)

    This is ActFirst-OPD App. B.4's l_DC and ActionOPD Eq. 9 / Eq. 17 (negated: those maximise h_dual).
    ``dual_clip=None`` disables the cap. Gradients flow only through ``logp``; ``advantages`` and
    ``behavior_logp`` are treated as constants.
    """
    where = "clipped_surrogate_token_loss"
    _check(where, chex.assert_equal_shape, [logp, behavior_logp, advantages])
    _check(where, chex.assert_type, [logp, behavior_logp, advantages], float)
    high = clip_eps if clip_eps_high is None else clip_eps_high
    if not clip_eps > 0 or not high > 0:
        raise ValueError(f"{where}: clip widths must be > 0, got clip_eps={clip_eps}, clip_eps_high={clip_eps_high}")
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"{where}: dual_clip must be > 1 (or None to disable), got {dual_clip}")
    advantages = _sg(_as_float(advantages))
    log_ratio = jnp.clip(_as_float(logp) - _sg(_as_float(behavior_logp)), -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    ratio = jnp.exp(log_ratio)
    unclipped_loss = -advantages * ratio
    clipped_loss = -advantages * jnp.clip(ratio, 1.0 - clip_eps, 1.0 + high)
    ppo_loss = jnp.maximum(unclipped_loss, clipped_loss)
    clipped = clipped_loss > unclipped_loss
    if dual_clip is None:
        return SurrogateTokenTerms(ppo_loss, ratio, clipped, jnp.zeros_like(clipped))
    cap = -dual_clip * advantages
    negative = advantages < 0
    loss = jnp.where(negative, jnp.minimum(ppo_loss, cap), ppo_loss)
    dual_clipped = negative & (ppo_loss > cap)
    return SurrogateTokenTerms(loss, ratio, clipped & ~dual_clipped, dual_clipped)


def aggregate_token_loss(token_loss: chex.Array, mask: chex.Array, aggregation: str) -> jax.Array:
    """Reduces ``[batch, length]`` token losses over the supervised tokens ``mask`` to a scalar.

    - ``token-mean``: sum over all supervised tokens / their number (ActionOPD's active-token mean,
      STI-OPD Eq. 11's 1/N_tok).
    - ``seq-mean-token-mean``: each response's sum / (its supervised-token count + 1e-8), then the mean
      over responses (ActFirst-OPD App. B.4).
    - ``seq-mean-token-sum``: each response's sum, then the mean over responses.

    ``mask`` may hold non-negative weights instead of 0/1 (``sft_loss``'s ``token_weight``): each mode is then the
    same reduction with weighted sums and weight totals in place of token counts (token-mean: sum(w·l) / sum(w)).

    A row with no supervised token is padding, not a response: it adds 0 and is not counted among the
    responses, so padding a batch to a fixed shape leaves the loss unchanged (verl excludes fully masked
    sequences the same way). An all-empty batch gives 0.
    """
    where = "aggregate_token_loss"
    _check(where, chex.assert_rank, [token_loss, mask], 2)
    _check(where, chex.assert_equal_shape, [token_loss, mask])
    if aggregation not in AGGREGATION_MODES:
        raise ValueError(f"{where}: aggregation must be one of {AGGREGATION_MODES}, got {aggregation!r}")
    mask = _as_float(mask)
    token_loss = jnp.where(mask > 0, token_loss, 0.0) * mask
    if aggregation == "token-mean":
        total = jnp.sum(mask)
        return jnp.where(total > 0, jnp.sum(token_loss) / jnp.where(total > 0, total, 1.0), 0.0)
    tokens_per_response = jnp.sum(mask, axis=-1)
    response_loss = jnp.sum(token_loss, axis=-1)
    if aggregation == "seq-mean-token-mean":
        response_loss = response_loss / (tokens_per_response + SEQ_MEAN_EPSILON)
    is_response = (tokens_per_response > 0).astype(jnp.float32)
    return jnp.sum(response_loss * is_response) / jnp.maximum(jnp.sum(is_response), 1.0)


def clipped_surrogate_loss(logp: chex.Array, behavior_logp: chex.Array, advantages: chex.Array,
                           mask: chex.Array, *, clip_eps: float = 0.2, clip_eps_high: Optional[float] = None,
                           dual_clip: Optional[float] = 3.0, aggregation: str = "token-mean"
                           ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The shared dual-clipped PPO surrogate, aggregated over supervised tokens.

    Args:
      logp: ``[B, L]`` log π_θ of the sampled tokens (differentiated).
      behavior_logp: ``[B, L]`` log-probs of the policy that produced the tokens (constant).
      advantages: ``[B, L]`` token advantages (constant).
      mask: ``[B, L]`` 1 for supervised tokens, 0 elsewhere (bool, int or float).
      clip_eps, clip_eps_high: PPO clip width δ (and an optional different upper width).
      dual_clip: κ of the dual clip, or None.
      aggregation: one of ``AGGREGATION_MODES``.

    Returns:
      ``(loss, metrics)``; metrics are token means over supervised tokens: ``clip_fraction``,
      ``dual_clip_fraction``, ``ratio_mean``, ``ratio_max``, ``approx_kl`` (mean of behavior_logp - logp),
      ``advantage_mean``, and ``supervised_tokens``.
    """
    where = "clipped_surrogate_loss"
    _check_token_inputs(where, [logp, behavior_logp, advantages], mask)
    _check_surrogate_config(where, clip_eps, clip_eps_high, dual_clip, aggregation)
    terms = clipped_surrogate_token_loss(logp, behavior_logp, advantages, clip_eps=clip_eps,
                                         clip_eps_high=clip_eps_high, dual_clip=dual_clip)
    loss = aggregate_token_loss(terms.loss, mask, aggregation)
    mask = _as_float(mask)
    ratio = _sg(terms.ratio)
    metrics = {
        "clip_fraction": _masked_mean(terms.clipped.astype(jnp.float32), mask),
        "dual_clip_fraction": _masked_mean(terms.dual_clipped.astype(jnp.float32), mask),
        "ratio_mean": _masked_mean(ratio, mask),
        "ratio_max": jnp.max(jnp.where(mask > 0, ratio, 0.0)),  # ratios are > 0; 0 if no token
        "approx_kl": _masked_mean(_sg(_as_float(behavior_logp) - _as_float(logp)), mask),
        "advantage_mean": _masked_mean(_as_float(advantages), mask),
        "supervised_tokens": jnp.sum(mask),
    }
    return loss, metrics


# --------------------------------------------------------------------------------------------------
# ActFirst-OPD / vanilla OPD


def opd_token_advantages(logp: chex.Array, teacher_logp: chex.Array, mask: chex.Array,
                         kl_coef: float = 1.0) -> jax.Array:
    """Sampled reverse-KL token advantage A = -β (sg(log π_θ) - log π_T), 0 at masked positions.

    ActFirst-OPD App. B.4 (β = 1); its expectation under student sampling is -KL(π_θ || π_T) (Eq. 4).
    """
    where = "opd_token_advantages"
    _check_token_inputs(where, [logp, teacher_logp], mask)
    advantages = -kl_coef * (_sg(_as_float(logp)) - _as_float(teacher_logp))
    return jnp.where(_as_float(mask) > 0, advantages, 0.0)


def _check_advantage_logp(where: str, advantage_logp: str) -> None:
    if advantage_logp not in ADVANTAGE_LOGP:
        raise ValueError(f"{where}: advantage_logp must be one of {ADVANTAGE_LOGP}, got {advantage_logp!r}")


def opd_loss(logp: chex.Array, behavior_logp: chex.Array, teacher_logp: chex.Array, mask: chex.Array,
             *, kl_coef: float = 1.0, clip_eps: float = 0.2, dual_clip: Optional[float] = 3.0,
             aggregation: str = "seq-mean-token-mean", advantage_logp: str = "current"
             ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """ActFirst-OPD / vanilla multi-turn OPD loss (ActFirst-OPD Sec. 3 Eq. 4 and App. B.4).

    The advantage A = -β(sg(log π_θ) - log π_T) (β = 1) enters the dual-clipped surrogate with ratio
    π_θ / π_θold,b (behaviour = stored sampling log-probs), δ = 0.2, κ = 3, seq-mean-token-mean.
    ``advantage_logp="sampled"`` takes A = -β(log π_θold,b - log π_T) from the stored sampling log-probs instead
    (Trinity-RFT's; ``ADVANTAGE_LOGP``).

    Args:
      logp: ``[B, L]`` log π_θ of the response tokens under the current parameters (differentiated).
      behavior_logp: ``[B, L]`` the rollout student's sampling log-probs.
      teacher_logp: ``[B, L]`` the frozen teacher's log-probs of the same tokens in the same contexts.
      mask: ``[B, L]`` 1 on model-generated response tokens; 0 on inserted tokens, prompts and padding
        (excluded from the loss and its normalisation).

    Returns:
      ``(loss, metrics)``: the surrogate's metrics plus ``sampled_reverse_kl`` (token mean of
      log π_θ - log π_T, an estimate of the reverse KL under student sampling).
    """
    _check_advantage_logp("opd_loss", advantage_logp)
    advantage_source = logp if advantage_logp == "current" else behavior_logp
    advantages = opd_token_advantages(advantage_source, teacher_logp, mask, kl_coef)
    loss, metrics = clipped_surrogate_loss(logp, behavior_logp, advantages, mask, clip_eps=clip_eps,
                                           dual_clip=dual_clip, aggregation=aggregation)
    metrics["sampled_reverse_kl"] = _masked_mean(_sg(_as_float(logp)) - _as_float(teacher_logp), _as_float(mask))
    return loss, metrics


def reverse_kl_from_log_probs(student_log_probs: chex.Array, teacher_log_probs: chex.Array) -> jax.Array:
    """Exact per-context reverse KL Σ_v π_θ(v) (log π_θ(v) - log π_T(v)) from normalised log-probabilities over
    the last (vocabulary) axis (differentiable in both inputs)."""
    _check("reverse_kl_from_log_probs", chex.assert_equal_shape, [student_log_probs, teacher_log_probs])
    student_log_probs, teacher_log_probs = _as_float(student_log_probs), _as_float(teacher_log_probs)
    student_probs = jnp.exp(student_log_probs)
    # 0 * log 0 = 0: vocabulary entries the student rules out (logit -inf) contribute nothing.
    terms = jnp.where(student_probs > 0, student_probs * (student_log_probs - teacher_log_probs), 0.0)
    return jnp.sum(terms, axis=-1)


def reverse_kl_from_logits(student_logits: chex.Array, teacher_logits: chex.Array) -> jax.Array:
    """Exact per-context reverse KL Σ_v π_θ(v) (log π_θ(v) - log π_T(v)) over the last (vocabulary) axis.

    ActFirst-OPD Eq. 4 / STI-OPD Eq. 2 evaluated over the full vocabulary (differentiable in both inputs).
    """
    _check("reverse_kl_from_logits", chex.assert_equal_shape, [student_logits, teacher_logits])
    return reverse_kl_from_log_probs(jax.nn.log_softmax(_as_float(student_logits), axis=-1),
                                     jax.nn.log_softmax(_as_float(teacher_logits), axis=-1))


_OUTSIDE = -1e30
"""The finite stand-in for log 0 that :func:`log_mass_outside` gives a vocabulary entry it leaves out (a true
-inf would make the gradient of an empty logsumexp NaN)."""


def log_mass_outside(log_probs: chex.Array, ids: chex.Array) -> jax.Array:
    """log Σ_{v ∉ ids} exp(log_probs[..., v]): the log of the probability left outside ``ids`` ``[..., K]`` (each
    row's K distinct ids) by the normalised ``log_probs`` ``[..., V]``, taken as a logsumexp over the other
    entries, not as log(1 - Σ_{v ∈ ids} p_v), which cancels to log 0 in float32 when the K carry nearly all of it.
    About -1e30 (probability 0) where ``ids`` cover the vocabulary. Differentiable in ``log_probs``."""
    log_probs = _as_float(log_probs)
    vocab, k = log_probs.shape[-1], ids.shape[-1]
    flat = log_probs.reshape(-1, vocab)
    rows = jnp.arange(flat.shape[0])[:, None]
    inside = jnp.zeros(flat.shape, bool).at[rows, jnp.asarray(ids).reshape(-1, k)].set(True)
    return jax.nn.logsumexp(jnp.where(inside, _OUTSIDE, flat), axis=-1).reshape(log_probs.shape[:-1])


def top_k_with_rest(log_probs: chex.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """A distribution's K most probable entries and the rest, as one coarse distribution over K + 1 outcomes.

    ``log_probs`` ``[..., V]`` (normalised) gives ``(values [..., K + 1], ids [..., K])``: the K largest
    log-probabilities with their ids, then the log of the probability of all other V - K entries together
    (:func:`log_mass_outside`). What a teacher sends for :func:`top_k_reverse_kl` instead of its ``[..., V]``."""
    if not 1 <= k < log_probs.shape[-1]:
        raise ValueError(f"top_k_with_rest: k must be in [1, {log_probs.shape[-1]}) for a vocabulary of "
                         f"{log_probs.shape[-1]} ids, got {k} (for all of them take the whole log-softmax)")
    values, ids = jax.lax.top_k(_as_float(log_probs), k)
    rest = log_mass_outside(log_probs, ids)
    return jnp.concatenate([values, rest[..., None]], axis=-1), ids


def top_k_reverse_kl(student_log_probs: chex.Array, teacher_values: chex.Array, teacher_ids: chex.Array
                     ) -> jax.Array:
    """The reverse KL of the two policies coarse-grained onto the teacher's top K ids and one outcome "any other id".

    ``student_log_probs`` ``[..., V]`` (normalised, differentiated); ``teacher_values`` ``[..., K + 1]`` and
    ``teacher_ids`` ``[..., K]`` as :func:`top_k_with_rest` gives them. Per context
    Σ_{k ≤ K} π_θ(v_k)(log π_θ(v_k) - log π_T(v_k)) + π_θ(rest)(log π_θ(rest) - log π_T(rest)): a lower bound of the
    exact reverse KL (merging outcomes never raises a KL), equal to it when the ids outside the top K carry no
    probability under either policy. Student mass on ids the teacher ranks outside its top K is charged as a whole
    against the teacher's remaining mass. The teacher's side is a constant."""
    student_log_probs = _as_float(student_log_probs)
    top = jnp.take_along_axis(student_log_probs, jnp.asarray(teacher_ids), axis=-1)
    rest = log_mass_outside(student_log_probs, teacher_ids)
    student = jnp.concatenate([top, rest[..., None]], axis=-1)
    return reverse_kl_from_log_probs(student, _sg(_as_float(teacher_values)))


def exact_opd_loss(student_log_probs: chex.Array, teacher_log_probs: chex.Array, mask: chex.Array, *,
                   teacher_ids: Optional[chex.Array] = None, targets: Optional[chex.Array] = None,
                   teacher_target_log_probs: Optional[chex.Array] = None, aggregation: str = "seq-mean-token-mean"
                   ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """OPD with the reverse KL of each sampled state computed over the whole vocabulary instead of sampled.

    The objective of ActFirst-OPD Eq. 4 (KL(π_θ(·|s) || π_T(·|s)) at the states s the student's rollouts
    visited), each state's KL exact rather than estimated from the one sampled token; its gradient is the exact
    per-state gradient, where ``opd_loss``'s dual-clip surrogate of A = -(log π_θ - log π_T) is a one-sample
    policy-gradient estimate of it. This is GKD's on-policy reverse KL (Agarwal et al., 2024, β = 1), not a form
    any of the three papers trained with: an option (``LossConfig.kind = "opd-exact"``), not a method's default.

    Args:
      student_log_probs: ``[B, W, V]`` log π_θ(·|s) at W states per response (differentiated; normalised).
      teacher_log_probs: ``[B, W, V]`` log π_T(·|s) at the same states (constant); with ``teacher_ids``, the
        ``[B, W, K + 1]`` values of :func:`top_k_with_rest` instead.
      mask: ``[B, W]`` 1 where a state is one of the response's supervised positions.
      teacher_ids: optional ``[B, W, K]`` ids of the teacher's top K at each state: each state's KL is then
        :func:`top_k_reverse_kl` (a lower bound of the exact one, for vocabularies too large to carry whole).
      targets: optional ``[B, W]`` ids of the tokens sampled there, for the ``sampled_reverse_kl`` metric; with
        ``teacher_ids`` it also needs ``teacher_target_log_probs`` ``[B, W]``, the teacher's log-probs of them.
      aggregation: one of ``AGGREGATION_MODES`` (vanilla OPD's seq-mean-token-mean by default).

    Returns:
      ``(loss, metrics)``: ``exact_reverse_kl`` (token mean over states; with ``teacher_ids`` the top-K form's),
      ``supervised_tokens``, and with ``targets`` ``sampled_reverse_kl`` (token mean of log π_θ - log π_T at the
      sampled tokens, the quantity ``opd_loss`` reports).
    """
    where = "exact_opd_loss"
    _check(where, chex.assert_rank, [student_log_probs, teacher_log_probs], 3)
    _check(where, chex.assert_rank, mask, 2)
    _check(where, chex.assert_equal_shape_prefix, [student_log_probs, teacher_log_probs, mask], 2)
    if aggregation not in AGGREGATION_MODES:
        raise ValueError(f"{where}: aggregation must be one of {AGGREGATION_MODES}, got {aggregation!r}")
    if teacher_ids is None:
        _check(where, chex.assert_equal_shape, [student_log_probs, teacher_log_probs])
        kl = reverse_kl_from_log_probs(student_log_probs, _sg(_as_float(teacher_log_probs)))
    else:
        if targets is not None and teacher_target_log_probs is None:
            raise ValueError(f"{where}: with top-K teacher values the sampled_reverse_kl metric (targets) needs "
                             "teacher_target_log_probs")
        _check(where, chex.assert_rank, teacher_ids, 3)
        _check(where, chex.assert_equal_shape_prefix, [teacher_ids, mask], 2)
        if teacher_log_probs.shape[-1] != teacher_ids.shape[-1] + 1:
            raise ValueError(f"{where}: top-K teacher values must have K + 1 = {teacher_ids.shape[-1] + 1} entries "
                             f"(the K ids, then the rest), got {teacher_log_probs.shape[-1]}")
        kl = top_k_reverse_kl(student_log_probs, teacher_log_probs, teacher_ids)
    loss = aggregate_token_loss(kl, mask, aggregation)
    mask = _as_float(mask)
    metrics = {"exact_reverse_kl": _masked_mean(_sg(kl), mask), "supervised_tokens": jnp.sum(mask)}
    if targets is not None:
        _check(where, chex.assert_equal_shape, [targets, mask])
        index = jnp.asarray(targets)[..., None]
        if teacher_target_log_probs is None:
            teacher_target_log_probs = jnp.take_along_axis(_as_float(teacher_log_probs), index, axis=-1)[..., 0]
        log_ratio = (jnp.take_along_axis(_as_float(student_log_probs), index, axis=-1)[..., 0]
                     - _as_float(teacher_target_log_probs))
        metrics["sampled_reverse_kl"] = _masked_mean(_sg(log_ratio), mask)
    return loss, metrics


# --------------------------------------------------------------------------------------------------
# STI-OPD


def sti_turn_discrepancy(student_logp: chex.Array, teacher_logp: chex.Array, mask: chex.Array) -> jax.Array:
    """STI-OPD turn score s_t = mean_k (r - 1 - log r), r = π_T / π_student on the proposal (Eq. 5-7).

    The k3 estimator is >= 0 and zero exactly where the two log-probs agree. Log-ratios are clipped to
    [-20, 20] before exponentiation. Returns ``[B]``; a row without tokens scores 0.
    """
    where = "sti_turn_discrepancy"
    _check_token_inputs(where, [student_logp, teacher_logp], mask)
    mask = _as_float(mask)
    log_r = jnp.clip(_as_float(teacher_logp) - _as_float(student_logp), -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    k3 = jnp.expm1(log_r) - log_r
    k3 = jnp.where(mask > 0, k3, 0.0)
    return jnp.sum(k3 * mask, axis=-1) / jnp.maximum(jnp.sum(mask, axis=-1), 1.0)


def sti_intervention_probability(turn_score: chex.Array) -> jax.Array:
    """Intervention probability α = s / (1 + s) (STI-OPD Eq. 8); the intervention odds equal s."""
    score = _as_float(turn_score)
    return score / (1.0 + score)


def _broadcast_turn_flag(where: str, flag: chex.Array, mask: chex.Array) -> jax.Array:
    flag = jnp.asarray(flag)
    if flag.ndim == 1:
        _check(where, chex.assert_axis_dimension, mask, 0, flag.shape[0])
        flag = jnp.broadcast_to(flag[:, None], mask.shape)
    _check(where, chex.assert_equal_shape, [flag, mask])
    return flag.astype(bool)


def sti_importance_weighted_reverse_kl(logp: chex.Array, teacher_logp: chex.Array,
                                       teacher_generated: chex.Array, mask: chex.Array,
                                       *, aggregation: str = "token-mean"
                                       ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """STI-OPD's exact importance-weighted reverse-KL objective (Eq. 9-11, Algorithm 1 lines 37-40).

    With ℓ = log π_θ - log π_T and ω = π_θ / π_T (Eq. 9): student tokens contribute ℓ, teacher tokens
    ω ℓ, averaged over all tokens (1/N_tok with the default token-mean). The returned value is exactly
    Eq. 11. Its gradient is the unbiased gradient of the reverse KL for both branches:

    - teacher tokens are drawn from π_T, which does not depend on θ, so ω ℓ is differentiated as is
      (E_{x~π_T}[∇(ω ℓ)] = ∇ KL(π_θ || π_T) by Eq. 10);
    - student tokens are drawn from π_θ itself, so the score-function term sg(ℓ)(log π_θ - sg(log π_θ))
      (value 0, gradient ℓ ∇log π_θ) is added; differentiating ℓ alone has zero expected gradient.

    Args:
      logp: ``[B, L]`` log π_θ of the executed tokens (differentiated).
      teacher_logp: ``[B, L]`` log π_T of the same tokens.
      teacher_generated: ``[B]`` (per turn) or ``[B, L]`` bool, True where the teacher generated the token.
      mask: ``[B, L]`` supervised tokens.
    """
    where = "sti_importance_weighted_reverse_kl"
    _check_token_inputs(where, [logp, teacher_logp], mask)
    if aggregation not in AGGREGATION_MODES:
        raise ValueError(f"{where}: aggregation must be one of {AGGREGATION_MODES}, got {aggregation!r}")
    teacher_token = _broadcast_turn_flag(where, teacher_generated, mask)
    logp = _as_float(logp)
    log_ratio = logp - _as_float(teacher_logp)
    importance_weight = jnp.exp(jnp.clip(log_ratio, -LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    student_term = log_ratio + _sg(log_ratio) * (logp - _sg(logp))
    teacher_term = importance_weight * log_ratio
    token_loss = jnp.where(teacher_token, teacher_term, student_term)
    loss = aggregate_token_loss(token_loss, mask, aggregation)
    mask = _as_float(mask)
    teacher_mask = mask * teacher_token
    metrics = {
        "teacher_token_fraction": _masked_mean(teacher_token.astype(jnp.float32), mask),
        "importance_weight_mean": _masked_mean(_sg(importance_weight), teacher_mask),
        "supervised_tokens": jnp.sum(mask),
    }
    return loss, metrics


def sti_behavior_logp(rollout_logp: chex.Array, teacher_logp: chex.Array,
                      teacher_generated: chex.Array) -> jax.Array:
    """Behaviour log-probs of a mixed STI trajectory: the teacher's on teacher tokens, else the rollout student's."""
    where = "sti_behavior_logp"
    _check(where, chex.assert_equal_shape, [rollout_logp, teacher_logp])
    teacher_token = _broadcast_turn_flag(where, teacher_generated, rollout_logp)
    return jnp.where(teacher_token, _as_float(teacher_logp), _as_float(rollout_logp))


def sti_opd_loss(logp: chex.Array, rollout_logp: chex.Array, teacher_logp: chex.Array,
                 teacher_generated: chex.Array, mask: chex.Array, *, clip_eps: float = 0.2,
                 dual_clip: Optional[float] = 3.0, aggregation: str = "token-mean", advantage_logp: str = "current"
                 ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """STI-OPD's practical PPO form (App. B.3): -ℓ as the reward/advantage in the clipped surrogate.

    The advantage is A = -(sg(log π_θ) - log π_T) on every supervised token; the behaviour policy is the
    teacher on teacher tokens (so their ratio is ω = π_θ / π_T of Eq. 11) and the rollout student on
    student tokens. The paper gives no clip values; the defaults are those of the PPO loss of
    Trinity-RFT, which the paper trains with (δ = 0.2, dual clip κ = 3, token-mean, matching Eq. 11's
    1/N_tok).

    On a teacher token A = -log ω, so the advantage always pushes ω back towards 1 and the δ clip never
    binds there: the clipping of ω is the dual clip, which zeroes the gradient of tokens with ω > κ. With
    ``dual_clip=None`` the teacher-token gradient equals Eq. 11's in expectation; on-policy student
    tokens (ratio 1) likewise.

    ``advantage_logp="sampled"`` (Trinity-RFT's form, ``ADVANTAGE_LOGP``) reads the student's stored sampling
    log-prob on student tokens, A = -(log π_θ̄ - log π_T); a teacher token has no student sampling log-prob (the
    student never sampled it: its stored behaviour log-prob is the teacher's, which would make A = 0), so it keeps
    the current one, sg(log π_θ).

    Args:
      logp: ``[B, L]`` log π_θ (differentiated).
      rollout_logp: ``[B, L]`` the rollout student's sampling log-probs (used on student tokens).
      teacher_logp: ``[B, L]`` log π_T of the executed tokens.
      teacher_generated: ``[B]`` or ``[B, L]`` bool, True where the teacher generated the token.
      mask: ``[B, L]`` supervised tokens.
    """
    where = "sti_opd_loss"
    _check_token_inputs(where, [logp, rollout_logp, teacher_logp], mask)
    _check_advantage_logp(where, advantage_logp)
    behavior_logp = sti_behavior_logp(rollout_logp, teacher_logp, teacher_generated)
    teacher_token = _broadcast_turn_flag(where, teacher_generated, mask)
    advantage_source = logp
    if advantage_logp == "sampled":
        advantage_source = jnp.where(teacher_token, _sg(_as_float(logp)), _as_float(rollout_logp))
    advantages = opd_token_advantages(advantage_source, teacher_logp, mask)
    loss, metrics = clipped_surrogate_loss(logp, behavior_logp, advantages, mask, clip_eps=clip_eps,
                                           dual_clip=dual_clip, aggregation=aggregation)
    mask = _as_float(mask)
    metrics["teacher_token_fraction"] = _masked_mean(teacher_token.astype(jnp.float32), mask)
    metrics["sampled_reverse_kl"] = _masked_mean(_sg(_as_float(logp)) - _as_float(teacher_logp), mask)
    return loss, metrics


# --------------------------------------------------------------------------------------------------
# ActionOPD


def action_agreement_reward(match_count: chex.Array, valid: chex.Array, num_teacher_samples: int,
                            match_bonus_scale: float = 0.5) -> jax.Array:
    """Action-agreement reward r_λ (ActionOPD Eq. 6), elementwise.

    -1 for an invalid action; 0 for a valid action with c = 0 matches; 1 + λ (c - 1)/(K - 1) for c > 0
    (K = 1: 1 for a match). K is the nominal teacher sample count, kept even when fewer samples were
    retained (App. A.3). K=3, λ=0.5, teacher multiset [A, A, B]: A → 1.25, B → 1, other → 0, invalid → -1.
    """
    where = "action_agreement_reward"
    _check(where, chex.assert_equal_shape, [match_count, valid])
    if int(num_teacher_samples) != num_teacher_samples or num_teacher_samples < 1:
        raise ValueError(f"{where}: num_teacher_samples (K) must be a positive integer, got {num_teacher_samples}")
    count = _as_float(match_count)
    bonus = 0.0 if num_teacher_samples == 1 else match_bonus_scale * (count - 1.0) / (num_teacher_samples - 1)
    reward = jnp.where(count > 0, 1.0 + bonus, 0.0)
    return jnp.where(jnp.asarray(valid).astype(bool), reward, -1.0)


class GroupAdvantages(NamedTuple):
    """ActionOPD advantages of state groups, all ``[G, N]`` except ``reward_std``."""
    advantages: jax.Array  # A_{g,i} (Eq. 7); 0 outside retained candidates
    retained: jax.Array  # bool: a real candidate of a retained group (trained on)
    reward_std: jax.Array  # scalar σ, the population std of centred rewards over retained candidates


def action_group_advantages(rewards: chex.Array, candidate_mask: chex.Array,
                            group_supervised: Optional[chex.Array] = None, *, epsilon: float = 1e-8,
                            min_candidates: int = 2, min_reward_range: float = 1e-8) -> GroupAdvantages:
    """Group centering and batch whitening of ActionOPD rewards (Eq. 7, App. A.4).

    A group is retained when it has supervision (a non-empty teacher multiset), at least
    ``min_candidates`` candidates and a reward range (max - min) > ``min_reward_range``. Within a retained
    group every candidate (invalid ones included) is centred on the group mean; the centred rewards are
    divided by σ + ε, σ the population standard deviation of the centred rewards over all retained
    candidates (their mean is 0, so no further subtraction).

    Args:
      rewards: ``[G, N]`` r_λ of each candidate.
      candidate_mask: ``[G, N]`` True for real candidates, False for padding slots.
      group_supervised: ``[G]`` True where the group had at least one teacher sample (default all True).
    """
    where = "action_group_advantages"
    _check(where, chex.assert_rank, [rewards, candidate_mask], 2)
    _check(where, chex.assert_equal_shape, [rewards, candidate_mask])
    _check(where, chex.assert_type, rewards, float)
    rewards = _as_float(rewards)
    candidates = jnp.asarray(candidate_mask).astype(bool)
    group_supervised = (jnp.ones(rewards.shape[:1], dtype=bool) if group_supervised is None
                        else jnp.asarray(group_supervised).astype(bool))
    _check(where, chex.assert_shape, group_supervised, rewards.shape[:1])
    count = jnp.sum(candidates, axis=-1)
    highest = jnp.max(jnp.where(candidates, rewards, -jnp.inf), axis=-1)
    lowest = jnp.min(jnp.where(candidates, rewards, jnp.inf), axis=-1)
    retained_group = (group_supervised & (count >= min_candidates)
                      & (highest - lowest > min_reward_range))
    retained = candidates & retained_group[:, None]
    weights = retained.astype(jnp.float32)
    group_mean = jnp.sum(jnp.where(retained, rewards, 0.0), axis=-1, keepdims=True) / jnp.maximum(
        jnp.sum(weights, axis=-1, keepdims=True), 1.0)
    centred = jnp.where(retained, rewards - group_mean, 0.0)
    reward_std = jnp.sqrt(jnp.sum(centred**2) / jnp.maximum(jnp.sum(weights), 1.0))
    return GroupAdvantages(centred / (reward_std + epsilon), retained, reward_std)


def actionopd_loss(logp: chex.Array, behavior_logp: chex.Array, response_advantages: chex.Array,
                   response_retained: chex.Array, mask: chex.Array, *, clip_eps: float = 0.2,
                   dual_clip: Optional[float] = 3.0) -> tuple[jax.Array, dict[str, jax.Array]]:
    """ActionOPD's clipped objective (Eq. 8-9 with the dual clip of Eq. 17), minimised as its negation.

    Each response's advantage A_{g,i} weights all its active generated tokens; the loss is the mean over
    active tokens of retained groups (rows with ``response_retained`` False add nothing, not even to the
    normalisation). η = 0.2, c_dual = 3.

    Args:
      logp: ``[B, L]`` log π_θ of the candidate tokens (differentiated).
      behavior_logp: ``[B, L]`` log π_θold from the rollout.
      response_advantages: ``[B]`` A_{g,i} (``action_group_advantages(...).advantages`` flattened).
      response_retained: ``[B]`` bool (``action_group_advantages(...).retained`` flattened).
      mask: ``[B, L]`` the student's generated tokens (reasoning included; not prompts or observations).
    """
    where = "actionopd_loss"
    mask = jnp.asarray(mask)
    _check_token_inputs(where, [logp, behavior_logp], mask)
    _check(where, chex.assert_shape, [response_advantages, response_retained], mask.shape[:1])
    _check(where, chex.assert_type, response_advantages, float)
    active = _as_float(mask) * jnp.asarray(response_retained).astype(jnp.float32)[:, None]
    advantages = jnp.broadcast_to(_as_float(response_advantages)[:, None], mask.shape)
    return clipped_surrogate_loss(logp, behavior_logp, advantages, active, clip_eps=clip_eps,
                                  dual_clip=dual_clip, aggregation="token-mean")


# --------------------------------------------------------------------------------------------------
# Supervised fine-tuning


def sft_loss(logp: chex.Array, mask: chex.Array, *, aggregation: str = "token-mean",
             context_logp: chex.Array | None = None, context_mask: chex.Array | None = None,
             context_weight: float = 0.0, token_weight: chex.Array | None = None
             ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Negative log-likelihood of the supervised (demonstration response) tokens, plus an optional language-model
    term on the context (prompt) tokens.

    The token loss is -log π_θ(y_k | context), aggregated over ``mask`` by ``aggregation``
    (``aggregate_token_loss``; the default token-mean is the cross-entropy per supervised token). Its
    gradient w.r.t. the logits of a supervised position is (softmax - onehot(y_k)) / N_tok under
    token-mean (at temperature 1).

    ``token_weight`` (``[B, L]``, >= 0) weights the supervised tokens: the response loss becomes the weighted
    reduction of ``aggregate_token_loss`` with ``mask * token_weight`` (token-mean: sum_k w_k·(-logp_k) / sum_k w_k),
    e.g. the action tokens of a demonstration up-weighted against its thinking.
    All-ones weights give the unweighted loss exactly; the metrics stay unweighted.

    With ``context_weight`` w > 0 the loss is ``response_loss + w * mean_{context_mask}(-context_logp)``: the
    token-mean negative log-likelihood of the prompt tokens (the caller's ``context_logp``, e.g. under a
    softmax restricted to the corpus vocabulary, ``jaxopd.train.step.context_log_probs``). It adds
    supervision of what the prompt repeats (names of the room, the history), not a second target for the answer.

    Args:
      logp: ``[B, L]`` log π_θ of the demonstration tokens (differentiated), taken at temperature 1.
      mask: ``[B, L]`` 1 on the supervised response tokens; 0 on prompts and padding.
      aggregation: one of ``AGGREGATION_MODES``.
      context_logp / context_mask: ``[B, L]`` log-probs of the context tokens and 1 where they count (both
        needed when ``context_weight`` > 0).
      context_weight: w >= 0.
      token_weight: optional ``[B, L]`` non-negative weights of the supervised tokens (None: all 1).

    Returns:
      ``(loss, metrics)``; metrics are token means over supervised tokens: ``nll`` (mean -logp of the response,
      equal to the loss under token-mean without a context term), ``perplexity`` (exp of ``nll``),
      ``token_prob_mean`` (mean π_θ of the demonstration token), and ``supervised_tokens``; with a context
      term also ``context_nll`` and ``context_tokens``.
    """
    where = "sft_loss"
    _check_token_inputs(where, [logp], mask)
    if aggregation not in AGGREGATION_MODES:
        raise ValueError(f"{where}: aggregation must be one of {AGGREGATION_MODES}, got {aggregation!r}")
    if not context_weight >= 0:
        raise ValueError(f"{where}: context_weight must be >= 0, got {context_weight!r}")
    logp = _as_float(logp)
    mask = _as_float(mask)
    weighted = mask
    if token_weight is not None:
        _check_token_inputs(where, [token_weight], mask)
        weighted = mask * _as_float(token_weight)
    loss = aggregate_token_loss(-logp, weighted, aggregation)
    nll = _masked_mean(_sg(-logp), mask)
    metrics = {
        "nll": nll,
        "perplexity": jnp.exp(nll),
        "token_prob_mean": _masked_mean(jnp.exp(_sg(logp)), mask),
        "supervised_tokens": jnp.sum(mask),
    }
    if context_weight > 0:
        if context_logp is None or context_mask is None:
            raise ValueError(f"{where}: context_weight > 0 needs context_logp and context_mask")
        _check_token_inputs(where, [context_logp], context_mask)
        context_mask = _as_float(context_mask)
        context_nll = _masked_mean(-_as_float(context_logp), context_mask)
        loss = loss + context_weight * context_nll
        metrics["context_nll"] = _sg(context_nll)
        metrics["context_tokens"] = jnp.sum(context_mask)
    return loss, metrics


__all__ = [
    "AGGREGATION_MODES", "ADVANTAGE_LOGP", "LOG_RATIO_BOUND", "SEQ_MEAN_EPSILON", "SurrogateTokenTerms",
    "GroupAdvantages",
    "clipped_surrogate_token_loss", "aggregate_token_loss", "clipped_surrogate_loss",
    "opd_token_advantages", "opd_loss", "reverse_kl_from_log_probs", "reverse_kl_from_logits",
    "log_mass_outside", "top_k_with_rest", "top_k_reverse_kl", "exact_opd_loss",
    "sti_turn_discrepancy", "sti_intervention_probability", "sti_importance_weighted_reverse_kl",
    "sti_behavior_logp", "sti_opd_loss",
    "action_agreement_reward", "action_group_advantages", "actionopd_loss",
    "sft_loss",
]
