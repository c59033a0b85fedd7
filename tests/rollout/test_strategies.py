"""Rollout strategies (Vanilla, ActFirst-OPD and its ablations, STI-OPD, ActionOPD) over scripted engines and a
scripted environment: every paper rule is triggered by outputs chosen for it; the record and its one conversion
to training samples; teacher scoring. The real engine and environments are in test_strategies_engine.py.

``ScriptedEngine`` answers every request at once with text a script picks from the decoded prompt (generation
mode, turn, stage), encoded with the real Qwen3 tokenizer and cut as the real engine cuts it (stop strings,
``max_new_tokens``). ``CorridorEnv`` is a small ALFWorld-like environment: walk forward, take the key, open the
door; its walkthrough is the reference.
"""
from __future__ import annotations

import dataclasses
import math
import re
import threading
import time
from concurrent.futures import Future
from typing import Callable

import jax
import numpy as np
import pytest
from flax import nnx

from fake_envs import CORRIDOR_WALKTHROUGH, CorridorEnv, corridor_task
from jaxopd_envs.base import EnvError
from jaxopd_envs.pool import EnvPool
from jaxopd_envs.references import build_reference
from jaxopd.rollout.scoring import CallableScorer, DenseTeacherScorer, as_teacher_scorer
from jaxopd.rollout.strategies import (
    ActFirstStrategy,
    ActionOPDConfig,
    ActionOPDStrategy,
    RolloutConfig,
    STIConfig,
    STIStrategy,
    VanillaStrategy,
    actfirst_config,
    assign_group_advantages,
    collection_samples,
)
from jaxopd.rollout.thinking import ThinkingBudget, early_stop_text
from jaxopd.rollout.trajectory import EpisodeOutcome, EpisodesFailed, Response, response_to_sample, rollout_quality
from jaxopd.sampler.types import Request, Result, Timings
from jaxopd.tokenizer import Qwen3Tokenizer


# ----------------------------------------------------------------------------------------------------------- fakes
@dataclasses.dataclass(frozen=True)
class SeenRequest:
    """What a script sees of a request."""

    request: Request
    prompt_text: str
    mode: str            # full | next_action | inverse_dynamics
    turn: int            # "You are now at step t"
    stage: int           # 1, or 2 for the continuation of budgeted thinking
    index: int           # how many requests of this (mode, turn, stage, kind) came before

    @property
    def kind(self) -> str:
        return self.request.kind


def prompt_mode(prompt_text: str) -> str:
    if "Target next observation" in prompt_text:
        return "inverse_dynamics"
    if "Respond with only that action" in prompt_text:
        return "next_action"
    return "full"


class ScriptedEngine:
    """``submit(Request) -> Future[Result]`` with outputs ``script(seen) -> text`` (or ``(text, logprob)``)."""

    def __init__(self, tokenizer, script: Callable[[SeenRequest], str | tuple[str, float]], *,
                 logprob: float = -1.0):
        self.tokenizer = tokenizer
        self.script = script
        self.logprob = logprob
        self.seen: list[SeenRequest] = []
        self._lock = threading.Lock()
        self._counts: dict[tuple, int] = {}

    def submit(self, request: Request) -> Future:
        text = self.tokenizer.decode(request.prompt_ids)
        step = re.findall(r"You are now at step (\d+)\.", text)
        stage = 2 if request.request_id.endswith("/stage2") else 1
        mode = prompt_mode(text)
        key = (mode, int(step[0]) if step else 0, stage, request.kind)
        with self._lock:
            index = self._counts.get(key, 0)
            self._counts[key] = index + 1
            seen = SeenRequest(request, text, mode, key[1], stage, index)
            self.seen.append(seen)
        answer = self.script(seen)
        answer, logprob = answer if isinstance(answer, tuple) else (answer, self.logprob)
        ids = self.tokenizer.encode(answer)
        params = request.params
        finish = "stop"
        if params.stop_strings:                       # stop right after the token that completes a stop string
            for n in range(1, len(ids) + 1):
                if any(s in self.tokenizer.decode(ids[:n]) for s in params.stop_strings):
                    ids = ids[:n]
                    break
        if len(ids) >= params.max_new_tokens:
            finish = "length" if len(ids) > params.max_new_tokens else finish
            ids = ids[:params.max_new_tokens]
        if not ids:
            ids = [self.tokenizer.eos_token_id]
        now = time.perf_counter()
        result = Result(request_id=request.request_id, kind=request.kind, prompt_ids=tuple(request.prompt_ids),
                        token_ids=list(ids), text=self.tokenizer.decode(ids),
                        logprobs=np.full(len(ids), logprob, np.float32), finish_reason=finish,
                        timings=Timings(now, now, now, now))
        future: Future = Future()
        future.set_result(result)
        return future

    def requests(self, *, mode: str | None = None, turn: int | None = None, kind: str | None = None,
                 stage: int | None = None) -> list[SeenRequest]:
        return [s for s in self.seen if (mode is None or s.mode == mode) and (turn is None or s.turn == turn)
                and (kind is None or s.kind == kind) and (stage is None or s.stage == stage)]


def full_text(action: str | None, thought: str = "I think.") -> str:
    """A think-then-act response (``action=None``: no action tag)."""
    answer = f"<action>{action}</action>" if action is not None else "I am not sure."
    return f"<think>\n{thought}\n</think>\n\n{answer}"


def action_text(action: str) -> str:
    return f"<action>{action}</action>"


# ----------------------------------------------------------------------------------------------- environment
# CorridorEnv, CORRIDOR_WALKTHROUGH and corridor_task: tests/fake_envs.py


# ----------------------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def tok():
    return Qwen3Tokenizer()


@pytest.fixture
def pool():
    with EnvPool(CorridorEnv, num_slots=2, backend="thread", call_timeout_s=None) as environments:
        yield environments


@pytest.fixture(scope="module")
def reference():
    return build_reference(CorridorEnv(), corridor_task(0))


def decoded(tok, ids) -> str:
    return tok.decode([int(i) for i in ids])


# ----------------------------------------------------------------------------------------------------------- vanilla
def test_vanilla_executes_each_full_response_and_converts_it_to_a_sample(tok, pool):
    engine = ScriptedEngine(tok, lambda s: full_text("go forward"), logprob=-0.75)
    strategy = VanillaStrategy(engine, pool, tok, RolloutConfig(max_turns=2), policy_version=3)
    trajectory = strategy.run_episode(0, corridor_task())
    assert trajectory.end_reason == "max_turns" and trajectory.actions == ("go forward", "go forward")
    assert [t.action_source for t in trajectory.turns] == ["full", "full"]
    assert [s.kind for s in engine.seen] == ["full", "full"] and {s.mode for s in engine.seen} == {"full"}
    assert "[Step 1 action] go forward" in decoded(tok, trajectory.turns[1].responses[0].prompt_ids)
    samples = trajectory.samples()
    assert len(samples) == 2
    for turn, sample in zip(trajectory.turns, samples):
        response = turn.responses[0]
        prompt, length = len(response.prompt_ids), len(response.response_ids)
        assert decoded(tok, response.response_ids) == full_text("go forward")
        np.testing.assert_array_equal(sample.tokens, np.concatenate([response.prompt_ids, response.response_ids]))
        assert len(sample) == prompt + length
        assert not sample.loss_mask[:prompt].any() and sample.loss_mask[prompt:].all()
        np.testing.assert_array_equal(sample.behavior_logp[:prompt], 0.0)
        np.testing.assert_allclose(sample.behavior_logp[prompt:], -0.75)
        assert sample.policy_version == 3 and sample.teacher_logp is None and not sample.teacher_generated.any()
        assert sample.retained and sample.advantage == 0.0


def test_vanilla_truncated_response_is_an_empty_action_and_inserted_tokens_are_masked(tok, pool):
    budget = ThinkingBudget(first_stage_tokens=16, total_tokens=64, second_stage_max_tokens=6)

    def script(seen):
        return "<think>\n" + "hmm " * 60 if seen.stage == 1 else "still thinking " * 10

    engine = ScriptedEngine(tok, script)
    strategy = VanillaStrategy(engine, pool, tok, RolloutConfig(max_turns=1, thinking_budget=budget))
    trajectory = strategy.run_episode(0, corridor_task())
    turn = trajectory.turns[0]
    response = turn.responses[0]
    assert response.truncated and response.action is None and turn.action == ""     # App. B.3: empty action
    assert pool.trajectory(0).actions == ("",)
    assert turn.next_observation.text == "Nothing happens." and not turn.next_observation.last_action_valid
    inserted = len(tok.encode(early_stop_text(False)))
    assert len(response.response_ids) == 16 + inserted + 6
    np.testing.assert_array_equal(response.model_generated, [True] * 16 + [False] * inserted + [True] * 6)
    sample = response_to_sample(response)
    prompt = len(response.prompt_ids)
    assert sample.num_supervised == 22 and not sample.loss_mask[prompt + 16:prompt + 16 + inserted].any()
    np.testing.assert_array_equal(sample.behavior_logp[prompt + 16:prompt + 16 + inserted], 0.0)
    assert trajectory.quality_record().steps[0].valid is False and trajectory.quality_record().steps[0].action is None


def test_vanilla_unparsable_response_is_an_empty_action_too(tok, pool):
    engine = ScriptedEngine(tok, lambda s: full_text(None))
    trajectory = VanillaStrategy(engine, pool, tok, RolloutConfig(max_turns=1)).run_episode(0, corridor_task())
    response = trajectory.turns[0].responses[0]
    assert not response.truncated and response.action is None and trajectory.actions == ("",)


def test_vanilla_episode_ends_when_the_environment_is_done(tok, pool):
    def script(seen):
        return full_text(CORRIDOR_WALKTHROUGH[seen.turn - 1])

    trajectory = VanillaStrategy(ScriptedEngine(tok, script), pool, tok).run_episode(1, corridor_task())
    assert trajectory.end_reason == "done" and trajectory.won and trajectory.actions == CORRIDOR_WALKTHROUGH
    quality = rollout_quality([trajectory])
    assert quality.num_tasks == 1 and quality.mean_turns == 5 and quality.successful_yield == pytest.approx(20.0)


def test_an_over_budget_prompt_ends_the_rollout(tok, pool):
    engine = ScriptedEngine(tok, lambda s: full_text("look"))
    trajectory = VanillaStrategy(engine, pool, tok, RolloutConfig(max_prompt_tokens=40)).run_episode(0, corridor_task())
    assert trajectory.end_reason == "prompt_over_budget" and trajectory.num_turns == 0 and engine.seen == []


def test_full_responses_get_the_same_seeds_under_every_strategy(tok, pool, reference):
    def script(seen):
        return full_text("go forward") if seen.mode == "full" else action_text("go forward")

    vanilla, actfirst = ScriptedEngine(tok, script), ScriptedEngine(tok, script)
    VanillaStrategy(vanilla, pool, tok, RolloutConfig(max_turns=3)).run_episode(0, corridor_task())
    ActFirstStrategy(actfirst, pool, tok, actfirst_config(max_turns=3)).run_episode(0, corridor_task(), reference)
    seeds = [[s.request.params.seed for s in engine.requests(mode="full")] for engine in (vanilla, actfirst)]
    assert seeds[0] == seeds[1] and len(set(seeds[0])) == 3


def test_collect_plays_tasks_concurrently_over_the_slots(tok, pool):
    tasks = [corridor_task(i) for i in range(3)]
    engine = ScriptedEngine(tok, lambda s: full_text("look"))
    trajectories = VanillaStrategy(engine, pool, tok, RolloutConfig(max_turns=2)).collect(tasks)
    assert [t.task.task_id for t in trajectories] == [t.task_id for t in tasks]
    assert all(t.num_turns == 2 and t.actions == ("look", "look") for t in trajectories)


class BrokenGameCorridorEnv(CorridorEnv):
    """A corridor whose task ``corridor/train/1`` is a broken game: every step of it raises."""

    def reset(self, task):
        self.task_id = task.task_id
        return super().reset(task)

    def step(self, action):
        if self.task_id == "corridor/train/1":
            raise RuntimeError("broken game")
        return super().step(action)


def test_play_reports_a_failed_episode_with_its_reason_and_keeps_the_others(tok):
    tasks = [corridor_task(i) for i in range(3)]
    engine = ScriptedEngine(tok, lambda s: full_text("go forward"))
    with EnvPool(BrokenGameCorridorEnv, num_slots=2, backend="thread", call_timeout_s=None) as pool:
        strategy = VanillaStrategy(engine, pool, tok, RolloutConfig(max_turns=3))
        outcomes = strategy.play(tasks, seeds=[11, 12, 13])
        assert [(o.index, o.task.task_id) for o in outcomes] == [(i, t.task_id) for i, t in enumerate(tasks)]
        assert [o.ok for o in outcomes] == [True, False, True]
        failed = outcomes[1]
        assert failed.trajectory is None and failed.error.startswith("EnvError: slot ")
        assert "failed after 2 attempt(s): RuntimeError: broken game" in failed.error
        for outcome, seed in zip((outcomes[0], outcomes[2]), (11, 13)):
            trajectory = outcome.trajectory
            assert outcome.error is None and trajectory.task.task_id == outcome.task.task_id
            assert trajectory.actions == ("go forward",) * 3 and trajectory.end_reason == "max_turns"
            assert trajectory.info["seed"] == seed
        assert pool.recoveries == 2          # the broken game's two attempts; nothing else was rebuilt

        with pytest.raises(EpisodesFailed) as raised:
            strategy.collect(tasks)
        error = raised.value
        assert isinstance(error, RuntimeError) and isinstance(error.__cause__, EnvError)
        assert "1 of 3 episodes failed" in str(error) and "[1] corridor/train/1: EnvError: slot " in str(error)
        assert "corridor/train/0" not in str(error) and "corridor/train/2" not in str(error)
        # raised after every episode finished: the completed ones are all there, in task order
        assert [o.ok for o in error.outcomes] == [True, False, True] and len(error.failed) == 1
        assert [t.task.task_id for t in error.trajectories] == ["corridor/train/0", "corridor/train/2"]
        assert all(t.num_turns == 3 for t in error.trajectories)
        assert strategy.collect([tasks[0], tasks[2]])[1].actions == ("go forward",) * 3
        with pytest.raises(ValueError, match="one seed per task"):
            strategy.play(tasks, seeds=[1])
    assert strategy.play([]) == []


def test_episode_outcome_holds_exactly_one_of_a_trajectory_and_an_error():
    task = corridor_task(0)
    with pytest.raises(ValueError, match="exactly one"):
        EpisodeOutcome(index=0, task=task)
    outcome = EpisodeOutcome.failed(4, task, KeyError("x"))
    assert not outcome.ok and outcome.error == "KeyError: 'x'" and outcome.index == 4
    assert EpisodeOutcome.failed(0, task, RuntimeError()).error == "RuntimeError"


# ----------------------------------------------------------------------------------------------------------- ActFirst
def fast_requests(engine):
    return [(s.turn, s.mode) for s in engine.seen if s.kind == "fast"]


def test_actfirst_failed_check_switches_to_next_action_prediction_for_good(tok, pool, reference):
    def script(seen):
        if seen.mode == "full":
            return full_text("go back")                  # never executed
        if seen.mode == "inverse_dynamics":              # turn 2: valid, but o_3 differs from the reference
            return action_text("go forward" if seen.turn == 1 else "look")
        return action_text("go forward")

    engine = ScriptedEngine(tok, script)
    strategy = ActFirstStrategy(engine, pool, tok, actfirst_config(max_turns=5))
    trajectory = strategy.run_episode(0, corridor_task(), reference)
    assert fast_requests(engine) == [(1, "inverse_dynamics"), (2, "inverse_dynamics"), (3, "next_action"),
                                     (4, "next_action"), (5, "next_action")]
    assert trajectory.actions == ("go forward", "look", "go forward", "go forward", "go forward")
    assert [t.guided for t in trajectory.turns] == [True, True, False, False, False]
    assert trajectory.turns[0].check.ok and not trajectory.turns[1].check.ok
    assert all(t.check is None for t in trajectory.turns[2:])
    assert [t.action_source for t in trajectory.turns] == ["inverse_dynamics"] * 2 + ["next_action"] * 3
    assert pool.trajectory(0).actions == trajectory.actions             # no reset after the failed check
    assert trajectory.end_reason == "max_turns" and trajectory.info["failed_check_turn"] == 2
    # one full response per turn on the turn's context, without the reference; its action is not executed
    assert [(s.turn, s.kind) for s in engine.seen if s.mode == "full"] == [(t, "full") for t in range(1, 6)]
    for turn in trajectory.turns:
        (full,) = turn.responses
        assert full.mode == "full" and full.action == "go back"
        assert "Target next observation" not in decoded(tok, full.prompt_ids)
        assert f"You are now at step {turn.index}." in decoded(tok, full.prompt_ids)
    assert len(trajectory.samples()) == 5
    id_prompt = next(s.prompt_text for s in engine.seen if s.mode == "inverse_dynamics" and s.turn == 2)
    assert reference.next_observation(2) in id_prompt and "go forward" in id_prompt


@pytest.mark.parametrize("proposal", [action_text("fly away"), "I cannot tell."], ids=["inadmissible", "unparsable"])
def test_actfirst_invalid_proposal_triggers_exactly_one_next_action_request(tok, pool, reference, proposal):
    def script(seen):
        if seen.mode == "full":
            return full_text("look")
        if seen.mode == "inverse_dynamics":
            return proposal if seen.turn == 1 else action_text("go forward")
        return action_text("go forward")

    engine = ScriptedEngine(tok, script)
    trajectory = ActFirstStrategy(engine, pool, tok, actfirst_config(max_turns=2)).run_episode(
        0, corridor_task(), reference)
    assert fast_requests(engine) == [(1, "inverse_dynamics"), (1, "next_action"), (2, "inverse_dynamics")]
    first = trajectory.turns[0]
    fallback_prompt = next(s.request.prompt_ids for s in engine.seen if s.mode == "next_action")
    nap_rendered = next(s.prompt_text for s in engine.seen if s.mode == "next_action")
    assert "You are now at step 1." in nap_rendered and "[Step" not in nap_rendered    # unchanged context
    assert first.action == "go forward" and first.action_source == "next_action" and first.guided
    assert [r.mode for r in first.action_responses] == ["inverse_dynamics", "next_action"]
    assert list(first.action_responses[1].prompt_ids) == list(fallback_prompt)
    assert first.check.ok                                # the transition reached o_2^ref: guidance survives
    assert trajectory.turns[1].guided and trajectory.turns[1].action_source == "inverse_dynamics"


def test_actfirst_invalid_fallback_is_executed_without_a_second_request(tok, pool, reference):
    def script(seen):
        if seen.mode == "full":
            return full_text("look")
        return action_text("fly away" if seen.mode == "inverse_dynamics" else "swim")

    engine = ScriptedEngine(tok, script)
    trajectory = ActFirstStrategy(engine, pool, tok, actfirst_config(max_turns=2)).run_episode(
        0, corridor_task(), reference)
    assert fast_requests(engine) == [(1, "inverse_dynamics"), (1, "next_action"), (2, "next_action")]
    assert trajectory.actions == ("swim", "swim") and not trajectory.turns[0].check.ok
    assert trajectory.turns[0].next_observation.text == "Nothing happens."


def test_actfirst_without_nap_fallback_ends_at_the_first_failed_check(tok, pool, reference):
    def script(seen):
        if seen.mode == "full":
            return full_text("look")
        return action_text("go forward" if seen.turn == 1 else "look")

    engine = ScriptedEngine(tok, script)
    strategy = ActFirstStrategy(engine, pool, tok, actfirst_config("no-nap-fallback", max_turns=10))
    trajectory = strategy.run_episode(0, corridor_task(), reference)
    assert trajectory.end_reason == "check_failed" and trajectory.num_turns == 2
    assert fast_requests(engine) == [(1, "inverse_dynamics"), (2, "inverse_dynamics")]
    assert len(trajectory.samples()) == 2                # the failed turn's full response is still a sample


def test_actfirst_without_inverse_dynamics_predicts_every_action(tok, pool):
    def script(seen):
        return full_text("look") if seen.mode == "full" else action_text("go forward")

    engine = ScriptedEngine(tok, script)
    strategy = ActFirstStrategy(engine, pool, tok, actfirst_config("no-id", max_turns=3))
    trajectory = strategy.run_episode(0, corridor_task())            # no reference needed
    assert fast_requests(engine) == [(1, "next_action"), (2, "next_action"), (3, "next_action")]
    assert [len(t.responses) for t in trajectory.turns] == [1, 1, 1] and not any(t.guided for t in trajectory.turns)



def test_actfirst_queues_the_fast_action_right_before_the_turns_full_response(tok, pool, reference):
    """App. C.5: the two requests of a turn are submitted together, the fast action (the critical path) first."""
    def script(seen):
        return full_text("look") if seen.mode == "full" else action_text("go forward")

    for config, guide in ((actfirst_config(max_turns=3), reference), (actfirst_config("no-id", max_turns=3), None)):
        engine = ScriptedEngine(tok, script)
        ActFirstStrategy(engine, pool, tok, config).run_episode(0, corridor_task(), guide)
        assert [(s.turn, s.kind) for s in engine.seen] == [(t, k) for t in (1, 2, 3) for k in ("fast", "full")]


def test_fixed_output_lengths_make_every_request_exactly_its_limit(tok, pool):
    """RolloutConfig.fixed_output_lengths (the App. C.5 speedup protocol): min = max new tokens, no stop strings,
    and a full response is one request of the budget's total, without the thinking-budget insertion."""
    budget = ThinkingBudget(first_stage_tokens=16, total_tokens=24, second_stage_max_tokens=4)

    def script(seen):
        return "<think>\n" + "hmm " * 60 if seen.mode == "full" else action_text("go forward") + " and more" * 5

    engine = ScriptedEngine(tok, script)
    vanilla = VanillaStrategy(engine, pool, tok, RolloutConfig(max_turns=2, thinking_budget=budget,
                                                               fixed_output_lengths=True))
    trajectory = vanilla.run_episode(0, corridor_task())
    assert [s.stage for s in engine.seen] == [1, 1]
    for seen in engine.seen:
        params = seen.request.params
        assert params.max_new_tokens == params.min_new_tokens == 24 and params.stop_strings == ()
    for turn in trajectory.turns:
        (response,) = turn.responses
        assert len(response.response_ids) == 24 and response.model_generated.all()
        assert response.truncated and turn.action == ""               # cut off by the length: an empty action
    engine = ScriptedEngine(tok, script)
    config = actfirst_config("no-id", max_turns=2, thinking_budget=budget, fast_action_max_tokens=7,
                             fixed_output_lengths=True)
    trajectory = ActFirstStrategy(engine, pool, tok, config).run_episode(0, corridor_task())
    fast = [s.request.params for s in engine.seen if s.kind == "fast"]
    full = [s.request.params for s in engine.seen if s.kind == "full"]
    assert [(p.min_new_tokens, p.max_new_tokens, p.stop_strings) for p in fast] == [(7, 7, ())] * 2
    assert [(p.min_new_tokens, p.max_new_tokens, p.stop_strings) for p in full] == [(24, 24, ())] * 2
    assert [len(t.action_responses[0].response_ids) for t in trajectory.turns] == [7, 7]
    assert len(trajectory.samples()) == 2

@pytest.mark.parametrize("ablation,replayed", [("prefix-replay-50", 2), ("prefix-replay-100", 5)])
def test_actfirst_reference_prefix_replay_executes_the_reference_then_predicts(tok, pool, reference, ablation,
                                                                              replayed):
    def script(seen):
        return full_text("look") if seen.mode == "full" else action_text("inventory")

    engine = ScriptedEngine(tok, script)
    strategy = ActFirstStrategy(engine, pool, tok, actfirst_config(ablation, max_turns=4 if replayed == 2 else 30))
    trajectory = strategy.run_episode(0, corridor_task(), reference)
    assert trajectory.actions[:replayed] == CORRIDOR_WALKTHROUGH[:replayed]
    assert [t.action_source for t in trajectory.turns][:replayed] == ["reference"] * replayed
    assert not any(mode == "inverse_dynamics" for _, mode in fast_requests(engine))
    assert fast_requests(engine) == [(t, "next_action") for t in range(replayed + 1, trajectory.num_turns + 1)]
    assert len(trajectory.samples()) == trajectory.num_turns
    if replayed == 5:
        assert trajectory.won and trajectory.end_reason == "done"
    else:
        assert trajectory.actions[2:] == ("inventory", "inventory")


def test_actfirst_needs_a_reference_and_can_skip_full_responses(tok, pool, reference):
    engine = ScriptedEngine(tok, lambda s: action_text("go forward"))
    with pytest.raises(ValueError, match="needs a reference"):
        ActFirstStrategy(engine, pool, tok).run_episode(0, corridor_task())
    with pytest.raises(ValueError, match="inverse_dynamics=False"):
        actfirst_config(reference_replay_fraction=0.5)
    strategy = ActFirstStrategy(engine, pool, tok, actfirst_config(max_turns=2, full_responses=False))
    trajectory = strategy.run_episode(0, corridor_task(), reference)
    assert trajectory.num_turns == 2 and trajectory.samples() == [] and not engine.requests(mode="full")


# ----------------------------------------------------------------------------------------------------------- STI
LOG_2 = math.log(2.0)


def sti_setup(tok, pool, *, max_turns=3, intervention_probability=None, teacher_minus_student=LOG_2):
    student = ScriptedEngine(tok, lambda s: full_text("look", "student reasoning"), logprob=-1.0)
    teacher = ScriptedEngine(tok, lambda s: full_text("go forward", "teacher reasoning"), logprob=-0.25)
    scored = []

    def score(prompt_ids, completion_ids):
        scored.append((list(prompt_ids), list(completion_ids)))
        return np.full(len(completion_ids), -1.0 + teacher_minus_student)

    config = STIConfig(max_turns=max_turns, intervention_probability=intervention_probability)
    strategy = STIStrategy(student, pool, tok, config, teacher_engine=teacher, teacher_scorer=score)
    return strategy, student, teacher, scored


def test_sti_alpha_zero_keeps_every_student_proposal(tok, pool):
    strategy, student, teacher, scored = sti_setup(tok, pool, intervention_probability=lambda s: 0.0)
    trajectory = strategy.run_episode(0, corridor_task())
    assert teacher.seen == [] and trajectory.actions == ("look",) * 3
    assert [s.kind for s in student.seen] == ["full"] * 3 and len(scored) == 3
    k3 = 2.0 - 1.0 - math.log(2.0)                        # r = π_T / π_student = 2 on every token
    for turn, (prompt_ids, completion_ids) in zip(trajectory.turns, scored):
        (response,) = turn.responses
        assert turn.action_source == "full" and not turn.info["intervened"]
        assert turn.info["discrepancy"] == pytest.approx(k3, rel=1e-5) and turn.info["intervention_probability"] == 0.0
        assert list(response.prompt_ids) == prompt_ids and list(response.response_ids) == completion_ids
        sample = response.to_sample()
        prompt = len(response.prompt_ids)
        assert not sample.teacher_generated.any()
        np.testing.assert_allclose(sample.behavior_logp[prompt:], -1.0)
        np.testing.assert_allclose(sample.teacher_logp[prompt:], -1.0 + math.log(2.0), rtol=1e-6)
        np.testing.assert_array_equal(sample.teacher_logp[:prompt], 0.0)


def test_sti_alpha_one_replaces_every_turn_with_the_teacher(tok, pool):
    strategy, student, teacher, _ = sti_setup(tok, pool, intervention_probability=lambda s: 1.0)
    trajectory = strategy.run_episode(0, corridor_task())
    assert trajectory.actions == ("go forward",) * 3 and [t.action_source for t in trajectory.turns] == ["teacher"] * 3
    assert [s.kind for s in teacher.seen] == ["teacher"] * 3 and len(student.seen) == 3
    for proposal, regenerated in zip(student.seen, teacher.seen):       # the same history for both policies
        assert list(proposal.request.prompt_ids) == list(regenerated.request.prompt_ids)
    later = teacher.seen[2].prompt_text                  # discarded proposals never enter the history
    assert "[Step 1 action] go forward" in later and "[Step 2 action] go forward" in later
    assert "action] look" not in later
    samples = trajectory.samples()
    assert len(samples) == 3                              # nor the buffer
    for turn, sample in zip(trajectory.turns, samples):
        response = turn.responses[0]
        prompt = len(response.prompt_ids)
        assert response.teacher_generated and response.action == "go forward"
        assert "teacher reasoning" in decoded(tok, response.response_ids)
        assert sample.teacher_generated[prompt:].all() and not sample.teacher_generated[:prompt].any()
        np.testing.assert_allclose(sample.behavior_logp[prompt:], -0.25)     # the teacher's log-probs
        np.testing.assert_allclose(sample.teacher_logp[prompt:], -0.25)


def test_sti_intervention_probability_is_eq8_of_the_k3_score(tok, pool):
    strategy, _, teacher, _ = sti_setup(tok, pool, max_turns=12)
    trajectory = strategy.run_episode(0, corridor_task())
    k3 = 2.0 - 1.0 - math.log(2.0)
    for turn in trajectory.turns:
        assert turn.info["intervention_probability"] == pytest.approx(k3 / (1.0 + k3), rel=1e-5)
        assert turn.action_source == ("teacher" if turn.info["intervened"] else "full")
    assert len(teacher.seen) == sum(t.info["intervened"] for t in trajectory.turns)
    agreeing, _, silent_teacher, _ = sti_setup(tok, pool, teacher_minus_student=0.0)    # s = 0: α = 0
    result = agreeing.run_episode(1, corridor_task())
    assert silent_teacher.seen == [] and all(t.info["intervention_probability"] == 0.0 for t in result.turns)


# ----------------------------------------------------------------------------------------------------------- ActionOPD
def actionopd_setup(tok, pool, candidates, teacher_outputs, **config):
    """``candidates(turn) -> [action | None]`` (None: unparsable); ``teacher_outputs(turn) -> [action | None]`` in
    request order (retries included)."""

    def student_script(seen):
        return full_text(candidates(seen.turn)[seen.index])

    def teacher_script(seen):
        outputs = teacher_outputs(seen.turn)
        return full_text(outputs[seen.index] if seen.index < len(outputs) else None)

    student = ScriptedEngine(tok, student_script)
    teacher = ScriptedEngine(tok, teacher_script)
    strategy = ActionOPDStrategy(student, pool, tok, ActionOPDConfig(**{"max_turns": 1, **config}),
                                 teacher_engine=teacher)
    return strategy, student, teacher


def test_actionopd_rewards_invalid_candidates_and_uniform_tie_break(tok, pool):
    candidates = ["go forward", "look", None, "inventory"]
    selected = set()
    for seed in range(12):
        strategy, student, teacher = actionopd_setup(tok, pool, lambda t: candidates,
                                                     lambda t: ["go forward", "look", "go back"], seed=seed)
        trajectory = strategy.run_episode(0, corridor_task())
        (turn,) = trajectory.turns
        assert turn.info["rewards"] == (1.0, 1.0, -1.0, 0.0) and turn.info["ties"] == (0, 1)
        assert turn.info["selected"] in (0, 1) and turn.action == candidates[turn.info["selected"]]
        selected.add(turn.info["selected"])
        assert [r.reward for r in turn.responses] == [1.0, 1.0, -1.0, 0.0]
        assert turn.responses[2].action is None                       # the invalid candidate stays in the group
        assert not any(r.retained for r in turn.responses)            # until the collection's advantages exist
        assert [r.teacher_generated for r in turn.action_responses] == [True] * 3
    assert selected == {0, 1}
    params = [s.request.params for s in student.seen]
    assert {(p.temperature, p.top_p, p.top_k) for p in params} == {(0.6, 0.95, 20)}
    assert len({p.seed for p in params}) == 4 and {s.kind for s in student.seen} == {"candidate"}
    assert {(s.request.params.temperature, s.request.params.top_p, s.request.params.top_k, s.kind)
            for s in teacher.seen} == {(0.6, 0.95, 0, "teacher")}


@pytest.mark.parametrize("outputs,multiset", [
    ([None, "go forward", "go forward", None, "look"], ("look", "go forward", "go forward")),
    ([None, "go forward", "go forward", None, None], ("go forward", "go forward")),
], ids=["valid-on-second-retry", "no-valid-attempt"])
def test_actionopd_teacher_samples_get_two_retries(tok, pool, outputs, multiset):
    strategy, _, teacher = actionopd_setup(tok, pool, lambda t: ["go forward", "look", "inventory", None],
                                           lambda t: outputs)
    (turn,) = strategy.run_episode(0, corridor_task()).turns
    assert len(teacher.seen) == 5 and len(turn.action_responses) == 5
    assert turn.info["teacher_actions"] == multiset
    look = 1.0 if "look" in multiset else 0.0
    assert turn.info["rewards"] == (1.25, look, 0.0, -1.0)           # nominal K = 3 in the bonus denominator
    assert turn.action == "go forward"


def test_actionopd_no_valid_teacher_sample_ends_the_collection(tok, pool):
    strategy, student, teacher = actionopd_setup(tok, pool, lambda t: ["look"] * 4, lambda t: [None] * 9)
    trajectory = strategy.run_episode(0, corridor_task())
    assert trajectory.end_reason == "no_teacher_sample" and trajectory.num_turns == 0
    assert len(teacher.seen) == 9 and trajectory.samples() == [] and pool.trajectory(0).actions == ()
    later, _, _ = actionopd_setup(tok, pool, lambda t: ["go forward"] * 4,
                                  lambda t: ["go forward"] * 3 if t == 1 else [None] * 9, max_turns=5)
    trajectory = later.run_episode(1, corridor_task())
    assert trajectory.end_reason == "no_teacher_sample" and trajectory.actions == ("go forward",)


def test_actionopd_group_centering_and_batch_whitening(tok, pool):
    def candidates(turn):
        return ["go forward", "look", None, "inventory"] if turn == 1 else ["look"] * 4

    strategy, _, _ = actionopd_setup(tok, pool, candidates,
                                     lambda t: ["go forward", "look", "go back"] if t == 1 else ["go back"] * 3,
                                     max_turns=2)
    trajectory = strategy.run_episode(0, corridor_task())
    assert [t.info["rewards"] for t in trajectory.turns] == [(1.0, 1.0, -1.0, 0.0), (0.0, 0.0, 0.0, 0.0)]
    (assigned,) = assign_group_advantages([trajectory])
    centred = np.array([0.75, 0.75, -1.25, -0.25])
    expected = centred / (np.sqrt(np.mean(centred ** 2)) + 1e-8)
    np.testing.assert_allclose([r.advantage for r in assigned.turns[0].responses], expected, rtol=1e-5)
    assert all(r.retained for r in assigned.turns[0].responses)
    assert not any(r.retained for r in assigned.turns[1].responses)   # equal rewards: no learning signal
    assert [r.advantage for r in assigned.turns[1].responses] == [0.0] * 4
    samples = collection_samples([trajectory])
    assert len(samples) == 8 and [s.retained for s in samples] == [True] * 4 + [False] * 4
    np.testing.assert_allclose([s.advantage for s in samples[:4]], expected, rtol=1e-5)
    assert len(collection_samples([trajectory], retained_only=True)) == 4
    assert all(s.teacher_logp is None and not s.teacher_generated.any() for s in samples)


# ----------------------------------------------------------------------------------------------------------- records
def test_response_records_validate_their_arrays():
    with pytest.raises(ValueError, match="model_generated"):
        Response(prompt_ids=[1, 2], response_ids=[3, 4], logprobs=[-1.0, -1.0], model_generated=[True],
                 mode="full", policy_version=0)
    with pytest.raises(ValueError, match="mode"):
        Response(prompt_ids=[1], response_ids=[3], logprobs=[-1.0], model_generated=[True], mode="think",
                 policy_version=0)
    response = Response(prompt_ids=[1, 2], response_ids=[3, 4, 5], logprobs=[-1.0, 0.0, -2.0],
                        model_generated=[True, False, True], mode="full", policy_version=4,
                        teacher_logp=[-0.5, -9.0, -0.25], teacher_generated=True)
    sample = response_to_sample(response)
    np.testing.assert_array_equal(sample.tokens, [1, 2, 3, 4, 5])
    np.testing.assert_array_equal(sample.loss_mask, [False, False, True, False, True])
    np.testing.assert_array_equal(sample.behavior_logp, [0, 0, -1.0, 0, -2.0])
    np.testing.assert_array_equal(sample.teacher_logp, [0, 0, -0.5, 0, -0.25])
    np.testing.assert_array_equal(sample.teacher_generated, [False, False, True, True, True])


# ----------------------------------------------------------------------------------------------------------- scoring
@pytest.mark.slow  # heavier than the README's test run allows (run in CI: pytest -m slow)
def test_dense_teacher_scorer_matches_a_dense_forward():
    from jaxopd.models.decoder import CausalLM
    from micro_models import TWO_LAYER, micro_config

    config = micro_config(TWO_LAYER, vocab_size=256)
    model = CausalLM(config, rngs=nnx.Rngs(1))
    rng = np.random.default_rng(0)
    prompt, completion = rng.integers(0, 256, 37).tolist(), rng.integers(0, 256, 11).tolist()
    scorer = DenseTeacherScorer(model, temperature=0.7, length_multiple=32, completion_multiple=8)
    scores = scorer.score(prompt, completion)
    logits = np.asarray(model(np.asarray([prompt + completion], np.int32))[0], np.float64)
    log_probs = np.asarray(jax.nn.log_softmax(logits / 0.7, axis=-1))
    expected = [log_probs[len(prompt) - 1 + i, token] for i, token in enumerate(completion)]
    np.testing.assert_allclose(scores, expected, atol=1e-4)
    assert as_teacher_scorer(scorer) is scorer
    with pytest.raises(ValueError, match="shape"):
        CallableScorer(lambda p, c: np.zeros(len(c) + 1)).score([1], [2, 3])
    with pytest.raises(ValueError, match="log-probabilities"):
        CallableScorer(lambda p, c: np.ones(len(c))).score([1], [2, 3])


def _result(token_ids, *, versions, finish="stop"):
    from jaxopd.sampler.types import Result, Timings
    return Result(request_id="r", kind="fast", prompt_ids=(1, 2, 3), token_ids=list(token_ids), text="",
                  logprobs=np.full(len(token_ids), -0.5, np.float32), finish_reason=finish,
                  timings=Timings(0.0, 0.0, 0.0, 0.0), policy_versions=versions)


def test_responses_are_dated_by_the_engines_recorded_version():
    """The buffer's lag rule needs the exact version: the engine's (first, last) record wins over the version
    the strategy believed it served, and a response spanning an update is dated by its oldest weights."""
    from jaxopd.rollout.trajectory import Response, engine_policy_version

    response = Response.from_result(_result([5, 6], versions=(3, 4)), mode="next_action", policy_version=7)
    assert response.policy_version == 3 and response.to_sample().policy_version == 3
    assert Response.from_result(_result([5], versions=None), mode="next_action", policy_version=7).policy_version == 7
    teacher = Response.from_result(_result([5], versions=(9, 9)), mode="next_action", policy_version=2,
                                   teacher_generated=True)
    assert teacher.policy_version == 2          # a teacher turn is dated by the student version of its rollout
    assert engine_policy_version([_result([1], versions=(5, 6)), _result([1], versions=(4, 6))], 0) == 4


def test_error_responses_never_become_samples():
    from jaxopd.rollout.trajectory import ACTION_SOURCES, Response, Trajectory, Turn

    good = Response.from_result(_result([5, 6], versions=(1, 1)), mode="next_action", policy_version=1)
    failed = Response.from_result(_result([5], versions=(1, 1), finish="error"), mode="next_action",
                                  policy_version=1)
    turn = Turn(index=1, observation=None, action="", next_observation=None, action_source=ACTION_SOURCES[0],
                responses=(good, failed))
    trajectory = Trajectory(task=None, strategy="vanilla", initial_observation=None, turns=(turn,),
                            end_reason="done")
    assert len(trajectory.responses()) == 2 and len(trajectory.samples()) == 1
