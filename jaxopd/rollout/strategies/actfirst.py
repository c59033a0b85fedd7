"""ActFirst-OPD rollouts: act with short action-only requests, reason asynchronously (ActFirst-OPD Sec. 4,
App. B.1-B.5), and the paper's ablations (Sec. 5.3, Table 3).

At each turn t two requests are submitted together from the same interaction context c_t = q ⊕ h_t ⊕ o_t:

* the **fast action** ã_t, executed as soon as it returns: reference-conditioned inverse dynamics
  (Sec. 4.1, the prompt adds o_{t+1}^ref) while reference guidance holds, autonomous next-action prediction
  (NAP, Sec. 4.2) after that; it stops at ``</action>`` or after 512 tokens (App. C.5);
* the **full response** y_t = (z_t, a_t) on a snapshot of c_t, without the reference (Sec. 4.3), under the
  App. B.3 thinking budget. It keeps decoding while the environment advances; its action is never executed
  and the full responses are the training samples.

Guidance (App. B.5): after every guided step the benchmark's transition check compares the executed transition
with the reference's; "a failed check permanently disables reference conditioning for the remainder of the
rollout, without resetting the environment". "An invalid reference-conditioned proposal triggers one
autonomous next-action prediction request from the unchanged interaction context before environment
execution": the NAP action is executed whatever its validity (no further request).

Decision taken here (the paper leaves it open): **guidance survives an invalid proposal when the transition
check passes.** The check "concerns the transition outcome and does not require the generated action to match
the reference action" (Sec. 4.2): it runs after the executed step whichever request produced the action, and
only a failed check disables guidance. An invalid proposal is a failed generation, not evidence that the
rollout left the reference; if the fallback action reaches o_{t+1}^ref, the reference still applies to turn
t + 1. When the reference is exhausted (t > T_ref) the fast action is NAP without disabling guidance.

Ablations (options of ``ActFirstConfig``; ``actfirst_config(name)``):
``no-id`` (NAP only, asynchronous full responses kept), ``no-nap-fallback`` (the rollout ends at the first
failed check), ``prefix-replay-50`` / ``prefix-replay-100`` (execute the first 50% / all of the reference
actions, then NAP). ``full_responses=False`` gives the App. C.5 rollout-quality collection, which "omit[s]
asynchronous full-response generation".
"""
from __future__ import annotations

import dataclasses
import math
from concurrent.futures import Future

from jaxopd_envs.base import Observation
from jaxopd_envs.checks import TransitionCheck, check_transition
from jaxopd.rollout.strategies.base import Decision, Episode, RolloutConfig, RolloutStrategy, is_action_valid

__all__ = ["ActFirstConfig", "ABLATIONS", "actfirst_config", "ActFirstStrategy"]


@dataclasses.dataclass(frozen=True)
class ActFirstConfig(RolloutConfig):
    """ActFirst-OPD options on top of ``RolloutConfig``.

    ``fast_action_max_tokens``: the action-only limit (512, App. C.5). ``inverse_dynamics``: reference
    conditioning while guidance holds (False: the ``no-id`` ablation). ``nap_fallback``: continue with NAP
    after a failed check (False: the rollout ends there). ``reference_replay_fraction``: execute the first
    ``floor(fraction * T_ref)`` reference actions verbatim, then NAP (0.5 / 1.0 ablations; None: off).
    ``full_responses``: generate the asynchronous full responses (the training samples).
    """

    fast_action_max_tokens: int = 512
    inverse_dynamics: bool = True
    nap_fallback: bool = True
    reference_replay_fraction: float | None = None
    full_responses: bool = True

    def __post_init__(self):
        super().__post_init__()
        if self.fast_action_max_tokens < 1:
            raise ValueError(f"fast_action_max_tokens must be >= 1, got {self.fast_action_max_tokens}")
        fraction = self.reference_replay_fraction
        if fraction is not None:
            if not 0.0 < fraction <= 1.0:
                raise ValueError(f"reference_replay_fraction must be in (0, 1], got {fraction}")
            if self.inverse_dynamics:
                raise ValueError("reference-prefix replay continues with next-action prediction: set "
                                 "inverse_dynamics=False (see actfirst_config('prefix-replay-50'))")

    @property
    def uses_reference(self) -> bool:
        return self.inverse_dynamics or self.reference_replay_fraction is not None


ABLATIONS: dict[str, dict] = {
    "actfirst": {},
    "no-id": {"inverse_dynamics": False},
    "no-nap-fallback": {"nap_fallback": False},
    "prefix-replay-50": {"inverse_dynamics": False, "reference_replay_fraction": 0.5},
    "prefix-replay-100": {"inverse_dynamics": False, "reference_replay_fraction": 1.0},
}


def actfirst_config(ablation: str = "actfirst", **overrides) -> ActFirstConfig:
    """The config of ActFirst-OPD (``"actfirst"``) or one of its ablations (``ABLATIONS``), plus overrides."""
    if ablation not in ABLATIONS:
        raise ValueError(f"unknown ActFirst-OPD ablation {ablation!r}; expected one of {sorted(ABLATIONS)}")
    return ActFirstConfig(**{**ABLATIONS[ablation], **overrides})


class ActFirstStrategy(RolloutStrategy):
    """ActFirst-OPD's act-first, reason-later rollouts (and, by config, its ablations)."""

    name = "actfirst"
    config: ActFirstConfig

    def __init__(self, engine, pool, tokenizer, config: ActFirstConfig | None = None, **kwargs):
        config = config if config is not None else ActFirstConfig()
        if not isinstance(config, ActFirstConfig):
            raise ValueError(f"ActFirstStrategy needs an ActFirstConfig, got {type(config).__name__}")
        super().__init__(engine, pool, tokenizer, config, **kwargs)

    @property
    def needs_reference(self) -> bool:  # type: ignore[override]
        return self.config.uses_reference

    def start_episode(self, episode: Episode) -> None:
        episode.state["guidance"] = self.config.inverse_dynamics
        fraction = self.config.reference_replay_fraction
        episode.state["replay_turns"] = 0 if fraction is None else math.floor(fraction * len(episode.reference))
        episode.state["failed_check_turn"] = 0

    def decide(self, episode: Episode) -> Decision:
        t = episode.turn
        config = self.config
        # Sec. 4.3: the full response runs on a snapshot of c_t, without the reference; both prompts are rendered
        # before either request is submitted, and the fast action is queued first (it gates the next turn), so the
        # two are "submitted together" (App. C.5) with the critical-path request ahead.
        full_prompt = self.render("full", self.prompt_inputs(episode)) if config.full_responses else None

        def submit_full() -> tuple[Future, ...]:
            return () if full_prompt is None else (self.submit_full(episode, full_prompt, role="full"),)

        if t <= episode.state["replay_turns"]:            # reference-prefix replay ablation
            return Decision(action=episode.reference.action(t), source="reference", responses=submit_full())
        reference_next = (episode.reference.next_observation(t)
                          if episode.state["guidance"] and episode.reference is not None else None)
        if reference_next is None:                        # NAP: after divergence, no-id, or reference exhausted
            nap_future = self._submit_fast_action(episode, "next_action", role="next_action")
            full = submit_full()
            nap = nap_future.result()
            return Decision(action=nap.executable_action, source="next_action", responses=full,
                            action_responses=(nap,))
        proposal_future = self._submit_fast_action(episode, "inverse_dynamics", role="inverse_dynamics",
                                                   reference_next_observation=reference_next)
        full = submit_full()
        proposal = proposal_future.result()
        if is_action_valid(episode.benchmark, proposal.action, episode.observation):
            return Decision(action=proposal.action, source="inverse_dynamics", responses=full,
                            action_responses=(proposal,), guided=True)
        # App. B.5: one NAP request from the unchanged context, executed whatever its validity
        fallback = self._submit_fast_action(episode, "next_action", role="invalid_proposal_fallback").result()
        return Decision(action=fallback.executable_action, source="next_action", responses=full,
                        action_responses=(proposal, fallback), guided=True,
                        info={"invalid_proposal": proposal.action})

    def after_step(self, episode: Episode, decision: Decision, next_observation: Observation) -> TransitionCheck | None:
        if not decision.guided:
            return None
        reference_outcome = episode.reference.next_record(episode.turn)
        check = check_transition(episode.benchmark, decision.action, episode.observation.admissible_actions,
                                 next_observation, reference_outcome)
        if not check.ok:
            episode.state["guidance"] = False               # for the rest of the rollout, no reset
            episode.state["failed_check_turn"] = episode.turn
            if not self.config.nap_fallback:
                episode.end_reason = "check_failed"
        return check

    def _submit_fast_action(self, episode: Episode, mode: str, *, role: str,
                            reference_next_observation: str | None = None) -> Future:
        """Submit an action-only request (``Future[Response]``): stops at ``</action>`` or the fast-action limit."""
        prompt_ids = self.render(mode, self.prompt_inputs(episode, reference_next_observation))
        return self.submit_action(episode, prompt_ids, mode, max_new_tokens=self.config.fast_action_max_tokens,
                                  role=role, kind=self.FAST_KIND)
