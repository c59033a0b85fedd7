"""Exact-enumeration checks of the distillation losses on a 7-token vocabulary in one context.

The student logits θ are the parameters. An expectation under a sampling policy is the exact sum over
the 7 tokens weighted by that policy's (constant) probabilities, so every identity is checked without
Monte-Carlo noise: the sampled estimators must reproduce KL(π_θ || π_T) and its gradient exactly.
"""
import chex
import jax
import jax.numpy as jnp
import numpy as np

from jaxopd import losses

VOCAB = 7
STUDENT_LOGITS = jnp.array([2.0, 0.5, -1.0, 0.0, 1.0, -0.5, 0.3])
TEACHER_LOGITS = jnp.array([0.0, 1.5, 0.5, -1.0, 1.2, 0.2, -0.8])
TOKENS = jnp.arange(VOCAB)
ONE = jnp.ones((1, 1))
VARIANTS = dict(with_jit=True, without_jit=True)


def exact_reverse_kl(student_logits):
    return losses.reverse_kl_from_logits(student_logits, TEACHER_LOGITS)


def student_probs(student_logits):
    return jax.lax.stop_gradient(jax.nn.softmax(student_logits))


def teacher_probs(_):
    return jax.nn.softmax(TEACHER_LOGITS)


def single_token(token_loss):
    """token_loss(logp, teacher_logp) on [1, 1] arrays -> loss of sampling ``token`` under θ."""
    def loss(student_logits, token):
        logp = jax.nn.log_softmax(student_logits)[token].reshape(1, 1)
        teacher_logp = jax.nn.log_softmax(TEACHER_LOGITS)[token].reshape(1, 1)
        return token_loss(logp, teacher_logp)
    return loss


def expectation(loss, sampling_probs):
    """θ -> (E_x[loss(θ, x)], E_x[∇_θ loss(θ, x)]) with x drawn from sampling_probs(θ) (held constant)."""
    def expected(student_logits):
        values, grads = jax.vmap(jax.value_and_grad(loss), in_axes=(None, 0))(student_logits, TOKENS)
        weights = sampling_probs(student_logits)
        return weights @ values, weights @ grads
    return expected


# the sampled token losses, each on one token with mask 1
def opd_on_policy(logp, teacher_logp):
    return losses.opd_loss(logp, jax.lax.stop_gradient(logp), teacher_logp, ONE)[0]


def sti_exact(teacher_generated):
    def loss(logp, teacher_logp):
        return losses.sti_importance_weighted_reverse_kl(logp, teacher_logp, jnp.array([teacher_generated]), ONE)[0]
    return loss


def sti_ppo(teacher_generated, dual_clip):
    def loss(logp, teacher_logp):
        rollout_logp = jax.lax.stop_gradient(logp)  # on-policy student tokens: ratio 1
        return losses.sti_opd_loss(logp, rollout_logp, teacher_logp, jnp.array([teacher_generated]), ONE,
                                   dual_clip=dual_clip)[0]
    return loss


def plain_log_ratio(logp, teacher_logp):
    return jnp.sum(logp - teacher_logp)


class EnumerationTest(chex.TestCase):

    def setUp(self):
        super().setUp()
        self.kl = float(exact_reverse_kl(STUDENT_LOGITS))
        self.kl_grad = np.asarray(jax.grad(exact_reverse_kl)(STUDENT_LOGITS))
        self.assertGreater(self.kl, 0.1)
        self.assertGreater(np.abs(self.kl_grad).max(), 0.05)

    def _check(self, token_loss, sampling_probs, *, value=True):
        expected = self.variant(expectation(single_token(token_loss), sampling_probs))
        mean_value, mean_grad = expected(STUDENT_LOGITS)
        if value:
            np.testing.assert_allclose(mean_value, self.kl, rtol=1e-5)
        np.testing.assert_allclose(mean_grad, self.kl_grad, rtol=1e-4, atol=1e-6)

    def test_reverse_kl_matches_numpy(self):
        p = np.exp(STUDENT_LOGITS) / np.exp(STUDENT_LOGITS).sum()
        q = np.exp(TEACHER_LOGITS) / np.exp(TEACHER_LOGITS).sum()
        np.testing.assert_allclose(self.kl, np.sum(p * np.log(p / q)), rtol=1e-6)

    @chex.variants(**VARIANTS)
    def test_importance_weighted_teacher_samples_recover_reverse_kl_and_its_gradient(self):
        """Eq. 10: E_{x~π_T}[ω ℓ] = KL(π_θ || π_T); and E_{x~π_T}[∇(ω ℓ)] = ∇ KL."""
        self._check(sti_exact(True), teacher_probs)

    @chex.variants(**VARIANTS)
    def test_unweighted_teacher_samples_do_not(self):
        """Without ω, teacher samples estimate -KL(π_T || π_θ), not the reverse KL (why Eq. 11 weights them)."""
        expected = self.variant(expectation(single_token(sti_exact(False)), teacher_probs))
        mean_value, _ = expected(STUDENT_LOGITS)
        p, q = jax.nn.softmax(STUDENT_LOGITS), jax.nn.softmax(TEACHER_LOGITS)
        np.testing.assert_allclose(mean_value, -jnp.sum(q * jnp.log(q / p)), rtol=1e-5)
        self.assertGreater(abs(float(mean_value) - self.kl), 0.1)

    @chex.variants(**VARIANTS)
    def test_opd_surrogate_under_student_sampling_has_the_reverse_kl_gradient(self):
        """ActFirst-OPD App. B.4 at ratio 1: E_{x~π_θ}[∇ l_DC] = ∇ KL(π_θ || π_T)."""
        expected = self.variant(expectation(single_token(opd_on_policy), student_probs))
        mean_value, mean_grad = expected(STUDENT_LOGITS)
        np.testing.assert_allclose(mean_value, self.kl, rtol=1e-5)  # token loss -A·1 = ℓ, mean KL
        np.testing.assert_allclose(mean_grad, self.kl_grad, rtol=1e-4, atol=1e-6)

    @chex.variants(**VARIANTS)
    def test_sti_student_tokens_have_the_reverse_kl_value_and_gradient(self):
        self._check(sti_exact(False), student_probs)

    @chex.variants(**VARIANTS)
    def test_differentiating_the_plain_log_ratio_gives_zero_expected_gradient(self):
        """Why the score-function term is needed on student tokens: E_{x~π_θ}[∇ℓ] = E[∇ log π_θ] = 0."""
        expected = self.variant(expectation(single_token(plain_log_ratio), student_probs))
        mean_value, mean_grad = expected(STUDENT_LOGITS)
        np.testing.assert_allclose(mean_value, self.kl, rtol=1e-5)
        np.testing.assert_allclose(mean_grad, np.zeros(VOCAB), atol=1e-6)

    @chex.variants(**VARIANTS)
    def test_sti_ppo_form_is_exact_on_policy_and_for_teacher_tokens_without_dual_clip(self):
        # student tokens at ratio 1
        self._check(sti_ppo(False, 3.0), student_probs, value=False)
        # teacher tokens: ratio ω, A = -log ω, so the PPO clip never binds; only the dual clip can
        self._check(sti_ppo(True, None), teacher_probs, value=False)

    @chex.variants(**VARIANTS)
    def test_sti_ppo_dual_clip_drops_teacher_tokens_with_weight_above_kappa(self):
        omega = jax.nn.softmax(STUDENT_LOGITS) / jax.nn.softmax(TEACHER_LOGITS)
        self.assertGreater(float(omega.max()), 3.0)  # precondition: some teacher token has ω > κ
        expected = self.variant(expectation(single_token(sti_ppo(True, 3.0)), teacher_probs))
        _, mean_grad = expected(STUDENT_LOGITS)
        # the expected gradient then equals ∇KL minus the dropped tokens' share Σ_{ω>3} π ℓ ∇log π
        log_p = jax.nn.log_softmax(STUDENT_LOGITS)
        ell = log_p - jax.nn.log_softmax(TEACHER_LOGITS)
        score = jax.jacobian(jax.nn.log_softmax)(STUDENT_LOGITS)  # [token, logit]
        dropped = jnp.where(omega > 3.0, jnp.exp(log_p) * ell, 0.0) @ score
        np.testing.assert_allclose(mean_grad, self.kl_grad - dropped, rtol=1e-4, atol=1e-6)
        self.assertGreater(float(jnp.abs(dropped).max()), 1e-2)


def test_mixed_batch_of_a_student_and_a_teacher_turn():
    """One student token s ~ π_θ and one teacher token t ~ π_T in a batch: Eq. 11's token mean and its
    gradient are unbiased for the reverse KL and its gradient (exact double sum over s and t)."""
    def mixed_loss(student_logits, student_token, teacher_token):
        tokens = jnp.stack([student_token, teacher_token])
        logp = jax.nn.log_softmax(student_logits)[tokens].reshape(2, 1)
        teacher_logp = jax.nn.log_softmax(TEACHER_LOGITS)[tokens].reshape(2, 1)
        return losses.sti_importance_weighted_reverse_kl(logp, teacher_logp, jnp.array([False, True]),
                                                         jnp.ones((2, 1)))[0]

    over_teacher = jax.vmap(jax.value_and_grad(mixed_loss), in_axes=(None, None, 0))
    values, grads = jax.jit(jax.vmap(over_teacher, in_axes=(None, 0, None)))(STUDENT_LOGITS, TOKENS, TOKENS)
    p, q = jax.nn.softmax(STUDENT_LOGITS), jax.nn.softmax(TEACHER_LOGITS)
    np.testing.assert_allclose(p @ values @ q, float(exact_reverse_kl(STUDENT_LOGITS)), rtol=1e-5)
    np.testing.assert_allclose(jnp.einsum("s,stv,t->v", p, grads, q), jax.grad(exact_reverse_kl)(STUDENT_LOGITS),
                               rtol=1e-4, atol=1e-6)
