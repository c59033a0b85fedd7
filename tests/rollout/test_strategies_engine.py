"""Every rollout strategy once on the real tiny engine (``jaxopd.sampler.Engine`` over a random micro Qwen3 with
the real tokenizer's vocabulary) and the real environments: a generated ALFWorld game and a ScienceWorld task.

Episodes must end, samples must be well-formed, and no page may leak. Random weights produce no parsable
action, so ActionOPD's teacher is a scripted engine answering a valid action (a random teacher would end every
collection at its first state); STI's teacher is a second real engine with its own weights and a dense scorer.
"""
from __future__ import annotations

import functools
import math
import shutil

import numpy as np
import pytest
from flax import nnx
from micro_models import MICRO, micro_config
from tests.rollout.test_strategies import ScriptedEngine, full_text

from jaxopd_envs.pool import EnvPool
from jaxopd_envs.references import build_reference
from jaxopd.models.decoder import CausalLM
from jaxopd.rollout.scoring import DenseTeacherScorer
from jaxopd.rollout.strategies import (
    ActFirstStrategy,
    ActionOPDConfig,
    ActionOPDStrategy,
    RolloutConfig,
    STIConfig,
    STIStrategy,
    VanillaStrategy,
    actfirst_config,
    collection_samples,
)
from jaxopd.rollout.thinking import ThinkingBudget
from jaxopd.rollout.trajectory import END_REASONS, rollout_quality
from jaxopd.sampler import Engine, EngineConfig
from jaxopd.tokenizer import QWEN3_VOCAB_SIZE, Qwen3Tokenizer

pytestmark = pytest.mark.slow  # heavier than the README's test run allows (run in CI: pytest -m slow)

# The tokenizer's 151,669 ids and no padding rows: a random model samples Qwen3's 267 padding rows (151669..151935)
# about once in 570 tokens, and the tokenizer refuses to decode them.
CONFIG = micro_config(MICRO, vocab_size=QWEN3_VOCAB_SIZE)
ENGINE = EngineConfig(max_slots=8, page_size=64, num_pages=8 * 32 + 1, max_seq_len=2048, prefill_chunk=256,
                      max_prefill_tokens=256, max_prefill_rows=2)
BUDGET = ThinkingBudget(first_stage_tokens=8, total_tokens=48, second_stage_max_tokens=4)
COMMON = dict(max_turns=2, max_prompt_tokens=1536, thinking_budget=BUDGET)
FAST_TOKENS = 6


@pytest.fixture(scope="module")
def tok():
    return Qwen3Tokenizer()


@pytest.fixture(scope="module")
def teacher_model():
    return CausalLM(CONFIG, rngs=nnx.Rngs(1))


@pytest.fixture(scope="module")
def student_model():
    return CausalLM(CONFIG, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def engines(tok, student_model, teacher_model):
    student = Engine(student_model, ENGINE, tokenizer=tok)
    teacher = Engine(teacher_model, ENGINE, tokenizer=tok)
    with student, teacher:
        yield student, teacher


@pytest.fixture(scope="module")
def alfworld(alfworld_games):
    from jaxopd_envs.alfworld import AlfWorldEnv

    factory = functools.partial(AlfWorldEnv, alfworld_games)
    with factory() as env:
        task = env.tasks("train")[0]
        reference = build_reference(env, task)
    with EnvPool(factory, num_slots=1, backend="thread") as pool:
        yield pool, task, reference


@pytest.fixture(scope="module")
def scienceworld():
    if shutil.which("java") is None:
        pytest.skip("ScienceWorld needs java")
    pytest.importorskip("scienceworld")
    from jaxopd_envs.scienceworld import ScienceWorldEnv, scienceworld_task

    task = scienceworld_task("find-living-thing", 0)
    with ScienceWorldEnv() as env:
        reference = build_reference(env, task, shorten=False)
    with EnvPool(ScienceWorldEnv, num_slots=1, backend="thread") as pool:
        yield pool, task, reference


def scripted_teacher(tok, benchmark):
    """A teacher that always answers a valid look action (think-then-act)."""
    action = "look" if benchmark == "alfworld" else "look around"
    return ScriptedEngine(tok, lambda seen: full_text(action), logprob=-0.5)


def make_strategy(name, engines, tok, teacher_model, benchmark):
    student, teacher = engines
    if name == "vanilla":
        return VanillaStrategy(student, None, tok, RolloutConfig(**COMMON))
    if name.startswith("actfirst"):
        ablation = name.split(":")[1] if ":" in name else "actfirst"
        return ActFirstStrategy(student, None, tok, actfirst_config(ablation, fast_action_max_tokens=FAST_TOKENS,
                                                                   **COMMON))
    if name == "sti":
        scorer = DenseTeacherScorer(teacher_model, length_multiple=512, completion_multiple=64)
        return STIStrategy(student, None, tok, STIConfig(**COMMON), teacher_engine=teacher, teacher_scorer=scorer)
    return ActionOPDStrategy(student, None, tok, ActionOPDConfig(**COMMON, teacher_thinking_budget=ThinkingBudget()),
                             teacher_engine=scripted_teacher(tok, benchmark))


def check_samples(trajectory, samples, vocab_size):
    responses = trajectory.responses()
    assert len(samples) == len(responses) > 0
    for response, sample in zip(responses, samples):
        prompt, length = len(response.prompt_ids), len(response.response_ids)
        assert len(sample) == prompt + length and sample.tokens.max() < vocab_size
        np.testing.assert_array_equal(sample.tokens, np.concatenate([response.prompt_ids, response.response_ids]))
        assert not sample.loss_mask[:prompt].any()
        np.testing.assert_array_equal(sample.loss_mask[prompt:], response.model_generated)
        supervised = sample.behavior_logp[sample.loss_mask]
        assert np.all(np.isfinite(supervised)) and np.all(supervised <= 0) and np.any(supervised < 0)
        np.testing.assert_array_equal(sample.behavior_logp[~sample.loss_mask], 0.0)
        if sample.teacher_logp is not None:
            assert np.all(np.isfinite(sample.teacher_logp)) and np.all(sample.teacher_logp <= 0)


def run_and_check(name, engines, tok, teacher_model, environment, benchmark):
    pool, task, reference = environment
    strategy = make_strategy(name, engines, tok, teacher_model, benchmark)
    strategy.pool = pool
    student = engines[0]
    if student.policy_version < 2:                 # the engine's recorded version dates the samples
        student.update_weights(student.executor.state, version=2)
    strategy.policy_version = 2
    (trajectory,) = strategy.collect([task], {task.task_id: reference})
    for engine in engines:
        assert engine.wait_idle(timeout=120)
        assert engine.scheduler.allocator.num_used == 0                   # every page came back
    assert trajectory.end_reason in END_REASONS and 1 <= trajectory.num_turns <= COMMON["max_turns"]
    assert pool.trajectory(0).actions == trajectory.actions               # the turns are what the env executed
    samples = collection_samples([trajectory]) if name == "actionopd" else trajectory.samples()
    check_samples(trajectory, samples, CONFIG.vocab_size)
    assert {s.policy_version for s in samples} == {2}
    quality = rollout_quality([trajectory])
    assert quality.num_tasks == 1 and quality.mean_turns == trajectory.num_turns
    return trajectory


STRATEGY_NAMES = ["vanilla", "actfirst", "sti", "actionopd"]


@pytest.mark.parametrize("name", STRATEGY_NAMES)
def test_strategy_on_a_generated_alfworld_game(name, engines, tok, teacher_model, alfworld):
    trajectory = run_and_check(name, engines, tok, teacher_model, alfworld, "alfworld")
    if name == "actfirst":          # random weights: the proposal and its fallback are invalid, the check fails
        first = trajectory.turns[0]
        assert first.guided and [r.mode for r in first.action_responses][0] == "inverse_dynamics"
        assert first.check is not None
        assert not first.check.ok or trajectory.turns[1].guided
    if name == "sti":
        for turn in trajectory.turns:
            assert math.isfinite(turn.info["discrepancy"]) and 0 <= turn.info["intervention_probability"] < 1
    if name == "actionopd":
        assert all(len(t.responses) == 4 and t.info["teacher_actions"] == ("look",) * 3 for t in trajectory.turns)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["actfirst:no-id", "actfirst:no-nap-fallback", "actfirst:prefix-replay-50",
                                  "actfirst:prefix-replay-100"])
def test_actfirst_ablations_on_a_generated_alfworld_game(name, engines, tok, teacher_model, alfworld):
    trajectory = run_and_check(name, engines, tok, teacher_model, alfworld, "alfworld")
    if name.endswith("prefix-replay-100"):
        assert trajectory.actions == alfworld[2].actions[:trajectory.num_turns]


@pytest.mark.slow
@pytest.mark.parametrize("name", STRATEGY_NAMES)
def test_strategy_on_a_scienceworld_task(name, engines, tok, teacher_model, scienceworld):
    run_and_check(name, engines, tok, teacher_model, scienceworld, "scienceworld")


def test_sti_scored_by_the_student_itself_has_no_discrepancy(engines, tok, student_model, alfworld):
    """The rollout temperature end to end: a dense scorer with the student's own weights reproduces the engine's
    behaviour log-probs on every model-generated token, so s_t = 0 and α_t = 0 (the teacher is never asked)."""
    pool, task, _ = alfworld
    student, teacher = engines
    silent_teacher = ScriptedEngine(tok, lambda seen: full_text("look"))
    scorer = DenseTeacherScorer(student_model, length_multiple=512, completion_multiple=64)
    strategy = STIStrategy(student, pool, tok, STIConfig(**COMMON), teacher_engine=silent_teacher,
                           teacher_scorer=scorer)
    trajectory = strategy.run_episode(0, task)
    assert silent_teacher.seen == [] and trajectory.num_turns == COMMON["max_turns"]
    for turn in trajectory.turns:
        (response,) = turn.responses
        generated = response.model_generated
        assert not generated.all()                       # the thinking budget inserted its early-stop text
        np.testing.assert_allclose(response.teacher_logp[generated], response.logprobs[generated], atol=1e-4)
        assert turn.info["discrepancy"] < 1e-4 and turn.info["intervention_probability"] < 1e-4
    assert student.wait_idle(timeout=120) and student.scheduler.allocator.num_used == 0
