"""The loss of a batch and the jitted, sharded train step of the student.

Owns ``LossConfig`` (which paper's loss and its constants), the name -> function table of the losses computed from
per-token log-probs (``TOKEN_LOSSES``), the two that need more of the forward pass (``opd-exact``, ``sft`` with its
context term), ``batch_loss`` and ``make_train_step``, the one compiled update on the trainer mesh.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxopd import losses
from jaxopd.models.decoder import CausalLM, dense_causal_attend
from jaxopd.models.lora import LoraConfig, merge
from jaxopd.models.logprobs import ROLLOUT_TEMPERATURE, effective_temperature, token_log_probs
from jaxopd.train.buffer import TrainBatch
from jaxopd.train.logprobs import (context_log_probs, sequence_log_probs, supervised_dense_log_probs,
                                   supervised_from_hidden, supervised_log_probs)
from jaxopd.train.state import TrainState, replicated

Metrics = dict[str, jax.Array]


LOSS_KINDS = ("opd", "opd-exact", "sti-opd", "sti-iw-reverse-kl", "action-opd", "sft")
"""``opd``: ActFirst-OPD / vanilla OPD (dual-clip surrogate of the sampled reverse KL); ``opd-exact``: OPD with
each sampled state's reverse KL computed over the whole vocabulary (``losses.exact_opd_loss``; the teacher's
log-softmax at the supervised positions travels in ``TrainBatch.teacher_dense_logp``; needs
``max_supervised_tokens``; with ``LossConfig.exact_top_k`` only the teacher's top K and the rest travel, and the KL
is ``losses.top_k_reverse_kl``'s);
``sti-opd``: STI-OPD's practical PPO form; ``sti-iw-reverse-kl``: STI-OPD's exact importance-weighted
reverse KL (Eq. 11); ``action-opd``: ActionOPD's clipped objective with response advantages; ``sft``:
supervised fine-tuning, the negative log-likelihood of demonstration responses (training a teacher on
walkthroughs, ``jaxopd.methods.sft_data``)."""

ADVANTAGE_KINDS = ("opd", "sti-opd")
"""The losses whose advantage is the sampled reverse KL, and so read ``LossConfig.advantage_logp``."""

_DEFAULT_AGGREGATION = {"opd": "seq-mean-token-mean", "opd-exact": "seq-mean-token-mean", "sti-opd": "token-mean",
                        "sti-iw-reverse-kl": "token-mean", "action-opd": "token-mean", "sft": "token-mean"}


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Which loss a batch trains and its constants (defaults: each paper's).

    ``aggregation=None`` takes the method's own (ActFirst-OPD seq-mean-token-mean; STI-OPD and ActionOPD
    token-mean; ActionOPD's is fixed). ``temperature`` divides the student logits before the log-softmax
    (``jaxopd.models.logprobs.tempered_log_softmax``, the function the sampler reports behaviour
    log-probabilities with); it is the rollout's sampling temperature by construction when the config is built
    with ``LossConfig.for_rollout(sampling_params, ...)``, and defaults to ``ROLLOUT_TEMPERATURE``, the
    default of ``SamplingParams.temperature``. ``logits_chunk_size`` computes the vocabulary
    projection in chunks of that many positions, rematerialised in the backward pass, so that
    ``[B, T, V]`` logits never exist at once (None: in one piece). ``max_supervised_tokens`` projects only
    the positions that predict supervised tokens (at most that many per row, see
    :func:`supervised_log_probs`): the loss is the same, the vocabulary projection shrinks from every position
    to the responses (a turn-level sample is mostly prompt). A batch with a row of more supervised tokens is a
    ``ValueError`` (:func:`check_supervised_fit`).

    ``context_lm_weight`` (``sft`` only) adds a language-model term on the prompt tokens, weighted by it, under
    the softmax restricted to ``context_vocab`` (sorted token ids, e.g. every id of the SFT corpus; see
    :func:`context_log_probs`): many times the response's supervision from the same forward pass.

    ``exact_top_k`` (``opd-exact`` only; None: the whole vocabulary) carries the teacher's top K ids and the mass of
    the rest instead of its whole log-softmax, and trains :func:`jaxopd.losses.top_k_reverse_kl`, a lower bound of
    each state's KL: B·W·(2K + 1) numbers a batch instead of B·W·V (Qwen3's 151,936 ids: 1.2 GB at 16 × 128).

    ``remat_layers`` runs the student's layers as a scan of rematerialised bodies
    (``CausalLM.hidden_states(remat=True)``): the same loss and gradient, about one more forward pass of compute,
    and the gradient's memory no longer holds every layer's activations (XLA CPU, SmolLM2's 15-layer cut, 4 rows of
    1,152 tokens: 13.4 GB of temporaries to 1.3 GB).

    ``advantage_logp`` (``opd`` and ``sti-opd``; ``jaxopd.losses.ADVANTAGE_LOGP``): which student log-prob the
    reverse-KL advantage A = -(log π_θ - log π_T) reads. The default, ``"current"``, is the forward pass being
    differentiated (under stop-gradient), as ActFirst-OPD App. B.4 and STI-OPD App. B.3 write the advantage: with the
    ratio π_θ / π_θold correcting the sampling, the expected gradient is then exactly the reverse KL's at the current
    parameters, also for a sample one version old (the lag the buffer allows), and the advantage carries no mismatch
    between the sampler's arithmetic (paged attention, its own kernels and precision) and the trainer's: a student
    equal to its teacher gets A = 0 exactly. ``"sampled"`` is Trinity-RFT's form, which ActFirst-OPD and STI-OPD
    trained with: A from the rollout's stored sampling log-probs (fixed before the update; on a lag-0 sample the two
    differ by the sampler-trainer mismatch only, on a lag-1 sample by one update). On STI's teacher tokens the
    student has no sampling log-prob, so ``"sampled"`` keeps the current one there (``losses.sti_opd_loss``). Every
    preset, ``paper`` included, uses ``"current"``; ``RunConfig.departures`` records it against Trinity-RFT.

    ``kind="sft"`` trains on the likelihood of the demonstration itself, not on sampled tokens: an SFT
    config should use ``temperature=1.0`` (the default), so that the model learns the plain softmax it
    later samples from; the temperature is applied like for every other kind if set otherwise. The
    clipping fields and ``kl_coef`` do not apply to it, and it needs no teacher log-probabilities.
    """

    kind: str = "opd"
    clip_eps: float = 0.2
    dual_clip: float | None = 3.0
    aggregation: str | None = None
    kl_coef: float = 1.0
    temperature: float = ROLLOUT_TEMPERATURE
    logits_chunk_size: int | None = None
    max_supervised_tokens: int | None = None
    context_lm_weight: float = 0.0
    context_vocab: tuple[int, ...] | None = None
    exact_top_k: int | None = None
    advantage_logp: str = "current"
    remat_layers: bool = False

    def __post_init__(self):
        if self.kind not in LOSS_KINDS:
            raise ValueError(f"LossConfig.kind must be one of {LOSS_KINDS}, got {self.kind!r}")
        if self.advantage_logp not in losses.ADVANTAGE_LOGP:
            raise ValueError(f"LossConfig.advantage_logp must be one of {losses.ADVANTAGE_LOGP}, got "
                             f"{self.advantage_logp!r}")
        if self.advantage_logp != "current" and self.kind not in ADVANTAGE_KINDS:
            raise ValueError(f"LossConfig.advantage_logp {self.advantage_logp!r} chooses the log-prob of the "
                             f"reverse-KL advantage of {ADVANTAGE_KINDS}; the {self.kind!r} loss has none")
        if self.aggregation is not None and self.aggregation not in losses.AGGREGATION_MODES:
            raise ValueError(f"LossConfig.aggregation must be one of {losses.AGGREGATION_MODES} or None, "
                             f"got {self.aggregation!r}")
        if self.kind == "opd-exact" and self.max_supervised_tokens is None:
            raise ValueError("LossConfig.kind 'opd-exact' needs max_supervised_tokens: the teacher's log-softmax is "
                             "carried at each row's first max_supervised_tokens supervised positions")
        if self.exact_top_k is not None:
            if self.kind != "opd-exact":
                raise ValueError(f"LossConfig.exact_top_k sizes the opd-exact loss's teacher distribution; the "
                                 f"{self.kind!r} loss reads none")
            if isinstance(self.exact_top_k, bool) or not isinstance(self.exact_top_k, int) or self.exact_top_k < 1:
                raise ValueError(f"LossConfig.exact_top_k must be a positive int or None, got {self.exact_top_k!r}")
        if self.kind == "action-opd" and self.aggregation not in (None, "token-mean"):
            raise ValueError("ActionOPD aggregates by the active-token mean; aggregation must be None or 'token-mean'")
        if not self.temperature > 0:
            raise ValueError(f"LossConfig.temperature must be > 0, got {self.temperature}")
        if self.logits_chunk_size is not None and self.logits_chunk_size < 1:
            raise ValueError(f"LossConfig.logits_chunk_size must be positive or None, got {self.logits_chunk_size}")
        if self.max_supervised_tokens is not None and self.max_supervised_tokens < 1:
            raise ValueError(f"LossConfig.max_supervised_tokens must be positive or None, got "
                             f"{self.max_supervised_tokens}")
        if not self.context_lm_weight >= 0:
            raise ValueError(f"LossConfig.context_lm_weight must be >= 0, got {self.context_lm_weight!r}")
        if self.context_lm_weight > 0:
            if self.kind != "sft":
                raise ValueError(f"LossConfig.context_lm_weight applies to the sft loss only, not {self.kind!r}")
            vocab = self.context_vocab
            if not vocab or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in vocab):
                raise ValueError("LossConfig.context_lm_weight > 0 needs context_vocab: a non-empty tuple of "
                                 "token ids")
            if list(vocab) != sorted(set(vocab)):
                raise ValueError("LossConfig.context_vocab must be sorted and hold each token id once")

    @classmethod
    def for_rollout(cls, *sampling: Any, **fields: Any) -> "LossConfig":
        """The config whose learner log-probabilities are taken at the rollouts' own temperature.

        ``sampling``: the ``SamplingParams`` (anything with a ``temperature``) of every kind of request whose
        tokens are trained on (e.g. ActFirst's fast and full requests); they must agree. Greedy rollouts
        (temperature 0) report plain log-softmax log-probabilities, so they train at temperature 1.
        ``fields``: the other ``LossConfig`` fields (not ``temperature``).
        """
        if not sampling:
            raise TypeError("LossConfig.for_rollout needs the rollout's sampling params")
        if "temperature" in fields:
            raise TypeError("LossConfig.for_rollout takes the temperature from the rollout's sampling params")
        temperatures = {effective_temperature(float(params.temperature)) for params in sampling}
        if len(temperatures) != 1:
            raise ValueError(f"rollout requests sample at different temperatures {sorted(temperatures)}; "
                             "one train step has one temperature")
        return cls(temperature=temperatures.pop(), **fields)

    @property
    def resolved_aggregation(self) -> str:
        return self.aggregation or _DEFAULT_AGGREGATION[self.kind]

    @property
    def needs_teacher_logp(self) -> bool:
        return self.kind not in ("action-opd", "sft")

    @property
    def needs_teacher_dense(self) -> bool:
        """The loss reads the teacher's whole log-softmax at the supervised positions, not its token log-probs."""
        return self.kind == "opd-exact"



def model_log_probs(model: CausalLM, tokens: jax.Array, positions: jax.Array, attention_mask: jax.Array,
                    loss_mask: jax.Array, config: "LossConfig") -> jax.Array:
    """The per-token log-probs a loss needs, by the cheapest exact path the config allows."""
    if config.max_supervised_tokens is not None:
        return supervised_log_probs(model, tokens, positions, attention_mask, loss_mask,
                                    config.max_supervised_tokens, config.temperature,
                                    remat_layers=config.remat_layers)
    return sequence_log_probs(model, tokens, positions, attention_mask, config.temperature, config.logits_chunk_size,
                              remat_layers=config.remat_layers)


def _opd(logp, batch, config, aggregation):
    return losses.opd_loss(logp, batch.behavior_logp, batch.teacher_logp, batch.loss_mask, kl_coef=config.kl_coef,
                           clip_eps=config.clip_eps, dual_clip=config.dual_clip, aggregation=aggregation,
                           advantage_logp=config.advantage_logp)


def _sti_opd(logp, batch, config, aggregation):
    return losses.sti_opd_loss(logp, batch.behavior_logp, batch.teacher_logp, batch.teacher_generated,
                               batch.loss_mask, clip_eps=config.clip_eps, dual_clip=config.dual_clip,
                               aggregation=aggregation, advantage_logp=config.advantage_logp)


def _sti_iw_reverse_kl(logp, batch, config, aggregation):
    return losses.sti_importance_weighted_reverse_kl(logp, batch.teacher_logp, batch.teacher_generated,
                                                     batch.loss_mask, aggregation=aggregation)


def _sft(logp, batch, config, aggregation):
    return losses.sft_loss(logp, batch.loss_mask, aggregation=aggregation, token_weight=batch.loss_weight)


def _action_opd(logp, batch, config, aggregation):
    return losses.actionopd_loss(logp, batch.behavior_logp, batch.advantages, batch.retained, batch.loss_mask,
                                 clip_eps=config.clip_eps, dual_clip=config.dual_clip)


TOKEN_LOSSES: dict[str, Callable[..., tuple[jax.Array, Metrics]]] = {
    "opd": _opd, "sti-opd": _sti_opd, "sti-iw-reverse-kl": _sti_iw_reverse_kl, "sft": _sft,
    "action-opd": _action_opd}
"""The losses computed from the student's per-token log-probs, by ``LossConfig.kind`` (``opd-exact`` needs the
whole log-softmax: ``batch_loss`` computes it): ``fn(logp, batch, config, aggregation) -> (loss, metrics)``."""


def loss_from_log_probs(logp: jax.Array, batch: TrainBatch, config: LossConfig) -> tuple[jax.Array, Metrics]:
    """The configured method's loss of a batch given the student's per-token log-probs ``logp`` ``[B, T]``."""
    if config.kind not in TOKEN_LOSSES:
        raise ValueError(f"the {config.kind!r} loss is not computed from per-token log-probs; expected one of "
                         f"{sorted(TOKEN_LOSSES)}")
    return TOKEN_LOSSES[config.kind](logp, batch, config, config.resolved_aggregation)


def batch_loss(params: nnx.State, graphdef: nnx.GraphDef, batch: TrainBatch, config: LossConfig
               ) -> tuple[jax.Array, Metrics]:
    """Loss and metrics of ``batch`` under the student ``params`` (a pure function: differentiate it)."""
    model = nnx.merge(graphdef, params)
    if config.context_lm_weight > 0:
        return _sft_with_context_loss(model, batch, config)
    if config.needs_teacher_dense:
        return _exact_opd_loss(model, batch, config)
    logp = model_log_probs(model, batch.tokens, batch.positions, batch.attention_mask, batch.loss_mask, config)
    loss, metrics = loss_from_log_probs(logp, batch, config)
    return loss, dict(metrics)


def _exact_opd_loss(model: CausalLM, batch: TrainBatch, config: LossConfig) -> tuple[jax.Array, Metrics]:
    """The ``opd-exact`` loss: the student's log-softmax at the supervised positions against the teacher's, which
    ``score_batch`` put in ``batch.teacher_dense_logp`` for the same positions."""
    hidden, _ = model.hidden_states(batch.tokens, batch.positions,
                                    dense_causal_attend(batch.positions, batch.attention_mask),
                                    remat=config.remat_layers)
    student, targets, order, valid = supervised_dense_log_probs(model, hidden, batch.tokens, batch.loss_mask,
                                                                config.max_supervised_tokens, config.temperature)
    teacher, ids = batch.teacher_dense_logp, batch.teacher_top_ids
    k = config.exact_top_k
    if k is None and tuple(teacher.shape) != tuple(student.shape):
        raise ValueError(f"the opd-exact loss needs the teacher's log-softmax {tuple(student.shape)} at the batch's "
                         f"supervised positions, but batch.teacher_dense_logp has shape {tuple(teacher.shape)}; "
                         "score the batch with make_teacher_scorer(..., dense=True)")
    if k is None:
        loss, metrics = losses.exact_opd_loss(student, teacher, valid, targets=targets,
                                              aggregation=config.resolved_aggregation)
        return loss, dict(metrics)
    expected = tuple(student.shape[:2]) + (k,)
    if tuple(ids.shape) != expected or tuple(teacher.shape) != expected[:2] + (k + 1,):
        raise ValueError(f"the opd-exact loss with exact_top_k {k} needs the teacher's top {k} ids {expected} and "
                         f"values {expected[:2] + (k + 1,)} at the batch's supervised positions, but the batch has "
                         f"{tuple(ids.shape)} and {tuple(teacher.shape)}; score it with "
                         f"make_teacher_scorer(..., dense=True, top_k={k})")
    # the sampled estimate's teacher side: the token log-probs the scorer also returns
    loss, metrics = losses.exact_opd_loss(student, teacher, valid, teacher_ids=ids, targets=targets,
                                          teacher_target_log_probs=jnp.take_along_axis(batch.teacher_logp, order,
                                                                                       axis=1),
                                          aggregation=config.resolved_aggregation)
    return loss, dict(metrics)


def _sft_with_context_loss(model: CausalLM, batch: TrainBatch, config: LossConfig) -> tuple[jax.Array, Metrics]:
    """The ``sft`` loss with its context term: one forward pass gives the response and the prompt log-probs."""
    hidden, _ = model.hidden_states(batch.tokens, batch.positions,
                                    dense_causal_attend(batch.positions, batch.attention_mask),
                                    remat=config.remat_layers)
    if config.max_supervised_tokens is not None:
        logp = supervised_from_hidden(model, hidden, batch.tokens, batch.loss_mask, config.max_supervised_tokens,
                                       config.temperature)
    else:
        logp = token_log_probs(model.logits(hidden[:, :-1]), batch.tokens[:, 1:], config.temperature)
        logp = jnp.pad(jnp.where(batch.attention_mask[:, 1:].astype(bool), logp, 0.0), ((0, 0), (1, 0)))
    context_logp, context_mask = context_log_probs(model, hidden, batch.tokens, batch.attention_mask,
                                                   batch.loss_mask, config.context_vocab)
    loss, metrics = losses.sft_loss(logp, batch.loss_mask, aggregation=config.resolved_aggregation,
                                    context_logp=context_logp, context_mask=context_mask,
                                    context_weight=config.context_lm_weight, token_weight=batch.loss_weight)
    return loss, dict(metrics)



def make_train_step(graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation, loss_config: LossConfig,
                    state_shardings: TrainState, batch_sharding: TrainBatch, *, donate: bool = True,
                    lora: LoraConfig | None = None, base_shardings: Any = None
                    ) -> Callable[..., tuple[TrainState, Metrics]]:
    """``train_step(state, batch) -> (new_state, metrics)`` compiled for the trainer mesh.

    One optimizer update on the gradient of the batch loss. In- and out-shardings are explicit: the state
    keeps ``state_shardings``, the batch is ``batch_sharding``, metrics come back replicated. With
    ``donate`` the input state's buffers are reused for the output (do not touch ``state`` afterwards).
    Metrics: the loss's own metrics plus ``loss``, ``grad_norm`` (before clipping) and ``update_norm``.

    With ``lora`` the state's parameters are LoRA adapters and the step is ``train_step(state, batch, base)``: the
    loss reads ``lora.merge(base, adapters)``, the frozen ``base`` (laid out by ``base_shardings``) gets no update.
    """
    mesh = state_shardings.step.mesh

    def update(state: TrainState, loss_of: Callable[[Any], tuple[jax.Array, Metrics]]) -> tuple[TrainState, Metrics]:
        (loss, metrics), grads = jax.value_and_grad(loss_of, has_aux=True)(state.params)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {**metrics, "loss": loss, "grad_norm": optax.global_norm(grads),
                   "update_norm": optax.global_norm(updates)}
        metrics = {name: jnp.asarray(value, jnp.float32) for name, value in metrics.items()}
        return TrainState(state.step + 1, params, opt_state), metrics

    donated = (0,) if donate else ()
    if lora is None:
        def train_step(state: TrainState, batch: TrainBatch) -> tuple[TrainState, Metrics]:
            return update(state, lambda params: batch_loss(params, graphdef, batch, loss_config))

        return jax.jit(train_step, in_shardings=(state_shardings, batch_sharding),
                       out_shardings=(state_shardings, replicated(mesh)), donate_argnums=donated)

    def lora_step(state: TrainState, batch: TrainBatch, base: nnx.State) -> tuple[TrainState, Metrics]:
        return update(state, lambda adapters: batch_loss(merge(base, adapters, lora), graphdef, batch, loss_config))

    return jax.jit(lora_step, in_shardings=(state_shardings, batch_sharding, base_shardings),
                   out_shardings=(state_shardings, replicated(mesh)), donate_argnums=donated)


__all__ = ["Metrics", "LOSS_KINDS", "ADVANTAGE_KINDS", "LossConfig", "model_log_probs", "TOKEN_LOSSES",
           "loss_from_log_probs", "batch_loss", "make_train_step"]
