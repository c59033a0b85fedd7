"""Vanilla multi-turn OPD rollouts: think-then-act, one full response per turn, its action executed.

Implements the standard interaction of ActFirst-OPD Sec. 3 ("Multi-Turn Agent Interaction"): at turn t the
student generates a full response y_t = (z_t, a_t) from c_t = q ⊕ h_t ⊕ o_t under the App. B.3 thinking budget
and only a_t is executed; h_t records (o_i, a_i) without past reasoning (App. B.2). App. B.3: "responses
marked as truncated are treated as empty actions" (the empty string is executed, an invalid attempt); an
unparsable response executes the empty action too. Every full response is a training sample.
"""
from __future__ import annotations

from jaxopd.rollout.strategies.base import Decision, Episode, RolloutStrategy

__all__ = ["VanillaStrategy"]


class VanillaStrategy(RolloutStrategy):
    """Think-then-act rollouts (the Vanilla OPD baseline of all three papers)."""

    name = "vanilla"

    def decide(self, episode: Episode) -> Decision:
        prompt_ids = self.render("full", self.prompt_inputs(episode))
        response = self.submit_full(episode, prompt_ids, role="full").result()
        return Decision(action=response.executable_action, source="full", responses=(response,))
