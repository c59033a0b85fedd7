"""Value tests of jaxopd.losses against hand-computed numbers (jit and no-jit variants)."""
import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxopd import losses

LOG2 = math.log(2.0)
VARIANTS = dict(with_jit=True, without_jit=True)


class ClippedSurrogateTest(chex.TestCase):

    # (advantage, ratio) -> (token loss, PPO clip active, dual clip active) with δ = 0.2, κ = 3
    CASES = [
        (1.0, 1.5, -1.2, True, False),    # A > 0, ratio above 1 + δ: clipped
        (1.0, 0.5, -0.5, False, False),   # A > 0, ratio below 1 - δ: min picks the unclipped term
        (1.0, 1.1, -1.1, False, False),   # inside the trust region
        (-1.0, 0.5, 0.8, True, False),    # A < 0, ratio below 1 - δ: clipped at 1 - δ
        (-1.0, 1.5, 1.5, False, False),   # A < 0, ratio above 1 + δ: max picks the unclipped term
        (-1.0, 4.0, 3.0, False, True),    # A < 0, ratio > κ: capped at -κ A
        (2.0, 4.0, -2.4, True, False),    # A > 0 is never dual-clipped
        (-2.0, 2.5, 5.0, False, False),   # A < 0, 1 + δ < ratio < κ: unclipped
        (0.0, 3.0, 0.0, False, False),
    ]

    def _inputs(self):
        advantages = jnp.array([[c[0] for c in self.CASES]])
        logp = jnp.log(jnp.array([[c[1] for c in self.CASES]]))
        return logp, jnp.zeros_like(logp), advantages

    @chex.variants(**VARIANTS)
    def test_token_loss_clip_and_dual_clip_on_both_signs(self):
        logp, behavior, advantages = self._inputs()
        token_loss = self.variant(losses.clipped_surrogate_token_loss)
        terms = token_loss(logp, behavior, advantages)
        np.testing.assert_allclose(terms.loss[0], [c[2] for c in self.CASES], rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(terms.ratio[0], [c[1] for c in self.CASES], rtol=1e-6)
        np.testing.assert_array_equal(terms.clipped[0], [c[3] for c in self.CASES])
        np.testing.assert_array_equal(terms.dual_clipped[0], [c[4] for c in self.CASES])
        # d loss / d logp = -A r where the unclipped term is active, 0 where a clip is.
        grad = jax.grad(lambda lp: jnp.sum(token_loss(lp, behavior, advantages).loss))(logp)
        expected = [0.0 if clip or dual else -a * r for a, r, _, clip, dual in self.CASES]
        np.testing.assert_allclose(grad[0], expected, rtol=1e-6, atol=1e-7)

    @chex.variants(**VARIANTS)
    def test_without_dual_clip_and_with_asymmetric_clip(self):
        logp = jnp.log(jnp.array([[4.0, 1.5, 0.5]]))
        advantages = jnp.array([[-1.0, 1.0, -1.0]])
        no_dual = self.variant(functools.partial(losses.clipped_surrogate_token_loss, dual_clip=None))
        np.testing.assert_allclose(no_dual(logp, jnp.zeros_like(logp), advantages).loss[0], [4.0, -1.2, 0.8],
                                   rtol=1e-6)
        clip_higher = self.variant(functools.partial(losses.clipped_surrogate_token_loss, clip_eps_high=0.28))
        np.testing.assert_allclose(clip_higher(logp, jnp.zeros_like(logp), advantages).loss[0], [3.0, -1.28, 0.8],
                                   rtol=1e-6)

    @chex.variants(**VARIANTS)
    def test_log_ratio_is_clipped_to_20_before_exp(self):
        logp = jnp.array([[30.0, -30.0]])
        terms = self.variant(functools.partial(losses.clipped_surrogate_token_loss, dual_clip=None))(
            logp, jnp.zeros_like(logp), jnp.array([[-1.0, 1.0]]))
        np.testing.assert_allclose(terms.ratio[0], [math.exp(20.0), math.exp(-20.0)], rtol=1e-5)
        np.testing.assert_allclose(terms.loss[0], [math.exp(20.0), -math.exp(-20.0)], rtol=1e-5)

    @chex.variants(**VARIANTS)
    def test_aggregation_modes_with_an_empty_row(self):
        token_loss = jnp.array([[1.0, 2.0, 3.0], [4.0, jnp.nan, jnp.inf], [7.0, 8.0, 9.0]])
        mask = jnp.array([[1, 0, 0], [0, 0, 0], [1, 1, 1]], dtype=bool)
        expected = {"token-mean": (1 + 7 + 8 + 9) / 4,          # 6.25
                    "seq-mean-token-mean": (1 / (1 + 1e-8) + 24 / (3 + 1e-8)) / 2,  # 4.5: the empty row is padding
                    "seq-mean-token-sum": (1 + 24) / 2}           # 12.5
        padded_loss = jnp.concatenate([token_loss, jnp.full((2, 3), 5.0)])
        padded_mask = jnp.concatenate([mask, jnp.zeros((2, 3), bool)])
        for mode, value in expected.items():
            aggregate = self.variant(functools.partial(losses.aggregate_token_loss, aggregation=mode))
            np.testing.assert_allclose(aggregate(token_loss, mask), value, rtol=1e-6, err_msg=mode)
            np.testing.assert_allclose(aggregate(padded_loss, padded_mask), value, rtol=1e-6, err_msg=mode)
            np.testing.assert_array_equal(aggregate(token_loss, jnp.zeros_like(mask)), 0.0)

    @chex.variants(**VARIANTS)
    def test_seq_mean_token_mean_weights_responses_equally(self):
        token_loss = jnp.array([[2.0, 4.0, 0.0, 0.0], [1.0, 1.0, 1.0, 5.0]])
        mask = jnp.array([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
        seq = self.variant(functools.partial(losses.aggregate_token_loss, aggregation="seq-mean-token-mean"))
        token = self.variant(functools.partial(losses.aggregate_token_loss, aggregation="token-mean"))
        np.testing.assert_allclose(seq(token_loss, mask), (3.0 + 2.0) / 2, rtol=1e-6)
        np.testing.assert_allclose(token(token_loss, mask), 14.0 / 6, rtol=1e-6)

    @chex.variants(**VARIANTS)
    def test_clipped_surrogate_loss_value_and_metrics(self):
        logp, behavior, advantages = self._inputs()
        mask = jnp.ones_like(logp).at[0, 8].set(0.0)  # drop the A = 0 case
        loss, metrics = self.variant(losses.clipped_surrogate_loss)(logp, behavior, advantages, mask)
        cases = self.CASES[:8]
        np.testing.assert_allclose(loss, sum(c[2] for c in cases) / 8, rtol=1e-6)
        np.testing.assert_allclose(metrics["clip_fraction"], 3 / 8)
        np.testing.assert_allclose(metrics["dual_clip_fraction"], 1 / 8)
        np.testing.assert_allclose(metrics["ratio_mean"], sum(c[1] for c in cases) / 8, rtol=1e-6)
        np.testing.assert_allclose(metrics["ratio_max"], 4.0, rtol=1e-6)
        np.testing.assert_allclose(metrics["approx_kl"], -sum(math.log(c[1]) for c in cases) / 8, rtol=1e-5)
        np.testing.assert_allclose(metrics["advantage_mean"], sum(c[0] for c in cases) / 8, rtol=1e-6)
        np.testing.assert_allclose(metrics["supervised_tokens"], 8.0)

    def test_bad_inputs_raise_value_errors(self):
        x = jnp.zeros((2, 3))
        with pytest.raises(ValueError, match="aggregation"):
            losses.clipped_surrogate_loss(x, x, x, x, aggregation="sum")
        with pytest.raises(ValueError, match="dual_clip"):
            losses.clipped_surrogate_loss(x, x, x, x, dual_clip=1.0)
        with pytest.raises(ValueError, match="clipped_surrogate_loss"):
            losses.clipped_surrogate_loss(x, x, jnp.zeros((2, 4)), x)
        with pytest.raises(ValueError, match="clipped_surrogate_loss"):
            losses.clipped_surrogate_loss(x[0], x[0], x[0], x[0])
        with pytest.raises(ValueError, match="opd_loss|opd_token_advantages"):
            losses.opd_loss(jnp.zeros((2, 3), jnp.int32), x, x, x)


class OPDLossTest(chex.TestCase):

    LOGP = [[-1.0, -2.0, -0.5], [-1.5, -3.0, -1.0]]
    TEACHER_LOGP = [[-1.2, -1.0, -0.5], [-1.0, -3.5, -2.0]]
    MASK = [[1, 1, 0], [1, 0, 1]]  # row 0: padding at the end; row 1: an inserted token in the middle

    @chex.variants(**VARIANTS)
    def test_advantage_is_negative_sampled_reverse_kl(self):
        advantages = self.variant(losses.opd_token_advantages)(
            jnp.array(self.LOGP), jnp.array(self.TEACHER_LOGP), jnp.array(self.MASK))
        np.testing.assert_allclose(advantages, [[-0.2, 1.0, 0.0], [0.5, 0.0, -1.0]], atol=1e-6)

    @chex.variants(**VARIANTS)
    def test_on_policy_loss_and_gradient(self):
        logp, teacher, mask = jnp.array(self.LOGP), jnp.array(self.TEACHER_LOGP), jnp.array(self.MASK)
        opd = self.variant(losses.opd_loss)
        loss, metrics = opd(logp, logp, teacher, mask)
        # ratio 1: token loss = -A = [[0.2, -1], [-0.5, ., 1]]; seq-mean-token-mean = mean(-0.4, 0.25)
        np.testing.assert_allclose(loss, -0.075, atol=1e-6)
        np.testing.assert_allclose(metrics["sampled_reverse_kl"], (0.2 - 1.0 - 0.5 + 1.0) / 4, atol=1e-6)
        np.testing.assert_allclose(metrics["clip_fraction"], 0.0)
        # d/dlogp = -A r / (tokens in row * rows); the advantage carries no gradient
        grad = jax.grad(lambda lp: opd(lp, logp, teacher, mask)[0])(logp)
        np.testing.assert_allclose(grad, [[0.05, -0.25, 0.0], [-0.125, 0.0, 0.25]], atol=1e-6)

    @chex.variants(**VARIANTS)
    def test_off_policy_ratio_is_clipped(self):
        logp, teacher, mask = jnp.array(self.LOGP), jnp.array(self.TEACHER_LOGP), jnp.array(self.MASK)
        # token (0, 1) has A = 1 and ratio 1.5 (> 1 + δ): clipped to 1.2, no gradient
        behavior = logp.at[0, 1].add(-math.log(1.5))
        opd = self.variant(losses.opd_loss)
        loss, metrics = opd(logp, behavior, teacher, mask)
        np.testing.assert_allclose(loss, ((0.2 - 1.2) / 2 + 0.25) / 2, atol=1e-6)
        np.testing.assert_allclose(metrics["clip_fraction"], 0.25)
        grad = jax.grad(lambda lp: opd(lp, behavior, teacher, mask)[0])(logp)
        np.testing.assert_allclose(grad, [[0.05, 0.0, 0.0], [-0.125, 0.0, 0.25]], atol=1e-6)

    @chex.variants(**VARIANTS)
    def test_reverse_kl_from_logits(self):
        student = jnp.array([[0.0, math.log(3.0)], [1.0, 1.0]])
        teacher = jnp.array([[0.0, 0.0], [0.0, -jnp.inf]])
        kl = self.variant(losses.reverse_kl_from_logits)(student, teacher)
        # row 0: π = (1/4, 3/4), π_T = (1/2, 1/2); row 1: π puts mass where π_T has none -> inf
        np.testing.assert_allclose(kl[0], 0.25 * math.log(0.5) + 0.75 * math.log(1.5), rtol=1e-6)
        self.assertTrue(np.isinf(kl[1]))
        np.testing.assert_allclose(
            self.variant(losses.reverse_kl_from_logits)(jnp.array([[0.0, -jnp.inf]]), jnp.array([[0.0, 0.0]])),
            [math.log(2.0)], rtol=1e-6)


class STITest(chex.TestCase):

    @chex.variants(**VARIANTS)
    def test_k3_turn_score_and_intervention_probability(self):
        student = jnp.array([[-1.0, -1.0, -1.0]])
        teacher = jnp.array([[-1.0 + LOG2, -1.0 - LOG2, 5.0]])  # r = 2, 1/2, and a masked token
        mask = jnp.array([[1, 1, 0]])
        score = self.variant(losses.sti_turn_discrepancy)(student, teacher, mask)
        # (2 - 1 - log 2 + 1/2 - 1 + log 2) / 2 = 0.25
        np.testing.assert_allclose(score, [0.25], rtol=1e-6)
        probability = self.variant(losses.sti_intervention_probability)
        np.testing.assert_allclose(probability(score), [0.2], rtol=1e-6)
        np.testing.assert_allclose(probability(jnp.array([0.0, 1.0, 3.0, 9.0])), [0.0, 0.5, 0.75, 0.9], rtol=1e-6)

    @chex.variants(**VARIANTS)
    def test_k3_is_non_negative_and_zero_iff_policies_agree(self):
        rng = np.random.default_rng(0)
        student = jnp.asarray(-rng.exponential(2.0, size=(6, 5)), jnp.float32)
        teacher = jnp.asarray(-rng.exponential(2.0, size=(6, 5)), jnp.float32)
        mask = jnp.asarray(rng.random((6, 5)) < 0.7).at[:, 0].set(True)
        score = self.variant(losses.sti_turn_discrepancy)
        differ = score(student, teacher, mask)
        self.assertTrue(np.all(np.asarray(differ) > 0))
        np.testing.assert_array_equal(score(student, student, mask), np.zeros(6))
        # disagreement only on masked tokens does not count; on one supervised token it does
        only_masked = jnp.where(mask, student, student - 1.0)
        np.testing.assert_array_equal(score(student, only_masked, mask), np.zeros(6))
        one_token = student.at[2, 0].add(0.3)
        np.testing.assert_array_equal(np.asarray(score(student, one_token, mask)) > 0, [0, 0, 1, 0, 0, 0])
        alpha = np.asarray(losses.sti_intervention_probability(differ))
        self.assertTrue(np.all((alpha > 0) & (alpha < 1)))

    @chex.variants(**VARIANTS)
    def test_importance_weighted_reverse_kl_value_and_gradient(self):
        # row 0 student turn with ℓ = (0.5, -0.2); row 1 teacher turn with ℓ = (log 2, -log 2), ω = (2, 1/2)
        teacher_logp = jnp.array([[-1.0, -2.0], [-1.5, -0.5]])
        logp = teacher_logp + jnp.array([[0.5, -0.2], [LOG2, -LOG2]])
        teacher_generated = jnp.array([False, True])
        mask = jnp.ones((2, 2))
        objective = self.variant(losses.sti_importance_weighted_reverse_kl)
        loss, metrics = objective(logp, teacher_logp, teacher_generated, mask)
        np.testing.assert_allclose(loss, (0.5 - 0.2 + 2 * LOG2 - 0.5 * LOG2) / 4, rtol=1e-6)
        np.testing.assert_allclose(metrics["teacher_token_fraction"], 0.5)
        np.testing.assert_allclose(metrics["importance_weight_mean"], 1.25, rtol=1e-6)
        # student tokens: (1 + ℓ)/N (score-function form); teacher tokens: d(ωℓ)/dlogp = ω(1 + ℓ), /N
        grad = jax.grad(lambda lp: objective(lp, teacher_logp, teacher_generated, mask)[0])(logp)
        np.testing.assert_allclose(grad, np.array([[1.5, 0.8], [2 * (1 + LOG2), 0.5 * (1 - LOG2)]]) / 4, rtol=1e-6)
        per_token_flag = jnp.broadcast_to(teacher_generated[:, None], (2, 2))
        np.testing.assert_allclose(objective(logp, teacher_logp, per_token_flag, mask)[0], loss, rtol=1e-7)

    @chex.variants(**VARIANTS)
    def test_ppo_form_uses_teacher_behaviour_on_teacher_tokens(self):
        teacher_logp = jnp.array([[-1.0, -2.0], [-1.5, -0.5]])
        logp = teacher_logp + jnp.array([[0.3, -0.4], [math.log(1.1), math.log(4.0)]])
        rollout_logp = logp.at[1].set(-7.0)  # ignored on the teacher turn
        teacher_generated = jnp.array([False, True])
        mask = jnp.ones((2, 2))
        sti = self.variant(losses.sti_opd_loss)
        loss, metrics = sti(logp, rollout_logp, teacher_logp, teacher_generated, mask)
        # student tokens: ratio 1, loss -A = ℓ; teacher tokens: ratio ω, A = -log ω < 0:
        # ω = 1.1 -> ω log ω; ω = 4 > κ = 3 -> capped at 3 log 4
        expected_tokens = [0.3, -0.4, 1.1 * math.log(1.1), 3 * math.log(4.0)]
        np.testing.assert_allclose(loss, sum(expected_tokens) / 4, rtol=1e-6)
        np.testing.assert_allclose(metrics["dual_clip_fraction"], 0.25)
        np.testing.assert_allclose(metrics["ratio_mean"], (1 + 1 + 1.1 + 4) / 4, rtol=1e-6)
        np.testing.assert_allclose(metrics["teacher_token_fraction"], 0.5)
        grad = jax.grad(lambda lp: sti(lp, rollout_logp, teacher_logp, teacher_generated, mask)[0])(logp)
        np.testing.assert_allclose(grad, np.array([[0.3, -0.4], [1.1 * math.log(1.1), 0.0]]) / 4, rtol=1e-5,
                                   atol=1e-7)
        np.testing.assert_allclose(
            losses.sti_behavior_logp(rollout_logp, teacher_logp, teacher_generated),
            [[logp[0, 0], logp[0, 1]], [-1.5, -0.5]])


class ActionOPDTest(chex.TestCase):
    # The host-side rewards from action strings are tested in tests/rollout/test_actions.py.

    @chex.variants(**VARIANTS)
    def test_array_rewards(self):
        reward = self.variant(functools.partial(losses.action_agreement_reward, num_teacher_samples=3,
                                                match_bonus_scale=0.5))
        np.testing.assert_allclose(reward(jnp.array([2, 1, 0, 0]), jnp.array([True, True, True, False])),
                                   [1.25, 1.0, 0.0, -1.0])
        raw_count = self.variant(functools.partial(losses.action_agreement_reward, num_teacher_samples=3,
                                                   match_bonus_scale=2.0))  # λ = K - 1: raw count
        np.testing.assert_allclose(raw_count(jnp.array([3, 2, 1, 0]), jnp.ones(4, bool)), [3.0, 2.0, 1.0, 0.0])
        binary = self.variant(functools.partial(losses.action_agreement_reward, num_teacher_samples=3,
                                                match_bonus_scale=0.0))
        np.testing.assert_allclose(binary(jnp.array([3, 1, 0]), jnp.array([True, True, False])), [1.0, 1.0, -1.0])

    @chex.variants(**VARIANTS)
    def test_group_centering_and_batch_whitening(self):
        rewards = jnp.array([[1.25, 1.0, 0.0, -1.0],   # retained: mean 0.3125
                             [1.0, 1.0, 1.0, 1.0],     # equal rewards: dropped
                             [0.0, 1.0, jnp.nan, 9.0],  # two real candidates (mean 0.5), two padding slots
                             [1.0, 0.0, 0.0, 0.0],     # one real candidate: dropped
                             [1.0, 0.0, -1.0, 0.0]])   # no teacher supervision: dropped
        candidates = jnp.array([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1]], dtype=bool)
        supervised = jnp.array([True, True, True, True, False])
        result = self.variant(losses.action_group_advantages)(rewards, candidates, supervised)
        centred = np.array([[0.9375, 0.6875, -0.3125, -1.3125], [0] * 4, [-0.5, 0.5, 0, 0], [0] * 4, [0] * 4])
        # population std over the 6 retained candidates: (0.9375² + 0.6875² + 0.3125² + 1.3125² + 2·0.25) / 6
        sigma = math.sqrt(3.671875 / 6)
        np.testing.assert_allclose(result.reward_std, sigma, rtol=1e-6)
        np.testing.assert_allclose(result.advantages, centred / (sigma + 1e-8), rtol=1e-6, atol=1e-7)
        np.testing.assert_array_equal(result.retained, [[1, 1, 1, 1], [0] * 4, [1, 1, 0, 0], [0] * 4, [0] * 4])

    @chex.variants(**VARIANTS)
    def test_group_range_threshold_and_empty_batch(self):
        advantages = self.variant(losses.action_group_advantages)
        nearly_equal = advantages(jnp.array([[1.0, 1.0 + 5e-9]]), jnp.ones((1, 2), bool))
        np.testing.assert_array_equal(nearly_equal.retained, [[False, False]])
        np.testing.assert_array_equal(nearly_equal.advantages, [[0.0, 0.0]])
        np.testing.assert_array_equal(nearly_equal.reward_std, 0.0)

    @chex.variants(**VARIANTS)
    def test_loss_is_an_active_token_mean_over_retained_responses(self):
        logp = jnp.array([[-1.0, -2.0, -0.5], [-0.3, -0.1, -4.0], [-2.0, -2.0, -2.0]])
        mask = jnp.array([[1, 1, 0], [1, 0, 0], [1, 1, 0]])
        response_advantages = jnp.array([1.0, -0.5, 7.0])
        retained = jnp.array([True, True, False])
        loss_fn = self.variant(losses.actionopd_loss)
        loss, metrics = loss_fn(logp, logp, response_advantages, retained, mask)
        np.testing.assert_allclose(loss, -(1.0 + 1.0 - 0.5) / 3, rtol=1e-6)
        np.testing.assert_allclose(metrics["supervised_tokens"], 3.0)
        # off-policy: ratio 1.5 on a positive-advantage token is clipped at 1.2
        behavior = logp.at[0, 0].add(-math.log(1.5))
        loss, metrics = loss_fn(logp, behavior, response_advantages, retained, mask)
        np.testing.assert_allclose(loss, -(1.2 + 1.0 - 0.5) / 3, rtol=1e-6)
        np.testing.assert_allclose(metrics["clip_fraction"], 1 / 3, rtol=1e-6)
        with pytest.raises(ValueError, match="actionopd_loss"):
            losses.actionopd_loss(logp, logp, response_advantages[:2], retained, mask)
