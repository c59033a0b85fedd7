"""Supervised fine-tuning: the NLL loss against hand-computed values and its logit gradient (softmax - onehot) on a
tiny vocabulary, the train step's ``sft`` kind against a numpy computation from a micro model's logits, and the
walkthrough samples of a generated ALFWorld game against the prompts a rollout replaying that walkthrough renders."""
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from tests.train.test_train_step import TINY, make_mesh, random_params

from jaxopd import losses
from jaxopd.methods.sft_data import (SFTDataset, WalkthroughTurn, response_text, walkthrough_samples,
                                     walkthrough_turns)
from jaxopd.rollout.actions import extract_action
from jaxopd.rollout.prompts import prompt_messages, render_prompt
from jaxopd.tokenizer import IM_END, Qwen3Tokenizer, render_qwen3_chat
from jaxopd.train.buffer import Sample, collate_samples
from jaxopd.train.state import batch_shardings, init_train_state, place_batch, train_state_shardings
from jaxopd.train.step import LOSS_KINDS, LossConfig, batch_loss, loss_from_log_probs, make_train_step

# ----------------------------------------------------------------------------------------------------------
# The loss
# ----------------------------------------------------------------------------------------------------------
LOGP = np.array([[-0.5, -1.0, -2.0, -99.0],
                 [-3.0, -0.25, -7.0, -0.75]], np.float32)
MASK = np.array([[0, 1, 1, 0],
                 [0, 1, 0, 1]], bool)


@pytest.mark.parametrize("jit", [False, True])
def test_sft_loss_hand_computed(jit):
    fn = jax.jit(losses.sft_loss, static_argnames="aggregation") if jit else losses.sft_loss
    # supervised -logp: row 0 {1.0, 2.0}, row 1 {0.25, 0.75}; the -99 and -7 are not supervised
    expected = {"token-mean": (1.0 + 2.0 + 0.25 + 0.75) / 4,                                 # 1.0
                "seq-mean-token-mean": ((1.0 + 2.0) / (2 + 1e-8) + (0.25 + 0.75) / (2 + 1e-8)) / 2,  # 1.0
                "seq-mean-token-sum": ((1.0 + 2.0) + (0.25 + 0.75)) / 2}                     # 2.0
    for aggregation, value in expected.items():
        loss, metrics = fn(jnp.asarray(LOGP), jnp.asarray(MASK), aggregation=aggregation)
        np.testing.assert_allclose(float(loss), value, rtol=1e-6)
        np.testing.assert_allclose(float(metrics["nll"]), 1.0, rtol=1e-6)
        np.testing.assert_allclose(float(metrics["perplexity"]), math.e, rtol=1e-6)
        np.testing.assert_allclose(float(metrics["token_prob_mean"]),
                                   np.mean(np.exp([-1.0, -2.0, -0.25, -0.75])), rtol=1e-6)
        assert float(metrics["supervised_tokens"]) == 4.0
        assert all(v.dtype == jnp.float32 and v.shape == () for v in metrics.values())
    # unequal rows separate the modes: row 0 keeps one token
    mask = MASK.copy()
    mask[0, 2] = False
    values = {a: float(losses.sft_loss(LOGP, mask, aggregation=a)[0]) for a in losses.AGGREGATION_MODES}
    np.testing.assert_allclose(values["token-mean"], (1.0 + 0.25 + 0.75) / 3, rtol=1e-6)
    np.testing.assert_allclose(values["seq-mean-token-mean"], (1.0 + 0.5) / 2, rtol=1e-6)
    np.testing.assert_allclose(values["seq-mean-token-sum"], (1.0 + 1.0) / 2, rtol=1e-6)


def test_sft_loss_token_weights_hand_computed():
    # supervised -logp: row 0 {1.0, 2.0}, row 1 {0.25, 0.75}; weights on them 3, 1 and 2, 0.5 (the others unread)
    weight = np.array([[7.0, 3.0, 1.0, 5.0],
                       [9.0, 2.0, 4.0, 0.5]], np.float32)
    expected = {"token-mean": (3 * 1.0 + 1 * 2.0 + 2 * 0.25 + 0.5 * 0.75) / (3 + 1 + 2 + 0.5),
                "seq-mean-token-mean": ((3 * 1.0 + 2.0) / (4 + 1e-8) + (2 * 0.25 + 0.5 * 0.75) / (2.5 + 1e-8)) / 2,
                "seq-mean-token-sum": ((3 * 1.0 + 2.0) + (2 * 0.25 + 0.5 * 0.75)) / 2}
    for aggregation, value in expected.items():
        loss, metrics = jax.jit(losses.sft_loss, static_argnames="aggregation")(
            jnp.asarray(LOGP), jnp.asarray(MASK), aggregation=aggregation, token_weight=jnp.asarray(weight))
        np.testing.assert_allclose(float(loss), value, rtol=1e-6)
        np.testing.assert_allclose(float(metrics["nll"]), 1.0, rtol=1e-6)       # the metrics stay unweighted
        assert float(metrics["supervised_tokens"]) == 4.0
        ones = losses.sft_loss(LOGP, MASK, aggregation=aggregation, token_weight=np.ones_like(weight))[0]
        assert float(ones) == float(losses.sft_loss(LOGP, MASK, aggregation=aggregation)[0])
    # the gradient w.r.t. logp is -w_k / sum(w) on supervised tokens under token-mean
    grad = jax.grad(lambda lp: losses.sft_loss(lp, MASK, token_weight=weight)[0])(jnp.asarray(LOGP))
    np.testing.assert_allclose(np.asarray(grad), -np.where(MASK, weight, 0.0) / 6.5, rtol=1e-6)
    # weights summing below 1 are still a weighted mean (no clamp of the denominator at 1)
    small = np.full_like(weight, 0.1)
    np.testing.assert_allclose(float(losses.sft_loss(LOGP, MASK, token_weight=small)[0]), 1.0, rtol=1e-6)
    with pytest.raises(ValueError, match="sft_loss"):
        losses.sft_loss(LOGP, MASK, token_weight=weight[:, :3])


def test_sft_loss_padding_rows_empty_batch_and_bad_inputs():
    padded_logp = np.concatenate([LOGP, np.full((2, 4), -5.0, np.float32)])
    padded_mask = np.concatenate([MASK, np.zeros((2, 4), bool)])
    for aggregation in losses.AGGREGATION_MODES:
        assert float(losses.sft_loss(padded_logp, padded_mask, aggregation=aggregation)[0]) == pytest.approx(
            float(losses.sft_loss(LOGP, MASK, aggregation=aggregation)[0]), rel=1e-6)
    loss, metrics = losses.sft_loss(LOGP, np.zeros_like(MASK))
    assert float(loss) == 0.0 and float(metrics["supervised_tokens"]) == 0.0
    with pytest.raises(ValueError, match="sft_loss"):
        losses.sft_loss(LOGP, MASK, aggregation="sum")
    with pytest.raises(ValueError, match="sft_loss"):
        losses.sft_loss(LOGP[0], MASK[0])
    with pytest.raises(ValueError, match="sft_loss"):
        losses.sft_loss(LOGP, MASK[:, :3])


def test_sft_gradient_wrt_logits_is_softmax_minus_onehot_over_supervised_tokens():
    """Exact enumeration over a 5-token vocabulary: d loss / d logits = (softmax - onehot(target)) / N_tok at
    supervised positions, 0 elsewhere (token-mean)."""
    vocab, rng = 5, np.random.default_rng(0)
    logits = rng.normal(size=(2, 4, vocab)).astype(np.float32) * 2.0
    targets = rng.integers(0, vocab, size=(2, 4))

    def loss_of_logits(lg):
        logp = jnp.take_along_axis(jax.nn.log_softmax(lg, axis=-1), targets[..., None], axis=-1)[..., 0]
        return losses.sft_loss(logp, MASK)[0]

    grad = np.asarray(jax.grad(loss_of_logits)(jnp.asarray(logits)), np.float64)
    z = logits.astype(np.float64)
    softmax = np.exp(z - z.max(-1, keepdims=True))
    softmax /= softmax.sum(-1, keepdims=True)
    onehot = np.eye(vocab)[targets]
    expected = (softmax - onehot) * MASK[..., None] / MASK.sum()
    np.testing.assert_allclose(grad, expected, atol=1e-7)
    assert np.abs(grad[~MASK]).max() == 0.0
    # and the value is the enumerated cross-entropy
    nll = -np.log((softmax * onehot).sum(-1))
    np.testing.assert_allclose(float(loss_of_logits(jnp.asarray(logits))), nll[MASK].mean(), rtol=1e-6)


# ----------------------------------------------------------------------------------------------------------
# The train step's sft kind
# ----------------------------------------------------------------------------------------------------------
def test_sft_loss_config():
    assert "sft" in LOSS_KINDS
    config = LossConfig(kind="sft")
    assert config.resolved_aggregation == "token-mean" and not config.needs_teacher_logp
    assert config.temperature == 1.0
    assert LossConfig(kind="sft", aggregation="seq-mean-token-sum").resolved_aggregation == "seq-mean-token-sum"


@pytest.fixture(scope="module")
def micro():
    graphdef, params = random_params(TINY, 0)
    rng = np.random.default_rng(1)
    samples = []
    for length, prompt in [(9, 5), (12, 4), (6, 3), (11, 8)]:
        tokens = rng.integers(0, TINY.vocab_size, length)
        mask = np.arange(length) >= prompt
        samples.append(Sample(tokens, mask, np.zeros(length, np.float32), 0))
    forward = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))
    reference = []            # per row: log-softmax of its own unpadded logits at the next tokens (float64)
    for sample in samples:
        logits = np.asarray(forward(params, jnp.asarray(sample.tokens)[None]))[0].astype(np.float64)
        log_softmax = logits - logits.max(-1, keepdims=True)
        log_softmax -= np.log(np.exp(log_softmax).sum(-1, keepdims=True))
        reference.append(np.concatenate([[0.0], log_softmax[np.arange(len(sample) - 1), sample.tokens[1:]]]))
    return dict(graphdef=graphdef, params=params, samples=samples, reference=reference,
                batch=collate_samples(samples, batch_size=6, length_multiple=8))   # two empty padding rows


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_batch_loss_sft_matches_numpy_from_logits(micro, aggregation):
    config = LossConfig(kind="sft", aggregation=aggregation)
    loss, metrics = jax.jit(lambda p, b: batch_loss(p, micro["graphdef"], b, config))(micro["params"], micro["batch"])
    nll = [-lp[s.loss_mask] for s, lp in zip(micro["samples"], micro["reference"])]
    if aggregation == "token-mean":
        expected = np.concatenate(nll).mean()
    else:
        expected = np.mean([row.sum() / (len(row) + 1e-8) for row in nll])
    np.testing.assert_allclose(float(loss), expected, rtol=1e-5)
    assert float(metrics["supervised_tokens"]) == sum(s.num_supervised for s in micro["samples"])
    np.testing.assert_allclose(float(metrics["nll"]), np.concatenate(nll).mean(), rtol=1e-5)
    assert expected > 1.0     # a random model: about log(64) nats a token


def test_loss_from_log_probs_sft_ignores_behaviour_and_teacher_fields(micro):
    batch = micro["batch"]
    logp = jnp.asarray(np.random.default_rng(2).normal(-2.0, 0.5, batch.tokens.shape).astype(np.float32))
    noisy = batch.replace(behavior_logp=np.full_like(batch.behavior_logp, 3.0),
                          teacher_logp=np.full_like(batch.teacher_logp, -9.0))
    a = loss_from_log_probs(logp, batch, LossConfig(kind="sft"))[0]
    b = loss_from_log_probs(logp, noisy, LossConfig(kind="sft"))[0]
    assert float(a) == float(b) == pytest.approx(float(-jnp.sum(logp * batch.loss_mask) / batch.loss_mask.sum()))


@pytest.mark.slow  # heavier than the README's test run allows (run in CI: pytest -m slow)
def test_batch_loss_sft_weights_the_tokens_the_samples_weigh(micro):
    weights = [np.where(s.loss_mask, 1.0 + np.arange(len(s)) % 3, 0.0).astype(np.float32) for s in micro["samples"]]
    samples = [dataclasses.replace(s, loss_weight=w) for s, w in zip(micro["samples"], weights)]
    batch = collate_samples(samples, batch_size=6, length_multiple=8)
    np.testing.assert_array_equal(batch.loss_weight[:4].sum(1), [w.sum() for w in weights])
    assert not batch.loss_weight[4:].any()
    expected = (sum(float(-(lp * w).sum()) for lp, w in zip(micro["reference"], weights))
                / sum(float(w.sum()) for w in weights))
    for config in (LossConfig(kind="sft"), LossConfig(kind="sft", max_supervised_tokens=8),
                   LossConfig(kind="sft", context_lm_weight=1e-9, context_vocab=tuple(range(TINY.vocab_size)))):
        loss, metrics = jax.jit(functools.partial(batch_loss, graphdef=micro["graphdef"], config=config))(
            micro["params"], batch=batch)
        np.testing.assert_allclose(float(loss), expected, rtol=1e-5)
        unweighted = np.concatenate([-lp[s.loss_mask] for s, lp in zip(micro["samples"], micro["reference"])])
        np.testing.assert_allclose(float(metrics["nll"]), unweighted.mean(), rtol=1e-5)
    # collate without weights gives 1 on the supervised tokens: the unweighted loss
    np.testing.assert_array_equal(micro["batch"].loss_weight, micro["batch"].loss_mask.astype(np.float32))


def train_steps(micro, config, steps=4):
    """The metrics of ``steps`` Adam steps of the sharded train step on the micro batch (one device)."""
    mesh = make_mesh(1, 1)
    optimizer = optax.adam(3e-2)
    state_shardings = train_state_shardings(micro["params"], optimizer, mesh)
    rows = batch_shardings(mesh)
    step = make_train_step(micro["graphdef"], optimizer, config, state_shardings, rows)
    state = init_train_state(micro["params"], optimizer, state_shardings)
    batch = place_batch(micro["batch"], rows)
    history = []
    for _ in range(steps):
        state, metrics = step(state, batch)
        history.append({name: float(value) for name, value in metrics.items()})
    return history


@pytest.mark.slow  # heavier than the README's test run allows (run in CI: pytest -m slow)
def test_sft_train_steps_lower_the_nll(micro):
    nll = [m["loss"] for m in train_steps(micro, LossConfig(kind="sft"))]
    assert nll[-1] < nll[0] - 0.1, nll


# ----------------------------------------------------------------------------------------------------------
# The context language-model term (LossConfig.context_lm_weight)
# ----------------------------------------------------------------------------------------------------------
def test_sft_loss_context_term_hand_computed():
    context_logp = np.array([[0.0, -2.0, -4.0, 0.0],
                             [0.0, -1.0, 0.0, 0.0]], np.float32)
    context_mask = np.array([[0, 1, 1, 0],
                             [0, 1, 0, 0]], bool)
    loss, metrics = losses.sft_loss(LOGP, MASK, context_logp=context_logp, context_mask=context_mask,
                                    context_weight=0.5)
    response = (1.0 + 2.0 + 0.25 + 0.75) / 4
    context = (2.0 + 4.0 + 1.0) / 3
    assert float(loss) == pytest.approx(response + 0.5 * context)
    assert float(metrics["nll"]) == pytest.approx(response)
    assert float(metrics["context_nll"]) == pytest.approx(context)
    assert float(metrics["context_tokens"]) == 3
    plain, plain_metrics = losses.sft_loss(LOGP, MASK)
    assert float(plain) == pytest.approx(response) and "context_nll" not in plain_metrics
    with pytest.raises(ValueError, match="context_logp and context_mask"):
        losses.sft_loss(LOGP, MASK, context_weight=1.0)
    with pytest.raises(ValueError, match="context_weight"):
        losses.sft_loss(LOGP, MASK, context_logp=context_logp, context_mask=context_mask, context_weight=-1.0)


def corpus_ids(samples) -> tuple[int, ...]:
    """Every token id of ``samples``, sorted (the restricted softmax of the context term)."""
    return tuple(sorted({int(t) for sample in samples for t in sample.tokens}))


def test_context_lm_config_is_checked():
    assert LossConfig(kind="sft", context_lm_weight=1.0, context_vocab=(1, 5, 9)).context_lm_weight == 1.0
    with pytest.raises(ValueError, match="sft loss only"):
        LossConfig(kind="opd", context_lm_weight=1.0, context_vocab=(1, 2))
    with pytest.raises(ValueError, match="needs context_vocab"):
        LossConfig(kind="sft", context_lm_weight=1.0)
    with pytest.raises(ValueError, match="sorted"):
        LossConfig(kind="sft", context_lm_weight=1.0, context_vocab=(5, 1))
    with pytest.raises(ValueError, match="context_lm_weight must be >= 0"):
        LossConfig(kind="sft", context_lm_weight=-0.1, context_vocab=(1,))


def _restricted_reference(micro, vocab):
    """Per row, float64 numpy: log softmax over ``vocab``'s columns of the full logits at each prompt token."""
    forward = jax.jit(lambda p, t: nnx.merge(micro["graphdef"], p)(t))
    rows = []
    for sample in micro["samples"]:
        logits = np.asarray(forward(micro["params"], jnp.asarray(sample.tokens)[None]))[0].astype(np.float64)
        sub = logits[:, list(vocab)]
        sub = sub - sub.max(-1, keepdims=True)
        sub -= np.log(np.exp(sub).sum(-1, keepdims=True))
        values = []
        for t in range(1, len(sample)):
            if not sample.loss_mask[t] and int(sample.tokens[t]) in vocab:
                values.append(sub[t - 1, vocab.index(int(sample.tokens[t]))])
        rows.append(values)
    return rows


@pytest.mark.parametrize("max_supervised_tokens", [None, 8])
def test_batch_loss_with_context_term_matches_numpy_from_logits(micro, max_supervised_tokens):
    vocab = corpus_ids(micro["samples"])
    assert list(vocab) == sorted(set(np.concatenate([s.tokens for s in micro["samples"]]).tolist()))
    # leave one id of a prompt out: its positions do not count
    dropped = int(micro["samples"][0].tokens[2])
    vocab = tuple(v for v in vocab if v != dropped)
    config = LossConfig(kind="sft", context_lm_weight=0.3, context_vocab=vocab,
                        max_supervised_tokens=max_supervised_tokens)
    loss, metrics = jax.jit(lambda p, b: batch_loss(p, micro["graphdef"], b, config))(micro["params"], micro["batch"])
    response = np.concatenate([-lp[s.loss_mask] for s, lp in zip(micro["samples"], micro["reference"])]).mean()
    context_rows = _restricted_reference(micro, list(vocab))
    context = -np.concatenate(context_rows).mean()
    np.testing.assert_allclose(float(metrics["nll"]), response, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["context_nll"]), context, rtol=1e-5)
    np.testing.assert_allclose(float(loss), response + 0.3 * context, rtol=1e-5)
    assert float(metrics["context_tokens"]) == sum(len(r) for r in context_rows)
    # the restricted softmax over fewer ids gives each prompt token more probability than the full one
    assert context < np.concatenate([-lp[~s.loss_mask][1:] for s, lp in zip(micro["samples"],
                                                                           micro["reference"])]).mean()


@pytest.mark.slow  # heavier than the README's test run allows (run in CI: pytest -m slow)
def test_context_term_trains_the_prompt_tokens_too(micro):
    """Steps with the context term lower the prompt's restricted NLL; steps without it leave its gradient out."""
    vocab = corpus_ids(micro["samples"])
    with_context = LossConfig(kind="sft", context_lm_weight=1.0, context_vocab=vocab)
    context_nll = [m["context_nll"] for m in train_steps(micro, with_context)]
    assert context_nll[-1] < context_nll[0] - 0.1, context_nll
    grad = jax.grad(lambda p: batch_loss(p, micro["graphdef"], micro["batch"], with_context)[0])(micro["params"])
    plain = jax.grad(lambda p: batch_loss(p, micro["graphdef"], micro["batch"], LossConfig(kind="sft"))[0])(
        micro["params"])
    difference = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(grad), jax.tree.leaves(plain)))
    assert difference > 1e-4


# ----------------------------------------------------------------------------------------------------------
# Walkthrough samples
# ----------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tok():
    return Qwen3Tokenizer()


def test_response_text_parses_back_and_is_qwen3s_assistant_turn(tok):
    action = "take soapbar 3 from garbagecan 1"
    text = response_text(action)
    assert text == "<think>\n\n</think>\n\n<action>take soapbar 3 from garbagecan 1</action>"
    assert extract_action(text) == action
    # Qwen3's chat template renders an assistant turn with empty reasoning as prompt + this text + <|im_end|>
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    prompt = render_qwen3_chat(messages, add_generation_prompt=True, enable_thinking=True)
    full = render_qwen3_chat(messages + [{"role": "assistant", "content": text}], add_generation_prompt=False)
    assert full == prompt + text + IM_END + "\n"
    for bad in ["", "  ", " look", "look\n", "a</action>", "<think>"]:
        with pytest.raises(ValueError):
            response_text(bad)


@pytest.fixture(scope="module")
def alfworld(tmp_path_factory):
    pytest.importorskip("alfworld")
    from jaxopd_envs import alfworld_gen
    from jaxopd_envs.alfworld import AlfWorldEnv
    from jaxopd_envs.references import build_reference

    root = alfworld_gen.ensure_games(tmp_path_factory.mktemp("sft_games"), seed=0,
                                     counts={"train": 1, "valid_seen": 0, "valid_unseen": 0}, workers=1,
                                     progress=False)
    factory = functools.partial(AlfWorldEnv, root)
    with factory() as env:
        task = env.tasks("train")[0]
        reference = build_reference(env, task)
    return factory, task, reference


class _NoEngine:
    def submit(self, request):
        raise AssertionError("the replay asks no model")


def replay_prompts(alfworld, tok, max_prompt_tokens):
    """Replays the walkthrough through ``RolloutStrategy``'s own episode loop on a live environment, recording
    each turn's ``prompt_inputs`` and the ids ``render("full", ...)`` gives under the budget."""
    from jaxopd_envs.pool import EnvPool
    from jaxopd.rollout.strategies.base import Decision, RolloutConfig, RolloutStrategy

    factory, task, reference = alfworld

    seen = []

    class Replay(RolloutStrategy):
        name = "replay"

        def decide(self, episode):
            inputs = self.prompt_inputs(episode)
            seen.append((inputs, self.render("full", inputs)))
            return Decision(action=reference.actions[episode.turn - 1], source="reference")

    config = RolloutConfig(max_turns=len(reference.actions) + 1, max_prompt_tokens=max_prompt_tokens)
    with EnvPool(factory, num_slots=1, backend="thread") as pool:
        trajectory = Replay(_NoEngine(), pool, tok, config).run_episode(0, task, reference)
    assert trajectory.end_reason == "done" and trajectory.won
    assert trajectory.actions == reference.actions
    return seen


def test_walkthrough_turns_are_the_rollouts_prompt_inputs(alfworld, tok):
    _, task, reference = alfworld
    turns = walkthrough_turns(reference)
    assert len(turns) == len(reference.actions) >= 2
    assert all(isinstance(t, WalkthroughTurn) and t.task_id == task.task_id for t in turns)
    assert [t.turn for t in turns] == list(range(1, len(turns) + 1))
    assert [t.action for t in turns] == list(reference.actions)
    replayed = replay_prompts(alfworld, tok, 2048)
    assert len(replayed) == len(turns)
    for turn, (inputs, _) in zip(turns, replayed):
        assert turn.inputs == inputs
        assert turn.action in turn.inputs.admissible_actions


@pytest.mark.parametrize("max_prompt_tokens", [2048, "tight"])
def test_walkthrough_samples_against_a_replayed_rollout(alfworld, tok, max_prompt_tokens):
    _, _, reference = alfworld
    if max_prompt_tokens == "tight":   # one token under the longest prompt: its history is cut, oldest first
        _, stats = walkthrough_samples([reference], tok, max_prompt_tokens=4096)
        max_prompt_tokens = stats.max_prompt_tokens - 1
    samples, stats = walkthrough_samples({reference.task_id: reference}, tok, max_prompt_tokens=max_prompt_tokens)
    replayed = replay_prompts(alfworld, tok, max_prompt_tokens)
    assert stats.references == 1 and stats.turns == len(reference.actions) == stats.samples == len(samples)
    assert stats.skipped == 0 and (stats.history_truncated > 0) == (max_prompt_tokens < 2048)
    end = tok.eos_token_id
    for sample, action, (inputs, rollout_ids) in zip(samples, reference.actions, replayed):
        prompt = int(np.argmax(sample.loss_mask))
        assert not sample.loss_mask[:prompt].any() and sample.loss_mask[prompt:].all()
        np.testing.assert_array_equal(sample.tokens[:prompt], rollout_ids)           # byte-identical prompt
        assert prompt <= max_prompt_tokens
        response = sample.tokens[sample.loss_mask]
        assert response[-1] == end and tok.decode(response) == response_text(action) + IM_END
        assert extract_action(tok.decode(response[:-1])) == action
        np.testing.assert_array_equal(sample.behavior_logp, 0.0)
        assert sample.policy_version == 0 and sample.teacher_logp is None
        # the ids are the tokenisation of the whole conversation text (no merge across the boundary)
        rendered = render_prompt(tok, "full", inputs, max_prompt_tokens)
        assert sample.tokens.tolist() == tok.encode(rendered.text + response_text(action) + IM_END)
        kept_messages = prompt_messages("full", inputs, rendered.history_pairs_kept)
        assert tok.decode(sample.tokens) + "\n" == render_qwen3_chat(
            kept_messages + [{"role": "assistant", "content": response_text(action)}], add_generation_prompt=False)
    assert stats.prompt_tokens == sum(int((~s.loss_mask).sum()) for s in samples)
    assert stats.response_tokens == sum(s.num_supervised for s in samples)
    assert stats.max_prompt_tokens == max(int((~s.loss_mask).sum()) for s in samples)
    assert stats.tokens == sum(len(s) for s in samples)


def test_walkthrough_samples_skip_turns_over_budget(alfworld, tok):
    _, _, reference = alfworld
    samples, stats = walkthrough_samples([reference], tok, max_prompt_tokens=64)
    assert samples == [] and stats.skipped == stats.turns == len(reference.actions) and stats.tokens == 0
    with pytest.raises(ValueError, match="is a alfworld reference, not scienceworld"):
        walkthrough_samples([reference], tok, max_prompt_tokens=2048, benchmark="scienceworld")
    with pytest.raises(ValueError, match="only ALFWorld"):     # ScienceWorld references store no admissible actions
        walkthrough_turns(dataclasses.replace(reference, benchmark="scienceworld"))
    with pytest.raises(ValueError, match="without observation records"):
        walkthrough_turns(dataclasses.replace(reference, records=()))


# ----------------------------------------------------------------------------------------------------------
# The dataset
# ----------------------------------------------------------------------------------------------------------
def _numbered_samples(n):
    """Samples whose first token is their index."""
    return [Sample(np.array([i, 1, 2]), np.array([False, True, True]), np.zeros(3, np.float32), 0)
            for i in range(n)]


def _ids(batch):
    return [int(s.tokens[0]) for s in batch]


def test_dataset_epochs_cover_every_sample_once_deterministically():
    samples = _numbered_samples(23)
    dataset = SFTDataset(samples, 4, seed=7)
    assert len(dataset) == 23 and dataset.batches_per_epoch == 6
    orders = []
    for epoch in range(3):
        batches = list(dataset.batches(epoch))
        assert [len(b) for b in batches] == [4, 4, 4, 4, 4, 3]
        served = [i for b in batches for i in _ids(b)]
        assert sorted(served) == list(range(23))
        assert served == dataset.order(epoch).tolist()
        again = [_ids(b) for b in SFTDataset(samples, 4, seed=7).batches(epoch)]
        assert again == [_ids(b) for b in batches]                                   # same seed, same batches
        assert [_ids(b) for b in dataset.batches(epoch, start=4)] == again[4:]       # resume mid-epoch
        orders.append(served)
    assert orders[0] != orders[1] != orders[2]                                       # reshuffled per epoch
    assert [_ids(b) for b in SFTDataset(samples, 4, seed=8).batches(0)] != [_ids(b) for b in dataset.batches(0)]
    assert list(dataset.batches(0, start=6)) == []
    assert dataset.position(0) == (0, 0) and dataset.position(5) == (0, 5) and dataset.position(13) == (2, 1)
    dropped = SFTDataset(samples, 4, seed=7, drop_last=True)
    assert dropped.batches_per_epoch == 5 and all(len(b) == 4 for b in dropped.batches(0))
    assert [_ids(b) for b in dropped.batches(0)] == [_ids(b) for b in dataset.batches(0)][:5]
    batch = collate_samples(next(iter(dataset.batches(0, start=5))), batch_size=4)   # the short last batch, padded
    assert batch.tokens.shape[0] == 4 and not batch.loss_mask[3].any()


def _sized_samples(lengths):
    """Samples whose first token is their index and whose length is ``lengths[index]``."""
    return [Sample(np.array([i] + [1] * (n - 1)), np.array([False] + [True] * (n - 1)), np.zeros(n, np.float32), 0)
            for i, n in enumerate(lengths)]


def test_dataset_grouped_by_length_sorts_each_window_and_keeps_the_epoch():
    lengths = np.random.default_rng(3).integers(5, 60, size=27).tolist()
    samples = _sized_samples(lengths)
    plain = SFTDataset(samples, 4, seed=7)
    grouped = SFTDataset(samples, 4, seed=7, group_by_length=3)        # windows of 12 samples, 3 batches each
    assert grouped.batches_per_epoch == plain.batches_per_epoch == 7
    for epoch in range(2):
        # off (0) is the plain seeded permutation, the order runs made before grouping existed
        permutation = np.random.default_rng(np.random.SeedSequence([7, epoch])).permutation(27)
        assert plain.order(epoch).tolist() == permutation.tolist()
        batches = [_ids(b) for b in grouped.batches(epoch)]
        assert [len(b) for b in batches] == [4, 4, 4, 4, 4, 4, 3]        # the remainder stays last
        assert sorted(i for b in batches for i in b) == list(range(27))
        for window in range(3):
            members = permutation[12 * window:12 * (window + 1)].tolist()
            served = batches[3 * window:3 * (window + 1)]
            assert sorted(i for b in served for i in b) == sorted(members)    # a window keeps its samples
            by_length = sorted(members, key=lambda i: -lengths[i])
            runs = [sorted(lengths[i] for i in by_length[k:k + 4]) for k in range(0, len(members), 4)]
            assert sorted(sorted(lengths[i] for i in b) for b in served) == sorted(runs)   # batches of neighbours
        assert [_ids(b) for b in grouped.batches(epoch, start=2)] == batches[2:]            # resume mid-epoch
        assert [_ids(b) for b in SFTDataset(samples, 4, seed=7, group_by_length=3).batches(epoch)] == batches
    assert [_ids(b) for b in grouped.batches(0)] != [_ids(b) for b in grouped.batches(1)]

    def padded(dataset):
        return sum(4 * max(len(s) for s in batch) for batch in dataset.batches(0))
    assert padded(SFTDataset(samples, 4, seed=7, group_by_length=7)) < 0.85 * padded(plain)


def test_dataset_rejects_bad_arguments():
    samples = _numbered_samples(3)
    for bad in [dict(batch_size=0), dict(batch_size=True), dict(batch_size=4, drop_last=True),
                dict(batch_size=2, group_by_length=-1), dict(batch_size=2, group_by_length=True),
                dict(batch_size=2, group_by_length=1.5)]:
        with pytest.raises(ValueError):
            SFTDataset(samples, **bad)
    with pytest.raises(ValueError):
        SFTDataset([], 2)
    dataset = SFTDataset(samples, 2)
    with pytest.raises(ValueError):
        list(dataset.batches(-1))
    with pytest.raises(ValueError):
        list(dataset.batches(0, start=3))


# ----------------------------------------------------------------------------------------------------------
# State thinking (--sft-thinking state)
# ----------------------------------------------------------------------------------------------------------
def test_response_text_with_thinking_parses_back():
    text = response_text("take mug 2 from countertop 1", "I need a mug. I see mug 2 here.")
    assert text == "<think>\nI need a mug. I see mug 2 here.\n</think>\n\n<action>take mug 2 from countertop 1</action>"
    assert extract_action(text) == "take mug 2 from countertop 1"
    for bad in [" x", "x\n", "a</think>", "<action>"]:
        with pytest.raises(ValueError, match="thinking"):
            response_text("look", bad)


def _inputs(instruction, steps, observation):
    """PromptInputs after ``steps`` [(action, the engine's answer)], starting in the room description."""
    from jaxopd.rollout.prompts import PromptInputs
    observations = ["You are in the middle of a room."] + [answer for _, answer in steps]
    history = [(observations[i], action) for i, (action, _) in enumerate(steps)]
    return PromptInputs(benchmark="alfworld", instruction=instruction, history=history,
                        observation=observation if not steps else observations[-1], admissible_actions=("look",))


def test_plan_thinking_by_hand():
    """Plan thinking: the task's state and the step it calls for (the tool, then the destination)."""
    pytest.importorskip("alfworld")
    from jaxopd.methods.sft_data import thinking_text

    def plan_thinking(inputs):
        return thinking_text(inputs, "plan")
    cool = "Your task is to: cool some mug and put it in cabinet."
    assert plan_thinking(_inputs(cool, [], "You are in the middle of a room.")) == "I need a mug."
    seen = [("go to countertop 1", "You arrive at countertop 1. On the countertop 1, you see a mug 2, a mug 1.")]
    assert plan_thinking(_inputs(cool, seen, "")) == "I need a mug. I see mug 2 here."
    held = seen + [("take mug 2 from countertop 1", "You pick up the mug 2 from the countertop 1.")]
    assert plan_thinking(_inputs(cool, held, "")) == "I hold mug 2. I must cool it with a fridge."
    cooled = held + [("cool mug 2 with fridge 1", "You cool the mug 2 using the fridge 1.")]
    assert plan_thinking(_inputs(cool, cooled, "")) == "I hold mug 2, now cool. It goes in cabinet."
    clean = "Your task is to: put a clean cloth in shelf."
    cloth = [("take cloth 2 from bathtubbasin 1", "You pick up the cloth 2 from the bathtubbasin 1.")]
    assert plan_thinking(_inputs(clean, cloth, "")) == "I hold cloth 2. I must clean it with a sinkbasin."
    heat = "Your task is to: heat some egg and put it in garbagecan."
    egg = [("take egg 1 from fridge 1", "You pick up the egg 1 from the fridge 1.")]
    assert plan_thinking(_inputs(heat, egg, "")) == "I hold egg 1. I must heat it with a microwave."
    simple = "Your task is to: put some keychain on dresser."
    key = [("take keychain 3 from sofa 1", "You pick up the keychain 3 from the sofa 1.")]
    assert plan_thinking(_inputs(simple, key, "")) == "I hold keychain 3. It goes in dresser."
    two = "Your task is to: put two vase in shelf."
    assert plan_thinking(_inputs(two, [], "You are in the middle of a room.")) == "0 of 2 placed. I need a vase."
    placed = [("take vase 1 from sidetable 1", "You pick up the vase 1 from the sidetable 1."),
              ("move vase 1 to shelf 1", "You move the vase 1 to the shelf 1.")]
    assert plan_thinking(_inputs(two, placed, "")) == "1 of 2 placed. I need a vase."
    assert plan_thinking(_inputs(two, placed[:1], "")) == "0 of 2 placed. I hold vase 1. It goes in shelf."
    look = "Your task is to: look at cd under the desklamp."
    cd = [("take cd 1 from desk 1", "You pick up the cd 1 from the desk 1.")]
    assert plan_thinking(_inputs(look, cd, "")) == "I hold cd 1. I need a desklamp."
    lamp = cd + [("go to sidetable 1", "You arrive at sidetable 1. On the sidetable 1, you see a desklamp 1.")]
    assert plan_thinking(_inputs(look, lamp, "")) == "I hold cd 1. I need a desklamp. I see desklamp 1 here."
    assert thinking_text(_inputs(cool, held, ""), "plan") == "I hold mug 2. I must cool it with a fridge."
    assert thinking_text(_inputs(cool, held, ""), "none") == ""
    with pytest.raises(ValueError, match="unknown SFT thinking"):
        thinking_text(_inputs(cool, held, ""), "chain")
    with pytest.raises(ValueError, match="no ALFWorld task type"):
        plan_thinking(_inputs("Your task is to: dance.", [], "x"))


def test_walkthrough_samples_with_plan_thinking(alfworld, tok):
    from jaxopd.methods.sft_data import thinking_text
    _, _, reference = alfworld
    samples, stats = walkthrough_samples([reference], tok, max_prompt_tokens=2048, thinking="plan")
    plain, _ = walkthrough_samples([reference], tok, max_prompt_tokens=2048)
    turns = walkthrough_turns(reference)
    assert len(samples) == len(plain) == len(turns) and stats.samples == len(turns)
    for sample, plain_sample, turn in zip(samples, plain, turns):
        prompt_length = int(np.argmax(sample.loss_mask))
        assert list(sample.tokens[:prompt_length]) == list(plain_sample.tokens[:prompt_length])   # same prompt
        thought = thinking_text(turn.inputs, "plan")
        assert thought.startswith(("I need a ", "I hold ", "0 of 2 placed.", "1 of 2 placed."))
        response = tok.decode(sample.tokens[prompt_length:-1])
        assert response == response_text(turn.action, thought)
        assert extract_action(response) == turn.action
        assert int(sample.tokens[-1]) == tok.eos_token_id
    assert stats.response_tokens > sum(s.num_supervised for s in plain)
    with pytest.raises(ValueError, match="unknown SFT thinking"):
        walkthrough_samples([reference], tok, max_prompt_tokens=2048, thinking="chain")
