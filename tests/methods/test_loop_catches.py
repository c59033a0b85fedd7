"""Tests that would catch a wrong training loop, not only broken plumbing (the issue "Training defects", against the
three papers): values the loop must produce whatever the random weights, on micro models and a small fake task
source, through the real engine, teacher scoring and sharded step.

* A teacher equal to the student (the same weights): the sampled reverse KL is 0 within float error and the OPD
  gradient vanishes, for vanilla OPD's and STI-OPD's losses, on batches the rollouts really sampled (and on teacher
  tokens STI inserted): a loop that scored the wrong tokens, shifted them by one, scored at another temperature or
  with other weights would not give 0.
* A batch saved in a checkpoint, re-scored and re-stepped from the checkpointed state outside the loop, gives the loss
  the loop logged (to 1e-6), and re-running it from the same state gives the same loss again.
* STI-OPD's intervention rate over many turns is s/(1+s) (Eq. 8), by a binomial test with a fixed seed.
* ActFirst-OPD with an exhausted reference falls back to autonomous next-action prediction (Sec. 4.2), the fallback
  recorded as the turn's action source, and the rollout goes on.
* The two forms of the reverse-KL advantage (``advantage_logp``: current / sampled) on hand-computed values.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxopd_envs.base import Observation, Task, TextEnv
from jaxopd import losses
from jaxopd.methods.benchmarks import BenchmarkSource
from jaxopd.methods.config import build_config
from jaxopd.methods.loop import Trainer
from jaxopd.methods.metrics_log import read_jsonl
from jaxopd.methods.registry import make_method
from jaxopd.models.decoder import CausalLM, ModelConfig
from jaxopd.tokenizer import QWEN3_VOCAB_SIZE, Qwen3Tokenizer

pytestmark = pytest.mark.slow  # heavier than the README's test run allows (run in CI: pytest -m slow)

MICRO = ModelConfig(hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8, intermediate_size=32,
                    vocab_size=QWEN3_VOCAB_SIZE, dtype="float32", param_dtype="float32")
SMALL = dict(updates=2, batch_size=2, rollout_slots=2, max_turns=2, max_prompt_tokens=256, max_train_tokens=272,
             first_stage_tokens=8, total_tokens=16, second_stage_tokens=4, fast_action_tokens=6, checkpoint_every=1,
             learning_rate=1e-2, weight_decay=0.0, page_size=64, rollout_mode="sync", eval_tasks=1)
KL_TOLERANCE = 1e-5          # float32 noise of two compiled programs computing the same log-probs


# ------------------------------------------------------------------------------------------ a small task source
class RoomEnv(TextEnv):
    """Two ALFWorld-like tasks: any admissible action is answered, ``open box`` wins. Threads, no engine."""

    benchmark = "alfworld"
    pool_backend = "thread"
    ACTIONS = ("look", "inventory", "go to box 1", "open box 1")

    def __init__(self):
        self.turn, self.won = 0, False

    def tasks(self, split):
        return [Task(benchmark="alfworld", split=split, task_id=f"room/{split}/{i}", task_type="pick_and_place_simple")
                for i in range(2)]

    def _observe(self, text, valid=True):
        return Observation(text=text, instruction="Your task is to: open the box.", admissible_actions=self.ACTIONS,
                           done=self.won, won=self.won, score=float(self.won), reward=float(self.won), turn=self.turn,
                           last_action_valid=valid)

    def reset(self, task):
        self.turn, self.won = 0, False
        return self._observe("You are in a room. You see a box 1.")

    def step(self, action):
        self.turn += 1
        command = " ".join(action.lower().split())
        if command not in self.ACTIONS:
            return self._observe("Nothing happens.", valid=False)
        self.won = command == "open box 1"
        return self._observe(f"You {command}.")


SOURCE = BenchmarkSource("alfworld", None, "generated", RoomEnv)


@pytest.fixture(scope="module")
def tokenizer():
    return Qwen3Tokenizer()


def micro(seed: int) -> CausalLM:
    return CausalLM(MICRO, rngs=nnx.Rngs(seed))


def run_trainer(method, out_dir, tokenizer, *, teacher_seed, **overrides):
    config = build_config(method, preset="cpu", **{**SMALL, **overrides})
    trainer = Trainer(config, student=micro(0), teacher=micro(teacher_seed), tokenizer=tokenizer, source=SOURCE,
                      out_dir=out_dir, progress=False, tensorboard=False, log=lambda message: None)
    trainer.run()
    return config, read_jsonl(out_dir / "train.jsonl")


# ------------------------------------------------------------------------------- teacher = student: KL 0, no gradient
@pytest.mark.parametrize("method, lora", [("vanilla-opd", {}), ("sti", {}),
                                          ("vanilla-opd", {"student": "micro", "lora_rank": 4, "lora_layers": [0]})])
def test_a_teacher_equal_to_the_student_gives_zero_kl_and_no_gradient_in_the_loop(method, lora, tokenizer, tmp_path):
    # a tiny rate: Adam turns even a gradient of float noise (1e-7) into a step of the learning rate's size, and
    # the student of update 2 must still be the teacher. With LoRA the student is the base with fresh adapters
    # merged (b = 0): the same model, so also KL 0 and no gradient for the adapters.
    _, records = run_trainer(method, tmp_path / method, tokenizer, teacher_seed=0, learning_rate=1e-9, **lora)
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        assert record["batch_tokens"] > 0
        assert abs(record["sampled_reverse_kl"]) < KL_TOLERANCE, record
        assert record["grad_norm"] < KL_TOLERANCE, record
        assert abs(record["loss"]) < KL_TOLERANCE, record


class LoopParts:
    """The loop's own training pieces for ``config`` (the ``Learner``'s set-up): optimizer, shardings, train step,
    teacher scorer; to recompute what the loop logged, outside it."""

    def __init__(self, config, student, teacher):
        from jaxopd.models.sharding import copy_to, named_shardings
        from jaxopd.train.mesh import RolePlan, build_meshes
        from jaxopd.train.scoring import make_teacher_scorer
        from jaxopd.train.state import OptimizerConfig, batch_shardings, make_optimizer, train_state_shardings
        from jaxopd.train.step import make_train_step

        self.config = config
        self.loss_config = make_method(config).loss_config()
        meshes = build_meshes(RolePlan.for_device_count(len(jax.devices())))
        self.graphdef, self.params = nnx.split(student, nnx.Param)
        self.optimizer = make_optimizer(OptimizerConfig(learning_rate=config.learning_rate,
                                                        weight_decay=config.weight_decay,
                                                        max_grad_norm=config.max_grad_norm))
        self.state_shardings = train_state_shardings(self.params, self.optimizer, meshes.trainer)
        self.rows = batch_shardings(meshes.trainer)
        self.train_step = make_train_step(self.graphdef, self.optimizer, self.loss_config, self.state_shardings,
                                          self.rows, donate=False)
        teacher_graphdef, teacher_state = nnx.split(teacher, nnx.Param)
        teacher_shardings = named_shardings(teacher_state, meshes.teacher)
        self.teacher_params = copy_to(teacher_state, teacher_shardings)
        self.scorer = make_teacher_scorer(teacher_graphdef, teacher_shardings, meshes.teacher,
                                          temperature=self.loss_config.temperature,
                                          logits_chunk_size=self.loss_config.logits_chunk_size,
                                          max_supervised_tokens=self.loss_config.max_supervised_tokens)

    def initial_state(self):
        from jaxopd.train.state import init_train_state
        return init_train_state(self.params, self.optimizer, self.state_shardings)

    def step(self, state, samples):
        """Collate ``samples`` as the loop does, score them with the teacher and take one step: metrics."""
        from jaxopd.train.buffer import collate_samples
        from jaxopd.train.learner import batch_length
        from jaxopd.train.scoring import score_batch

        host = collate_samples(samples, batch_size=self.config.batch_size,
                               length=batch_length(max(len(s) for s in samples), self.config.max_train_tokens))
        batch = score_batch(self.scorer, self.teacher_params, host, self.rows)
        new_state, metrics = self.train_step(state, batch)
        return new_state, {k: float(v) for k, v in jax.device_get(metrics).items()}


def test_a_checkpointed_batch_rescored_and_restepped_gives_the_logged_loss(tokenizer, tmp_path):
    from jaxopd.train.checkpoint import TrainCheckpointer
    from jaxopd.train.state import abstract_train_state

    out = tmp_path / "run"
    config, records = run_trainer("vanilla-opd", out, tokenizer, teacher_seed=1)
    logged = {r["step"]: r for r in records}
    assert logged[2]["grad_norm"] > 100 * KL_TOLERANCE        # another teacher: a real gradient (the control)
    parts = LoopParts(config, micro(0), micro(1))
    with TrainCheckpointer(out / "checkpoints") as checkpointer:
        # the checkpoint of update 1 was written with update 2's batch already in its buffer
        restored = checkpointer.restore(abstract_train_state(parts.params, parts.optimizer, parts.state_shardings),
                                        step=1)
    samples = restored.buffer.take(config.batch_size, 1)
    assert len(samples) == config.batch_size
    _, metrics = parts.step(restored.state, samples)
    assert metrics["loss"] == pytest.approx(logged[2]["loss"], abs=1e-6)
    assert metrics["grad_norm"] == pytest.approx(logged[2]["grad_norm"], rel=1e-4)
    _, again = parts.step(restored.state, samples)              # the same state and batch once more
    assert again["loss"] == pytest.approx(metrics["loss"], abs=1e-6)


# ------------------------------------------------------------------------------------- the weight sync check
def test_the_sync_check_token_is_the_new_weights_greedy_token_of_the_batchs_first_context(tokenizer, tmp_path):
    from jaxopd.train.checkpoint import TrainCheckpointer
    from jaxopd.train.state import abstract_train_state

    out = tmp_path / "run"
    config, records = run_trainer("vanilla-opd", out, tokenizer, teacher_seed=1, sync_check=True)
    logged = {r["step"]: r for r in records}
    parts = LoopParts(config, micro(0), micro(1))
    with TrainCheckpointer(out / "checkpoints") as checkpointer:      # update 1's checkpoint holds update 2's batch
        restored = checkpointer.restore(abstract_train_state(parts.params, parts.optimizer, parts.state_shardings),
                                        step=1)
    samples = restored.buffer.take(config.batch_size, 1)
    state, _ = parts.step(restored.state, samples)                  # the weights of update 2, recomputed
    context = samples[0].tokens[:int(np.argmax(samples[0].loss_mask))]
    logits = nnx.merge(parts.graphdef, state.params)(jnp.asarray(context[None]))[0, -1]
    logp = np.asarray(jax.nn.log_softmax(logits))
    assert logged[2]["sync_check_token"] == int(np.argmax(logp))
    assert logged[2]["sync_check_logprob"] == pytest.approx(float(logp.max()), abs=1e-4)
    assert {"sync_check_token", "sync_check_logprob"} <= logged[1].keys()


class _Probe:
    """An engine that answers every request with token 7 at version ``served``."""

    def __init__(self, served):
        self.served = served

    def submit(self, request):
        from concurrent.futures import Future
        from jaxopd.sampler.types import Result, Timings
        future = Future()
        future.set_result(Result(request_id=request.request_id, kind="full", prompt_ids=tuple(request.prompt_ids),
                                 token_ids=[7], text="", logprobs=np.array([-0.5], np.float32),
                                 finish_reason="length", timings=Timings(0.0, 0.0, 0.0, 0.0),
                                 policy_versions=(self.served, self.served)))
        return future


def test_the_sync_check_stops_a_run_whose_engine_serves_another_version():
    from jaxopd.sample import Sample
    sample = Sample(tokens=np.arange(6, dtype=np.int32), loss_mask=np.array([0, 0, 0, 1, 1, 1], bool),
                    behavior_logp=np.zeros(6, np.float32), policy_version=2)
    checker = Trainer.__new__(Trainer)
    checker.engine = _Probe(served=3)
    assert Trainer._check_sync(checker, sample, 3) == {"sync_check_token": 7, "sync_check_logprob": -0.5}
    checker.engine = _Probe(served=2)
    with pytest.raises(RuntimeError, match=r"weight sync check after update 3: .* versions \[\(2, 2\)\]"):
        Trainer._check_sync(checker, sample, 3)


# ----------------------------------------------------------------- sampled batches through the real engine, STI too
def play(strategy, tasks, seeds):
    from jaxopd.rollout.trajectory import trajectory_samples
    outcomes = strategy.play(tasks, {}, seeds=seeds)
    assert all(o.ok for o in outcomes), [o.error for o in outcomes]
    return trajectory_samples([o.trajectory for o in outcomes])


@pytest.fixture(scope="module")
def sampled_batches(tokenizer):
    """Samples the real engine drew for vanilla OPD and for STI-OPD with every turn given to the teacher (the same
    weights as the student, its own engine): ``{"vanilla": [...], "sti": [...]}``."""
    from jaxopd_envs.pool import EnvPool
    from jaxopd.methods.loop import engine_config_for
    from jaxopd.rollout.scoring import EngineTeacherScorer
    from jaxopd.rollout.strategies import STIStrategy, VanillaStrategy
    from jaxopd.sampler.engine import Engine

    config = build_config("sti", preset="cpu", **SMALL)
    method = make_method(config)
    tasks = RoomEnv().tasks("train")
    student, teacher = micro(0), micro(0)
    with EnvPool(RoomEnv, 2, backend="thread") as pool, \
            Engine(student, engine_config_for(config, method), tokenizer=tokenizer) as engine, \
            Engine(teacher, engine_config_for(config, method, scoring=True), tokenizer=tokenizer) as teacher_engine:
        vanilla = play(VanillaStrategy(engine, pool, tokenizer, make_method(
            dataclasses.replace(config, method="vanilla-opd")).rollout_config()), tasks, [1, 2])
        sti_config = dataclasses.replace(method.rollout_config(), intervention_probability=lambda s: 1.0)
        sti = play(STIStrategy(engine, pool, tokenizer, sti_config, teacher_engine=teacher_engine,
                               teacher_scorer=EngineTeacherScorer(teacher_engine, temperature=1.0)), tasks, [3, 4])
    assert all(s.teacher_generated[s.loss_mask].all() for s in sti) and not any(s.teacher_generated.any()
                                                                                for s in vanilla)
    return {"vanilla": vanilla, "sti": sti}


@pytest.mark.parametrize("method,batch,advantage_logp", [
    ("vanilla-opd", "vanilla", "current"), ("vanilla-opd", "vanilla", "sampled"),
    ("sti", "sti", "current"), ("sti", "vanilla", "current"), ("sti", "sti", "sampled")])
def test_teacher_equal_to_student_on_engine_samples_kl_zero_gradient_zero(method, batch, advantage_logp,
                                                                           sampled_batches):
    config = build_config(method, preset="cpu", advantage_logp=advantage_logp, **SMALL)
    samples = sampled_batches[batch][:config.batch_size]
    same = LoopParts(config, micro(0), micro(0))
    _, metrics = same.step(same.initial_state(), samples)
    assert metrics["supervised_tokens"] > 0
    assert abs(metrics["sampled_reverse_kl"]) < KL_TOLERANCE, metrics
    # "sampled" reads the engine's log-probs (float32 on CPU: within float error of the trainer's, about 3e-7)
    assert metrics["grad_norm"] < KL_TOLERANCE, metrics
    other = LoopParts(config, micro(0), micro(1))              # the control: another teacher (KL ~0.01-0.05)
    _, control = other.step(other.initial_state(), samples)
    assert abs(control["sampled_reverse_kl"]) > 1e-3 and control["grad_norm"] > 1e3 * KL_TOLERANCE, control


# ---------------------------------------------------------------------------------- STI: intervention probability
def test_sti_intervention_rate_is_s_over_one_plus_s(tokenizer):
    """Eq. 8: z_t ~ Bernoulli(s_t / (1 + s_t)). The scripted student samples every token at log-prob -1 and the
    teacher scores it at -1 + log 2 (r = 2 on every token: s = k3 = 1 - log 2, α = 0.2348); 100 episodes of 10 turns
    with distinct seeds give 1,000 independent draws, tested two-sided at the 0.1 % level, while the rates a wrong rule
    would give (α = s: 0.307; α = 1/2) are rejected by the same test."""
    scipy_stats = pytest.importorskip("scipy.stats")
    from jaxopd_envs.pool import EnvPool
    from jaxopd.rollout.strategies import STIConfig, STIStrategy
    from tests.rollout.test_strategies import CorridorEnv, ScriptedEngine, corridor_task, full_text

    s = 1.0 - math.log(2.0)
    alpha = s / (1.0 + s)
    student = ScriptedEngine(tokenizer, lambda seen: full_text("look", "student reasoning"), logprob=-1.0)
    teacher = ScriptedEngine(tokenizer, lambda seen: full_text("look", "teacher reasoning"), logprob=-0.5)

    def score(prompt_ids, completion_ids):
        return np.full(len(completion_ids), -1.0 + math.log(2.0))

    draws = []
    with EnvPool(CorridorEnv, num_slots=1, backend="thread", call_timeout_s=None) as pool:
        strategy = STIStrategy(student, pool, tokenizer, STIConfig(max_turns=10, seed=7), teacher_engine=teacher,
                               teacher_scorer=score)
        for episode in range(100):
            trajectory = strategy.run_episode(0, corridor_task(episode % 3), seed=1000 + episode)
            for turn in trajectory.turns:
                assert turn.info["intervention_probability"] == pytest.approx(alpha, rel=1e-5)
                assert turn.action_source == ("teacher" if turn.info["intervened"] else "full")
                draws.append(turn.info["intervened"])
    assert len(draws) == 1000
    assert len(teacher.seen) == sum(draws)
    observed = sum(draws)
    assert scipy_stats.binomtest(observed, len(draws), alpha).pvalue > 1e-3, (observed, alpha)
    for wrong in (s, 0.5):
        assert scipy_stats.binomtest(observed, len(draws), wrong).pvalue < 1e-3, (observed, wrong)


# ------------------------------------------------------------------------------- ActFirst: the reference runs out
def test_actfirst_falls_back_to_next_action_prediction_when_the_reference_runs_out(tokenizer):
    """Sec. 4.1-4.2: the reference next observation is the target while the rollout follows it; a reference of two
    steps has none for turn 3, so from then on the fast action is autonomous next-action prediction from the
    interaction context alone (the turn's recorded source), one request a turn, no inverse-dynamics request; no check
    failed, and the rollout goes on to win."""
    from jaxopd_envs.pool import EnvPool
    from jaxopd_envs.references import build_reference
    from jaxopd.rollout.strategies import ActFirstStrategy, actfirst_config
    from tests.rollout.test_strategies import CorridorEnv, ScriptedEngine, corridor_task, full_text

    walkthrough = ("go forward", "go forward", "take key", "go forward", "open door")
    full_reference = build_reference(CorridorEnv(), corridor_task(0))
    assert full_reference.actions == walkthrough
    reference = dataclasses.replace(full_reference, actions=walkthrough[:2],
                                    observations=full_reference.observations[:3], records=full_reference.records[:3])
    assert reference.next_observation(2) is not None and reference.next_observation(3) is None

    def script(seen):
        if seen.mode == "full":
            return full_text("look")
        return f"<action>{walkthrough[seen.turn - 1]}</action>"

    engine = ScriptedEngine(tokenizer, script)
    with EnvPool(CorridorEnv, num_slots=1, backend="thread", call_timeout_s=None) as pool:
        strategy = ActFirstStrategy(engine, pool, tokenizer, actfirst_config(max_turns=8))
        trajectory = strategy.run_episode(0, corridor_task(0), reference)
    fast = [(s.turn, s.mode) for s in engine.seen if s.kind == "fast"]
    assert fast == [(1, "inverse_dynamics"), (2, "inverse_dynamics"), (3, "next_action"), (4, "next_action"),
                    (5, "next_action")]
    assert [t.action_source for t in trajectory.turns] == ["inverse_dynamics"] * 2 + ["next_action"] * 3
    assert [t.guided for t in trajectory.turns] == [True, True, False, False, False]
    assert all(t.check.ok for t in trajectory.turns[:2]) and all(t.check is None for t in trajectory.turns[2:])
    assert trajectory.info["failed_check_turn"] == 0 and trajectory.won
    assert trajectory.actions == walkthrough
    assert len(trajectory.samples()) == 5                  # every turn's full response is still a training sample


# --------------------------------------------------------------------------- the advantage's log-prob, by hand
def _one_token(*values):
    return [jnp.asarray([[v]], jnp.float32) for v in values]


def test_opd_advantage_from_the_current_or_the_sampled_log_prob_by_hand():
    """One supervised token: π_θ 0.5, sampled at π_θold 0.45, π_T 0.8; ratio 0.5 / 0.45 = 1.111 (inside the clip).
    current: A = log(0.8 / 0.5) = 0.4700, loss -A·ratio = -0.5222, d loss / d log π_θ = -0.5222;
    sampled: A = log(0.8 / 0.45) = 0.5754, loss = -0.6393, gradient -0.6393."""
    logp, behavior, teacher, mask = _one_token(math.log(0.5), math.log(0.45), math.log(0.8), 1.0)
    ratio = 0.5 / 0.45
    for form, advantage in (("current", math.log(0.8 / 0.5)), ("sampled", math.log(0.8 / 0.45))):
        def loss(lp, form=form):
            return losses.opd_loss(lp, behavior, teacher, mask, advantage_logp=form)[0]
        value, grad = jax.value_and_grad(loss)(logp)
        assert float(value) == pytest.approx(-advantage * ratio, rel=1e-5)
        assert float(grad[0, 0]) == pytest.approx(-advantage * ratio, rel=1e-5)
        _, metrics = losses.opd_loss(logp, behavior, teacher, mask, advantage_logp=form)
        assert float(metrics["advantage_mean"]) == pytest.approx(advantage, rel=1e-5)
    with pytest.raises(ValueError, match="advantage_logp"):
        losses.opd_loss(logp, behavior, teacher, mask, advantage_logp="stored")


def test_sti_advantage_from_the_current_or_the_sampled_log_prob_by_hand():
    """Two tokens: a student token (π_θ 0.5, sampled at 0.45, π_T 0.8) and a teacher token (π_θ 0.2, teacher's
    sampling and scoring log-prob 0.25, so ω = 0.8, inside the clip). current: A = log(0.8/0.5) = 0.4700 and
    log(0.25/0.2) = 0.2231; sampled: the student token's A from its sampling log-prob, log(0.8/0.45) = 0.5754, the
    teacher token's from the current one (the student never sampled it), 0.2231. Token-mean of -A·ratio."""
    logp = jnp.asarray([[math.log(0.5), math.log(0.2)]], jnp.float32)
    rollout = jnp.asarray([[math.log(0.45), math.log(0.25)]], jnp.float32)       # the teacher's on its token
    teacher = jnp.asarray([[math.log(0.8), math.log(0.25)]], jnp.float32)
    generated = jnp.asarray([[False, True]])
    mask = jnp.ones((1, 2), jnp.float32)
    ratios = (0.5 / 0.45, 0.2 / 0.25)
    expected = {"current": (math.log(0.8 / 0.5), math.log(0.25 / 0.2)),
                "sampled": (math.log(0.8 / 0.45), math.log(0.25 / 0.2))}
    for form, advantages in expected.items():
        value, _ = losses.sti_opd_loss(logp, rollout, teacher, generated, mask, advantage_logp=form)
        hand = -(advantages[0] * ratios[0] + advantages[1] * ratios[1]) / 2
        assert float(value) == pytest.approx(hand, rel=1e-5), form


def test_advantage_logp_reaches_the_loss_from_the_run_config():
    assert make_method(build_config("actfirst", preset="cpu")).loss_config().advantage_logp == "current"
    sampled = build_config("sti", preset="paper", advantage_logp="sampled")
    assert make_method(sampled).loss_config().advantage_logp == "sampled"
    assert not any("Trinity" in d for d in sampled.departures)
    assert any("Trinity" in d for d in build_config("vanilla-opd", preset="paper").departures)
