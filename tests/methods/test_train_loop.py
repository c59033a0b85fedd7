"""The training loop end to end on tiny models (``jaxopd.methods.loop.Trainer``): every method runs a few updates on
a generated ALFWorld game with the real engine, teacher scoring, the sharded step and weight sync.

Checked for each method: the losses are finite and the policy version advances one per update; the weights
reach the rollout engine (its log-probabilities of a fixed greedy request change after training); and a run
resumed from a checkpoint takes the same next batch, so its next loss equals the uninterrupted run's.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import shutil

import numpy as np
import pytest
from flax import nnx

from jaxopd.methods.benchmarks import BenchmarkSource
from jaxopd.methods.config import build_config
from jaxopd.methods.loop import Trainer
from jaxopd.methods.metrics_log import read_jsonl
from jaxopd.models.decoder import CausalLM, ModelConfig
from jaxopd.sampler.types import Request, SamplingParams
from jaxopd.tokenizer import QWEN3_VOCAB_SIZE, Qwen3Tokenizer

pytestmark = pytest.mark.slow  # heavier than the README's test run allows (run in CI: pytest -m slow)

MICRO = ModelConfig(hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8, intermediate_size=32,
                    vocab_size=QWEN3_VOCAB_SIZE, dtype="float32", param_dtype="float32")
SMALL = dict(updates=3, batch_size=2, rollout_slots=2, collection_tasks=2, max_turns=2, max_prompt_tokens=1536,
             max_train_tokens=1600, first_stage_tokens=8, total_tokens=16, second_stage_tokens=4,
             fast_action_tokens=6, checkpoint_every=2, learning_rate=1e-2, num_candidates=2, num_teacher_samples=1,
             page_size=64)
PROBE = [151644, 872, 198, 9707, 151645]      # "<|im_start|>user\nHello<|im_end|>"


@pytest.fixture(scope="module")
def tokenizer():
    return Qwen3Tokenizer()


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    pytest.importorskip("alfworld")
    from jaxopd_envs import alfworld_gen
    from jaxopd_envs.alfworld import AlfWorldEnv

    root = alfworld_gen.ensure_games(tmp_path_factory.mktemp("loop_games"), seed=0,
                                     counts={"train": 2, "valid_seen": 0, "valid_unseen": 0}, workers=1,
                                     progress=False)
    return BenchmarkSource("alfworld", root, "generated", functools.partial(AlfWorldEnv, root))


def probe(engine, update):
    """The engine's greedy log-probabilities of a fixed request: they change when new weights arrive."""
    result = engine.submit(Request(PROBE, SamplingParams(max_new_tokens=4, temperature=0.0))).result(120)
    return {"probe_logprobs": [float(x) for x in result.logprobs], "served_version": engine.policy_version}


def train(method, out_dir, source, tokenizer, *, student=None, teacher=None, **overrides):
    config = build_config(method, preset="cpu", **{**SMALL, **overrides})
    trainer = Trainer(config, student=student or CausalLM(MICRO, rngs=nnx.Rngs(0)),
                      teacher=teacher or CausalLM(MICRO, rngs=nnx.Rngs(1)), tokenizer=tokenizer, source=source,
                      out_dir=out_dir, progress=False, evaluate=probe, tensorboard=True, log=lambda message: None)
    return trainer.run()


IMPRINTED = dataclasses.replace(MICRO, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                                intermediate_size=128)


def game_prompts(source, tokenizer, mode="full"):
    """The prompts of the first states of the source's training games, rendered as the strategies render them."""
    from jaxopd.rollout.prompts import PromptInputs, render_prompt

    env = source.env_factory()
    prompts = []
    try:
        for task in env.tasks("train"):
            observation, history = env.reset(task), []
            for action in ("look", "inventory"):
                inputs = PromptInputs(benchmark="alfworld", instruction=observation.instruction, history=history,
                                      observation=observation.text, admissible_actions=observation.admissible_actions)
                prompts.append(render_prompt(tokenizer, mode, inputs, SMALL["max_prompt_tokens"]).token_ids)
                history = [*history, (action, observation.text)]
                observation = env.step(action)
    finally:
        env.close()
    return prompts


def imprint(seed, actions, prompts, tokenizer, steps=100):
    """A small Qwen3 taught by SFT steps to answer ``prompts`` with ``<think>\n\n</think>\n\n<action>A</action>``,
    A drawn from ``actions`` in equal shares: a model whose actions parse, so that ActionOPD's teacher samples are
    valid and its candidates' rewards differ."""
    import jax
    import optax

    from jaxopd.train.buffer import Sample, collate_samples
    from jaxopd.train.step import LossConfig, batch_loss

    model = CausalLM(IMPRINTED, rngs=nnx.Rngs(seed))
    graphdef, params = nnx.split(model)
    samples = []
    for prompt in prompts:               # each prompt with every action: the optimum is equal shares
        for action in actions:
            response = tokenizer.encode(f"<think>\n\n</think>\n\n<action>{action}</action>")
            tokens = np.asarray(prompt + response + [tokenizer.eos_token_id], np.int32)
            mask = np.zeros(len(tokens), bool)
            mask[len(prompt):] = True
            samples.append(Sample(tokens, mask, np.zeros(len(tokens), np.float32), 0))
    batch = collate_samples(samples)
    optimizer = optax.adam(1e-2)
    loss_config = LossConfig(kind="sft", temperature=1.0, max_supervised_tokens=24)

    @jax.jit
    def step(params, opt_state):
        grads = jax.grad(lambda p: batch_loss(p, graphdef, batch, loss_config)[0])(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    opt_state = optimizer.init(params)
    for _ in range(steps):
        params, opt_state = step(params, opt_state)
    return nnx.merge(graphdef, params)


@pytest.mark.parametrize("method,loss,top_k", [
    ("vanilla-opd", None, None), ("vanilla-opd", "opd-exact", None),
    *(pytest.param(m, None, None, marks=pytest.mark.slow) for m in ("actfirst", "sti")),
    pytest.param("actfirst", "opd-exact", 8, marks=pytest.mark.slow)])
def test_method_trains_syncs_and_resumes_exactly(method, loss, top_k, source, tokenizer, tmp_path):
    out = tmp_path / method
    train = functools.partial(globals()["train"], loss=loss, exact_top_k=top_k)
    summary = train(method, out, source, tokenizer)
    assert summary["updates"] == 3
    records = read_jsonl(out / "train.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    for record in records:
        assert np.isfinite(record["loss"]) and np.isfinite(record["grad_norm"])
        assert record["version_lag_max"] <= 1
        if loss == "opd-exact":     # the loss is the exact reverse KL, up to the per-response averaging
            assert record["exact_reverse_kl"] > 0 and np.isfinite(record["sampled_reverse_kl"])
            assert "clip_fraction" not in record
    evals = read_jsonl(out / "eval.jsonl")
    assert [e["step"] for e in evals] == [0, 3]
    assert evals[0]["served_version"] == 0 and evals[1]["served_version"] == 3
    assert evals[0]["probe_logprobs"] != evals[1]["probe_logprobs"]       # the new weights reached the engine
    assert any(p.name.startswith("events") for p in (out / "tensorboard").iterdir())
    assert json.loads((out / "config.json").read_text())["method"] == method

    # "kill" after the checkpoint of update 2 (written with batch 3 already buffered), then resume
    shutil.rmtree(out / "checkpoints" / "3")
    (out / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[:2]))
    (out / "eval.jsonl").write_text(json.dumps(evals[0]) + "\n")
    resumed = train(method, out, source, tokenizer)
    assert resumed["updates"] == 3
    again = read_jsonl(out / "train.jsonl")
    assert [r["step"] for r in again] == [1, 2, 3]
    assert again[2]["loss"] == records[2]["loss"]
    assert again[2]["batch_tokens"] == records[2]["batch_tokens"]


@pytest.mark.slow
def test_actionopd_trains_syncs_and_resumes_exactly(source, tokenizer, tmp_path):
    """ActionOPD through the loop: a teacher imprinted with "look" gives valid samples, a student imprinted with
    "look" and "inventory" gives candidates whose agreement rewards differ, so groups are retained and every
    collection trains; versions advance, the weights reach the engine, and a resumed run repeats the next loss."""
    prompts = game_prompts(source, tokenizer)
    teacher = imprint(1, ["look"], prompts, tokenizer)
    student_state = nnx.state(imprint(0, ["look", "inventory"], prompts, tokenizer))

    def student():
        model = CausalLM(IMPRINTED, rngs=nnx.Rngs(0))
        nnx.update(model, student_state)
        return model

    overrides = dict(rollout_mode="sync", learning_rate=1e-3, batch_size=2, first_stage_tokens=24, total_tokens=32,
                     second_stage_tokens=8, updates=2)
    out = tmp_path / "actionopd"
    summary = train("actionopd", out, source, tokenizer, student=student(), teacher=teacher, **overrides)
    # the paper's accounting: `updates` counts collection steps, each one epoch of minibatches of batch_size
    assert summary["collections"] == 2
    records = read_jsonl(out / "train.jsonl")
    assert [r["step"] for r in records] == list(range(1, summary["updates"] + 1))
    by_collection: dict[int, list] = {}
    for record in records:
        assert np.isfinite(record["loss"]) and np.isfinite(record["grad_norm"]) and record["grad_norm"] > 0
        by_collection.setdefault(record["collection"], []).append(record)
    assert sorted(by_collection) == [0, 1]
    for collection, group in by_collection.items():
        samples = group[0]["collection_samples"]
        assert samples > 0 and len(group) == -(-samples // 2), (collection, samples, len(group))
        assert sum(r["batch_samples"] for r in group) == samples      # one epoch: every sample once
    evals = read_jsonl(out / "eval.jsonl")
    assert [e["served_version"] for e in evals] == [0, summary["updates"]]
    assert evals[0]["probe_logprobs"] != evals[1]["probe_logprobs"]

    last = summary["updates"]
    shutil.rmtree(out / "checkpoints" / str(last))
    (out / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[:-1]))
    (out / "eval.jsonl").write_text(json.dumps(evals[0]) + "\n")
    resumed = train("actionopd", out, source, tokenizer, student=student(), teacher=teacher, **overrides)
    assert resumed["updates"] == last and resumed["collections"] == 2
    again = read_jsonl(out / "train.jsonl")
    assert [r["step"] for r in again] == list(range(1, last + 1))
    assert again[-1]["loss"] == records[-1]["loss"]
    assert again[-1]["collection_samples"] == records[-1]["collection_samples"] > 0   # the checkpoint's counters


@pytest.mark.slow
def test_actionopd_without_a_signal_stops_with_a_clear_error(source, tokenizer, tmp_path):
    """Random micro models never produce a parsable action, so no ActionOPD group ever has a valid teacher action
    and a reward range: the loop must stop with an error naming that, not collect forever. (ActionOPD's training
    path, collection samples with advantages through the same step, is covered with a scripted teacher in
    tests/rollout/test_strategies_engine.py and by the buffer's collection tests.)"""
    with pytest.raises(RuntimeError, match="consecutive collections .* gave no training samples"):
        train("actionopd", tmp_path / "actionopd", source, tokenizer)


def test_a_changed_config_is_not_resumed(source, tokenizer, tmp_path):
    from tests.methods.test_train_run_folder import _checkpoint_with_config

    config = build_config("vanilla-opd", preset="cpu", **SMALL)
    _checkpoint_with_config(tmp_path, build_config("vanilla-opd", preset="cpu", **{**SMALL, "learning_rate": 1.0}))
    trainer = Trainer(config, student=CausalLM(MICRO, rngs=nnx.Rngs(0)), teacher=CausalLM(MICRO, rngs=nnx.Rngs(1)),
                      tokenizer=tokenizer, source=source, out_dir=tmp_path, progress=False, log=lambda m: None)
    with pytest.raises(ValueError, match="learning_rate"):
        trainer.run()


def test_teacher_with_another_vocabulary_is_refused(source, tokenizer, tmp_path):
    import dataclasses
    config = build_config("vanilla-opd", preset="cpu", **SMALL)
    other = CausalLM(dataclasses.replace(MICRO, vocab_size=1000), rngs=nnx.Rngs(1))
    with pytest.raises(ValueError, match="vocabulary"):
        Trainer(config, student=CausalLM(MICRO, rngs=nnx.Rngs(0)), teacher=other, tokenizer=tokenizer, source=source,
                out_dir=tmp_path)


def test_rollout_stats_count_actfirst_guidance_by_hand():
    """Per-update rollout metrics on hand-built trajectories: the action sources over all turns, and ActFirst's
    guided turns with the share whose inverse-dynamics proposal was invalid and whose transition check failed."""
    from jaxopd_envs.base import Observation, Task
    from jaxopd_envs.checks import TransitionCheck
    from jaxopd.rollout.trajectory import Trajectory, Turn

    task = Task(benchmark="alfworld", split="train", task_id="alfworld/train/pick-1", task_type="pick")

    def obs(turn):
        return Observation(text=f"o{turn}", instruction="Put a mug in the sink.", admissible_actions=("look",),
                           turn=turn)

    def turn(index, source, *, guided=False, ok=None, info=None):
        check = None if ok is None else TransitionCheck(ok=ok, reasons=() if ok else ("differs",))
        return Turn(index=index, observation=obs(index - 1), action="look", next_observation=obs(index),
                    action_source=source, guided=guided, check=check, info=info or {})

    def trajectory(*turns):
        return Trajectory(task=task, strategy="actfirst", initial_observation=obs(0), turns=turns,
                          end_reason="max_turns")

    guided = trajectory(turn(1, "inverse_dynamics", guided=True, ok=True),
                        turn(2, "next_action", guided=True, ok=False, info={"invalid_proposal": "go to moon 1"}),
                        turn(3, "next_action"))
    unguided = trajectory(turn(1, "next_action"), turn(2, "next_action"))
    stats = Trainer._rollout_stats([guided, unguided])
    assert stats["rollout_episodes"] == 2 and stats["rollout_mean_turns"] == 2.5
    assert stats["action_source_inverse_dynamics"] == pytest.approx(1 / 5)
    assert stats["action_source_next_action"] == pytest.approx(4 / 5)
    assert stats["guided_turn_fraction"] == pytest.approx(2 / 5)
    assert stats["guided_invalid_proposal_fraction"] == pytest.approx(1 / 2)
    assert stats["guided_check_failed_fraction"] == pytest.approx(1 / 2)
    plain = Trainer._rollout_stats([unguided])         # no guided turn: no guidance metrics
    assert plain["action_source_next_action"] == 1.0 and not any(k.startswith("guided_") for k in plain)
