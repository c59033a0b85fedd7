"""``experiments.train``'s SFT path end to end (``run_sft``): demonstrations of generated ALFWorld games become
samples, the sharded step trains them, checkpoints resume, and the exported Hugging Face folder holds the trained
weights; with ``--lora-rank`` and ``--student-layers`` a cut student trains adapters and exports an adapter folder."""
from __future__ import annotations

import argparse
import json

import jax
import numpy as np
import pytest
from tests.methods import test_train_loop
from flax import nnx

from jaxopd.methods.config import build_config
from jaxopd.methods.metrics_log import read_jsonl
from jaxopd.models.decoder import CausalLM, ModelConfig
from jaxopd.tokenizer import QWEN3_VOCAB_SIZE, Qwen3Tokenizer
from jaxopd.train.checkpoint import TrainCheckpointer

pytestmark = pytest.mark.slow  # heavier than the README's test run allows (run in CI: pytest -m slow)

source = test_train_loop.source      # the fixture: two generated ALFWorld training games
MICRO = ModelConfig(hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8, intermediate_size=32,
                    vocab_size=QWEN3_VOCAB_SIZE, dtype="float32", param_dtype="float32")


def sft(source, out, steps, export=None, keep_checkpoints=3, export_at=None, **overrides):
    from jaxopd_experiments.train import run_sft

    config = build_config("sft", preset="cpu", batch_size=4, checkpoint_every=2,
                          max_prompt_tokens=1024, max_train_tokens=1152, updates=steps,
                          keep_checkpoints=keep_checkpoints, **overrides)
    args = argparse.Namespace(steps=steps, no_eval=True, export=export, export_at=export_at)
    student = CausalLM(MICRO, rngs=nnx.Rngs(0))
    return run_sft(config, args, source, student, Qwen3Tokenizer(), out, progress=False)


def test_run_sft_trains_resumes_and_exports(source, tmp_path):
    from jaxopd.models.weights import load_model

    out = tmp_path / "sft"
    out.mkdir()
    first = sft(source, out, 2, sft_group_by_length=2)          # batches of similar length, resumed the same way
    assert first["steps"] == 2 and first["samples"] == first["data"]["samples"] > 0
    assert first["demonstrations"] == {"kind": "walkthrough", "games": 2, "demonstrated": 2, "failed": {}}
    assert json.loads((out / "config.json").read_text())["sft_group_by_length"] == 2
    records = [r for r in read_jsonl(out / "train.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        assert np.isfinite(record["loss"]) and record["supervised_tokens"] > 0
        assert record["loss"] == pytest.approx(record["nll"], rel=1e-5)
    # a run killed after its step-2 checkpoint had logged steps 3 and 4 (and torn a line): the resumed run
    # writes them again, once each
    with (out / "train.jsonl").open("a") as handle:
        for stale in (3, 4):
            handle.write(json.dumps({"kind": "train", "step": stale, "loss": -1.0}) + "\n")
        handle.write('{"kind": "train", "st')
    # other settings do not continue that checkpoint (the grouping window is one); a field config.json predates
    # counts as its default
    from jaxopd.cli import UsageError
    with pytest.raises(UsageError, match=r"different config \(sft_group_by_length differ\)"):
        sft(source, out, 4, sft_group_by_length=3)
    saved = json.loads((out / "config.json").read_text())
    assert saved["sft_group_by_length"] == 2
    from jaxopd.methods.loop import check_and_save_config
    older = tmp_path / "older"
    older.mkdir()
    (older / "config.json").write_text(json.dumps({k: v for k, v in saved.items() if k != "sft_group_by_length"}))
    check_and_save_config(older, build_config("sft", **{**{k: v for k, v in saved.items()
                                                          if k not in ("method", "sft_group_by_length")},
                                                       "eval_seeds": tuple(saved["eval_seeds"])}))
    # resumed to 4 steps: the checkpoint of step 2 continues, and the export holds the trained weights
    second = sft(source, out, 4, export=str(tmp_path / "hf"), keep_checkpoints=1, sft_group_by_length=2)
    with TrainCheckpointer(out / "checkpoints") as checkpointer:
        assert checkpointer.all_steps() == [4]       # --keep-checkpoints 1: the step-2 checkpoint is gone
    records = [r for r in read_jsonl(out / "train.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert records[3]["loss"] < records[0]["loss"]
    exported = load_model(second["export"])
    random_init = nnx.state(CausalLM(MICRO, rngs=nnx.Rngs(0)), nnx.Param)
    difference = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                     for a, b in zip(jax.tree.leaves(nnx.state(exported, nnx.Param)), jax.tree.leaves(random_init)))
    assert difference > 1e-3


def test_run_sft_with_lora_on_a_cut_student_exports_an_adapter_folder(source, tmp_path):
    from jaxopd.models.folders import load_folder
    from jaxopd.models.lora import load_adapters, merged_model
    from jaxopd.models.weights import cut_layers, load_model, save_model

    two_layers = CausalLM(ModelConfig(**{**MICRO.__dict__, "num_layers": 2}), rngs=nnx.Rngs(0))
    save_model(two_layers, tmp_path / "base")
    base_before = (tmp_path / "base" / "model.safetensors").read_bytes()
    student = cut_layers(load_model(tmp_path / "base"), [1])
    config = build_config("sft", preset="cpu", batch_size=4, checkpoint_every=2, max_prompt_tokens=1024,
                          max_train_tokens=1152, updates=3, student=str(tmp_path / "base"), student_layers=(1,),
                          lora_rank=4, lora_alpha=8.0, learning_rate=1e-2)
    args = argparse.Namespace(steps=3, no_eval=True, export=str(tmp_path / "adapter"), export_at=None)
    out = tmp_path / "sft"
    out.mkdir()
    from jaxopd_experiments.train import run_sft
    run_sft(config, args, source, student, Qwen3Tokenizer(), out, progress=False)

    records = [r for r in read_jsonl(out / "train.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in records] == [1, 2, 3] and records[-1]["loss"] < records[0]["loss"]
    record = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (record["r"], record["lora_alpha"], record["jaxopd_layers"]) == (4, 8.0, [1])
    assert record["base_model_name_or_path"] == "../base"
    assert json.loads((tmp_path / "adapter" / "config.json").read_text())["num_hidden_layers"] == 1
    assert (tmp_path / "base" / "model.safetensors").read_bytes() == base_before
    adapters, lora, _ = load_adapters(tmp_path / "adapter")
    assert any(float(np.abs(pair["b"]).max()) > 0 for pair in adapters.values())        # trained
    tokens = np.asarray([[3, 17, 99, 250, 7]], np.int32)
    exported = np.asarray(load_folder(tmp_path / "adapter")(tokens))
    np.testing.assert_allclose(exported, np.asarray(merged_model(student, adapters, lora)(tokens)), atol=1e-5)
    assert np.abs(exported - np.asarray(student(tokens))).max() > 1e-4
    with TrainCheckpointer(out / "checkpoints") as checkpointer:       # checkpoints hold the adapters alone
        assert checkpointer.all_steps()[-1] == 3


def test_held_out_divergence_reads_answers_in_the_configured_thinking(source):
    """The exact reverse KL on held-out states: 0 for a student equal to its teacher, and measured on answers with
    the plan thinking when ``sft_thinking`` is ``plan`` (more positions than the empty thinking block)."""
    import types

    from jaxopd_experiments.train import held_out_divergence

    student, teacher = CausalLM(MICRO, rngs=nnx.Rngs(0)), CausalLM(MICRO, rngs=nnx.Rngs(1))
    values = {}
    for thinking in ("none", "plan"):
        config = build_config("vanilla-opd", preset="cpu", eval_split="train", eval_tasks=1, sft_thinking=thinking)
        for name, model in (("same", teacher), ("other", student)):
            params = nnx.state(model, nnx.Param)
            trainer = types.SimpleNamespace(learner=types.SimpleNamespace(model_params=lambda params=params: params))
            values[thinking, name] = held_out_divergence(config, source, Qwen3Tokenizer(), model, teacher,
                                                         lambda trainer=trainer: trainer)()
    assert values["none", "same"] == pytest.approx(0.0, abs=1e-6)
    assert values["plan", "same"] == pytest.approx(0.0, abs=1e-6)
    assert values["none", "other"] > 0 and values["plan", "other"] > 0
    assert values["none", "other"] != pytest.approx(values["plan", "other"], rel=1e-6)


def test_fast_copies_add_every_turn_as_actfirst_fast_requests(source):
    """``sft_fast_copies=1``: after the corpus, every turn once as a next-action request and once as an
    inverse-dynamics request, each prompt of that mode closed by the empty think block and
    answered by the action tag alone; an inverse-dynamics prompt shows as its target the observation the engine
    answers the demonstrated action with."""
    from jaxopd.methods.sft_data import sft_corpus, walkthrough_samples, walkthrough_turns

    tokenizer = Qwen3Tokenizer()
    base = sft_corpus(build_config("sft", preset="cpu", sft_thinking="plan"), source, tokenizer, progress=False)
    more = sft_corpus(build_config("sft", preset="cpu", sft_thinking="plan", sft_fast_copies=1),
                      source, tokenizer, progress=False)
    turns = len([t for r in base.references.values() for t in walkthrough_turns(r)])
    assert more.stats.skipped == base.stats.skipped == 0
    assert len(more.samples) == len(base.samples) + 2 * turns
    assert [s.tokens.tolist() for s in more.samples[:len(base.samples)]] == [s.tokens.tolist() for s in base.samples]
    fast = more.samples[len(base.samples):]
    for index, sample in enumerate(fast):
        mask = np.asarray(sample.loss_mask)
        start = int(np.argmax(mask))
        assert mask[start:].all() and not mask[:start].any()
        prompt = tokenizer.decode(sample.tokens[:start].tolist())
        answer = tokenizer.decode(sample.tokens[start:].tolist())
        assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
        assert answer.startswith("<action>") and answer.endswith("</action><|im_end|>")
        action = answer[len("<action>"):-len("</action><|im_end|>")]
        assert f"\n{action}\n" in prompt            # one of the state's admissible actions
        assert ("Target next observation" in prompt) == (index >= turns)
        assert "Respond with only that action" in prompt and "<think>\n\n</think>" not in answer
    # the inverse-dynamics target is the engine's answer to the demonstrated action
    reference = next(iter(base.references.values()))
    samples, stats = walkthrough_samples([reference], tokenizer, max_prompt_tokens=1024, mode="inverse_dynamics")
    assert stats.samples == len(reference.actions) == len(samples)
    with source.env_factory() as env:
        env.reset(next(t for t in base.tasks if t.task_id == reference.task_id))
        for sample, action in zip(samples, reference.actions):
            text = tokenizer.decode(sample.tokens.tolist())
            target = text[text.index("Target next observation"):]
            assert env.step(action).text in target[:target.index("Now it is your turn")]
            assert text.endswith(f"<action>{action}</action><|im_end|>")
    with pytest.raises(ValueError, match="unknown SFT sample mode 'draft'"):
        walkthrough_samples([reference], tokenizer, max_prompt_tokens=1024, mode="draft")
    with pytest.raises(ValueError, match="non-negative"):
        build_config("sft", preset="cpu", sft_fast_copies=-1)


@pytest.mark.slow
def test_export_at_writes_the_model_of_an_earlier_step_under_a_cosine_schedule(source, tmp_path):
    """``--export-at 1 DIR``: the step-1 model of the run (the weaker student), besides the final ``--export``;
    with ``lr_schedule="cosine"`` (warm-up over 5 % of 3 steps: none) both differ from the start and each other."""
    from jaxopd_experiments.train import build_parser, config_from_args
    from jaxopd.cli import UsageError
    from jaxopd.models.weights import load_model

    (tmp_path / "run").mkdir()
    summary = sft(source, tmp_path / "run", 3, export=str(tmp_path / "final"),
                  export_at=[("1", str(tmp_path / "early"))], lr_schedule="cosine")
    assert summary["steps"] == 3
    leaves = [jax.tree.leaves(nnx.state(model, nnx.Param)) for model in
              (CausalLM(MICRO, rngs=nnx.Rngs(0)), load_model(tmp_path / "early"), load_model(tmp_path / "final"))]
    start, early, final = ([np.asarray(leaf) for leaf in model] for model in leaves)
    assert max(np.max(np.abs(a - b)) for a, b in zip(start, early)) > 1e-4
    assert max(np.max(np.abs(a - b)) for a, b in zip(early, final)) > 1e-4
    records = [r for r in read_jsonl(tmp_path / "run" / "train.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in records] == [1, 2, 3]
    args = build_parser().parse_args(["--method", "vanilla-opd", "--out", str(tmp_path / "x"),
                                      "--export-at", "1", str(tmp_path / "y")])
    with pytest.raises(UsageError, match="--export-at writes intermediate SFT models"):
        config_from_args(args)
