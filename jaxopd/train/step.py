"""The jitted, sharded train step of the student and the jitted teacher scorer.

Owns the train state (step, parameters, optimizer state), the optimizer (AdamW with global-norm
clipping), the shardings of the state and of a batch on a mesh, per-token log-probabilities of a batch
under a model (optionally in vocabulary-sized chunks), the loss of a batch for each method (calling
``jaxopd.losses``), and the two compiled programs: ``train_step`` on the trainer mesh and ``score`` on
the teacher mesh.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxopd import losses
from jaxopd.models.logprobs import ROLLOUT_TEMPERATURE, effective_temperature, tempered_log_softmax, token_log_probs
from jaxopd.models.decoder import CausalLM, dense_causal_attend
from jaxopd.models.sharding import DATA_AXIS, DEFAULT_RULES, ShardingRules, copy_to, named_shardings
from jaxopd.train.buffer import TrainBatch

Metrics = dict[str, jax.Array]


# ----------------------------------------------------------------------------------------------------------
# Configuration
# ----------------------------------------------------------------------------------------------------------
LR_SCHEDULES = ("constant", "cosine")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with global-norm gradient clipping; defaults are the papers' (ActFirst-OPD Table 6, ActionOPD
    Table 7): constant lr 1e-6, β = (0.9, 0.999), weight decay 0.01, clip 1.0.

    ``max_grad_norm=None`` disables clipping. Weight decay applies to every parameter, as torch's AdamW in
    verl does. ``schedule="cosine"`` (a fixed-length run such as SFT) warms the rate up linearly from 0 over
    ``warmup_steps`` and decays it along a half cosine to ``final_fraction`` of its peak at ``decay_steps``
    (constant after). ``decay_steps`` and ``warmup_steps`` are ignored by the constant schedule.
    """

    learning_rate: float = 1e-6
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01
    max_grad_norm: float | None = 1.0
    schedule: str = "constant"
    decay_steps: int | None = None
    warmup_steps: int = 0
    final_fraction: float = 0.1

    def __post_init__(self):
        if not self.learning_rate > 0:
            raise ValueError(f"OptimizerConfig.learning_rate must be > 0, got {self.learning_rate}")
        if not (0 <= self.b1 < 1 and 0 <= self.b2 < 1):
            raise ValueError(f"OptimizerConfig betas must lie in [0, 1), got b1={self.b1}, b2={self.b2}")
        if not self.eps > 0 or self.weight_decay < 0:
            raise ValueError(f"OptimizerConfig needs eps > 0 and weight_decay >= 0, got eps={self.eps}, "
                             f"weight_decay={self.weight_decay}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"OptimizerConfig.max_grad_norm must be > 0 or None, got {self.max_grad_norm}")
        if self.schedule not in LR_SCHEDULES:
            raise ValueError(f"OptimizerConfig.schedule must be one of {LR_SCHEDULES}, got {self.schedule!r}")
        if self.schedule == "cosine":
            if not isinstance(self.decay_steps, int) or isinstance(self.decay_steps, bool) or self.decay_steps < 1:
                raise ValueError(f"a cosine schedule needs decay_steps >= 1, got {self.decay_steps!r}")
            if not 0 <= self.warmup_steps < self.decay_steps:
                raise ValueError(f"warmup_steps must lie in [0, decay_steps={self.decay_steps}), "
                                 f"got {self.warmup_steps}")
            if not 0 <= self.final_fraction <= 1:
                raise ValueError(f"final_fraction must lie in [0, 1], got {self.final_fraction}")

    def learning_rate_schedule(self) -> float | optax.Schedule:
        """The rate optax's AdamW takes: the constant, or the warm-up + cosine schedule of the step count."""
        if self.schedule == "constant":
            return self.learning_rate
        return optax.warmup_cosine_decay_schedule(0.0, self.learning_rate, self.warmup_steps, self.decay_steps,
                                                  end_value=self.learning_rate * self.final_fraction)


def make_optimizer(config: OptimizerConfig = OptimizerConfig()) -> optax.GradientTransformation:
    """``clip_by_global_norm`` (if enabled) followed by AdamW at ``config``'s learning rate (or schedule)."""
    adamw = optax.adamw(config.learning_rate_schedule(), b1=config.b1, b2=config.b2, eps=config.eps,
                        weight_decay=config.weight_decay)
    if config.max_grad_norm is None:
        return adamw
    return optax.chain(optax.clip_by_global_norm(config.max_grad_norm), adamw)


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


# ----------------------------------------------------------------------------------------------------------
# Train state and shardings
# ----------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class TrainState:
    """Everything an update changes: ``step`` (int32 scalar, = number of updates = policy version),
    ``params`` (the student's ``nnx.State`` of parameters) and ``opt_state``."""

    step: Any
    params: Any
    opt_state: Any


jax.tree_util.register_dataclass(TrainState, data_fields=["step", "params", "opt_state"], meta_fields=[])


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def train_state_shardings(abstract_params: nnx.State, optimizer: optax.GradientTransformation, mesh: Mesh,
                          rules: ShardingRules = DEFAULT_RULES) -> TrainState:
    """Shardings of a ``TrainState`` on ``mesh``: parameters and every optimizer-state copy of them by the
    parameters' logical axes, scalars (step, Adam count) replicated."""
    param_shardings = named_shardings(abstract_params, mesh, rules)
    abstract_opt_state = jax.eval_shape(optimizer.init, abstract_params)
    opt_shardings = optax.tree_map_params(optimizer, lambda _, sharding: sharding, abstract_opt_state,
                                          param_shardings, transform_non_params=lambda _: replicated(mesh))
    return TrainState(step=replicated(mesh), params=param_shardings, opt_state=opt_shardings)


def abstract_train_state(abstract_params: nnx.State, optimizer: optax.GradientTransformation,
                         shardings: TrainState) -> TrainState:
    """``jax.ShapeDtypeStruct`` of each leaf of the train state, with its sharding (a restore target)."""
    abstract = TrainState(jax.ShapeDtypeStruct((), jnp.int32), abstract_params,
                          jax.eval_shape(optimizer.init, abstract_params))
    return jax.tree.map(lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
                        abstract, shardings)


def init_train_state(params: nnx.State, optimizer: optax.GradientTransformation, shardings: TrainState) -> TrainState:
    """A fresh train state (step 0, optimizer initialised) laid out by ``shardings``.

    The parameters are copied, never aliased, so that a donating train step cannot delete the caller's arrays.
    """
    params = copy_to(params, shardings.params)
    opt_state = jax.device_put(optimizer.init(params), shardings.opt_state)
    return TrainState(jax.device_put(jnp.zeros((), jnp.int32), shardings.step), params, opt_state)


def batch_shardings(mesh: Mesh, data_axis: str = DATA_AXIS) -> TrainBatch:
    """A ``TrainBatch`` of shardings: rows split over ``data_axis``, replicated over the other axes."""
    rows = NamedSharding(mesh, PartitionSpec(data_axis))
    return TrainBatch(*([rows] * len(dataclasses.fields(TrainBatch))))


def _check_rows_divide(rows: int, sharding: NamedSharding) -> None:
    axes = sharding.spec[0] if len(sharding.spec) else None
    axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    split = 1
    for axis in axes:
        split *= sharding.mesh.shape[axis]
    if rows % split:
        raise ValueError(f"a batch of {rows} rows cannot be split over the {split} data-parallel devices of the "
                         f"mesh; pad it to a multiple of {split} (collate_samples(batch_size=...))")


def place_batch(batch: TrainBatch, shardings: TrainBatch) -> TrainBatch:
    """Moves a host (or other-mesh) batch onto ``shardings``, checking that the rows divide evenly."""
    _check_rows_divide(batch.tokens.shape[0], shardings.tokens)
    return jax.device_put(batch, shardings)


# ----------------------------------------------------------------------------------------------------------
# Log-probabilities and losses
# ----------------------------------------------------------------------------------------------------------
def sequence_log_probs(model: CausalLM, tokens: jax.Array, positions: jax.Array, attention_mask: jax.Array,
                       temperature: float = ROLLOUT_TEMPERATURE, logits_chunk_size: int | None = None) -> jax.Array:
    """``[B, T]`` log-probability of each token given the tokens before it; position 0 (no context) is 0.

    With ``logits_chunk_size`` the vocabulary projection and log-softmax run over that many positions
    at a time inside a rematerialised ``lax.map``.
    """
    hidden, _ = model.hidden_states(tokens, positions, dense_causal_attend(positions, attention_mask))
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
                         temperature: float = ROLLOUT_TEMPERATURE) -> jax.Array:
    """``sequence_log_probs`` on the supervised positions only (0 elsewhere): the first ``max_supervised_tokens``
    True entries of each row of ``loss_mask`` are gathered, projected onto the vocabulary and scattered back.

    Exact when no row has more supervised tokens than ``max_supervised_tokens`` (check on the host with
    :func:`check_supervised_fit`); further ones would read 0.
    """
    hidden, _ = model.hidden_states(tokens, positions, dense_causal_attend(positions, attention_mask))
    return _supervised_from_hidden(model, hidden, tokens, loss_mask, max_supervised_tokens, temperature)


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


def _target_log_probs(log_probs: jax.Array, targets: jax.Array, order: jax.Array, valid: jax.Array,
                      length: int) -> jax.Array:
    """``[B, length]``: the log-probabilities ``log_probs`` ``[B, W, V]`` give the tokens ``targets``, put back at
    their positions ``order`` (0 elsewhere and where not ``valid``)."""
    values = jnp.where(valid, jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0], 0.0)
    rows = jnp.arange(values.shape[0])[:, None]
    return jnp.zeros((values.shape[0], length), values.dtype).at[rows, order].add(values)


def _supervised_from_hidden(model: CausalLM, hidden: jax.Array, tokens: jax.Array, loss_mask: jax.Array,
                            max_supervised_tokens: int, temperature: float) -> jax.Array:
    return _target_log_probs(*supervised_dense_log_probs(model, hidden, tokens, loss_mask, max_supervised_tokens,
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


def model_log_probs(model: CausalLM, tokens: jax.Array, positions: jax.Array, attention_mask: jax.Array,
                    loss_mask: jax.Array, config: "LossConfig") -> jax.Array:
    """The per-token log-probs a loss needs, by the cheapest exact path the config allows."""
    if config.max_supervised_tokens is not None:
        return supervised_log_probs(model, tokens, positions, attention_mask, loss_mask,
                                    config.max_supervised_tokens, config.temperature)
    return sequence_log_probs(model, tokens, positions, attention_mask, config.temperature, config.logits_chunk_size)


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
                                    dense_causal_attend(batch.positions, batch.attention_mask))
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
                                    dense_causal_attend(batch.positions, batch.attention_mask))
    if config.max_supervised_tokens is not None:
        logp = _supervised_from_hidden(model, hidden, batch.tokens, batch.loss_mask, config.max_supervised_tokens,
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


# ----------------------------------------------------------------------------------------------------------
# The compiled programs
# ----------------------------------------------------------------------------------------------------------
def make_train_step(graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation, loss_config: LossConfig,
                    state_shardings: TrainState, batch_sharding: TrainBatch, *, donate: bool = True
                    ) -> Callable[[TrainState, TrainBatch], tuple[TrainState, Metrics]]:
    """``train_step(state, batch) -> (new_state, metrics)`` compiled for the trainer mesh.

    One optimizer update on the gradient of the batch loss. In- and out-shardings are explicit: the state
    keeps ``state_shardings``, the batch is ``batch_sharding``, metrics come back replicated. With
    ``donate`` the input state's buffers are reused for the output (do not touch ``state`` afterwards).
    Metrics: the loss's own metrics plus ``loss``, ``grad_norm`` (before clipping) and ``update_norm``.
    """
    mesh = state_shardings.step.mesh

    def train_step(state: TrainState, batch: TrainBatch) -> tuple[TrainState, Metrics]:
        (loss, metrics), grads = jax.value_and_grad(batch_loss, has_aux=True)(state.params, graphdef, batch,
                                                                              loss_config)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {**metrics, "loss": loss, "grad_norm": optax.global_norm(grads),
                   "update_norm": optax.global_norm(updates)}
        metrics = {name: jnp.asarray(value, jnp.float32) for name, value in metrics.items()}
        return TrainState(state.step + 1, params, opt_state), metrics

    return jax.jit(train_step, in_shardings=(state_shardings, batch_sharding),
                   out_shardings=(state_shardings, replicated(mesh)), donate_argnums=(0,) if donate else ())


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
        _check_rows_divide(tokens.shape[0], self.row_sharding)
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
    (16 × 128 × 592 over a sub-vocabulary: 4.8 MB; over Qwen3's 151,936 ids: 1.2 GB). ``top_k`` (dense only)
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
            token_logp = _target_log_probs(*dense, tokens.shape[1])
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


__all__ = ["OptimizerConfig", "make_optimizer", "LOSS_KINDS", "ADVANTAGE_KINDS", "LossConfig", "TrainState",
           "replicated",
           "train_state_shardings", "abstract_train_state", "init_train_state", "batch_shardings", "place_batch",
           "sequence_log_probs", "supervised_log_probs", "supervised_order", "supervised_dense_log_probs",
           "context_log_probs", "check_supervised_fit", "model_log_probs",
           "TOKEN_LOSSES", "loss_from_log_probs", "batch_loss", "make_train_step",
           "TeacherScores", "TeacherScorer", "make_teacher_scorer", "score_batch"]
