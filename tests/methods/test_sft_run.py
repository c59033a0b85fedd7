"""``experiments.train``'s SFT path end to end (``run_sft``): demonstrations of generated ALFWorld games become
samples, the sharded step trains them with the context language-model term, checkpoints resume, and the
exported Hugging Face folder holds the trained weights."""
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

    config = build_config("sft", preset="cpu", batch_size=4, checkpoint_every=2, sft_context_weight=1.0,
                          max_prompt_tokens=1024, max_train_tokens=1152, updates=steps,
                          keep_checkpoints=keep_checkpoints, **overrides)
    args = argparse.Namespace(steps=steps, no_eval=True, export=export, export_at=export_at)
    student = CausalLM(MICRO, rngs=nnx.Rngs(0))
    return run_sft(config, args, source, student, Qwen3Tokenizer(), out, progress=False)


def test_run_sft_trains_with_the_context_term_resumes_and_exports(source, tmp_path):
    from jaxopd.models.weights import load_model

    out = tmp_path / "sft"
    out.mkdir()
    first = sft(source, out, 2, sft_group_by_length=2)          # batches of similar length, resumed the same way
    assert first["steps"] == 2 and first["samples"] == first["data"]["samples"] > 0
    assert first["demonstrations"] == {"kind": "walkthrough", "games": 2, "demonstrated": 2, "failed": {}}
    assert json.loads((out / "config.json").read_text())["sft_context_weight"] == 1.0
    records = [r for r in read_jsonl(out / "train.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        assert np.isfinite(record["loss"]) and record["context_tokens"] > 10 * record["supervised_tokens"]
        assert record["loss"] == pytest.approx(record["nll"] + record["context_nll"], rel=1e-5)
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


def test_held_out_divergence_reads_answers_in_the_configured_thinking(source):
    """The exact reverse KL on held-out states: 0 for a student equal to its teacher, and measured on answers with
    the state thinking when ``sft_thinking`` is ``state`` (more positions than the empty thinking block)."""
    import types

    from jaxopd_experiments.train import held_out_divergence

    student, teacher = CausalLM(MICRO, rngs=nnx.Rngs(0)), CausalLM(MICRO, rngs=nnx.Rngs(1))
    values = {}
    for thinking in ("none", "state"):
        config = build_config("vanilla-opd", preset="cpu", eval_split="train", eval_tasks=1, sft_thinking=thinking)
        for name, model in (("same", teacher), ("other", student)):
            params = nnx.state(model, nnx.Param)
            trainer = types.SimpleNamespace(state=types.SimpleNamespace(params=params))
            values[thinking, name] = held_out_divergence(config, source, Qwen3Tokenizer(), model, teacher,
                                                         lambda trainer=trainer: trainer)()
    assert values["none", "same"] == pytest.approx(0.0, abs=1e-6)
    assert values["state", "same"] == pytest.approx(0.0, abs=1e-6)
    assert values["none", "other"] > 0 and values["state", "other"] > 0
    assert values["none", "other"] != pytest.approx(values["state", "other"], rel=1e-6)


def test_renamed_copies_join_the_corpus_with_their_own_names(source):
    """``sft_renamed_copies=1``: every demonstration turn comes twice, the copy with its classes renamed at random
    (jaxopd_envs.alfworld_names) in prompt and answer alike, its thinking naming the renamed goal."""
    from jaxopd_envs.alfworld_state import parse_goal
    from jaxopd.methods.sft import sft_corpus

    tokenizer = Qwen3Tokenizer()
    plain = sft_corpus(build_config("sft", preset="cpu", sft_thinking="state"), source, tokenizer, progress=False)
    doubled = sft_corpus(build_config("sft", preset="cpu", sft_thinking="state", sft_renamed_copies=1), source,
                         tokenizer, progress=False)
    assert doubled.stats.samples == 2 * plain.stats.samples and doubled.stats.references == 2 * len(plain.references)
    assert doubled.references.keys() == plain.references.keys()        # the originals only
    originals = {tokenizer.decode(s.tokens.tolist()) for s in plain.samples}
    renamed = [tokenizer.decode(s.tokens.tolist()) for s in doubled.samples[plain.stats.samples:]]
    assert not originals & set(renamed)
    for text in renamed:
        instruction = text[text.index("Task: ") + len("Task: "):].split("\n")[0]
        goal = parse_goal(instruction)
        answer = text[text.rindex("<think>"):]
        assert goal is not None and goal.obj in answer
    with pytest.raises(ValueError, match="renamed demonstration copies"):
        build_config("sft", preset="cpu", benchmark="scienceworld", sft_renamed_copies=1)
    with pytest.raises(ValueError, match="learning-rate schedule"):
        build_config("vanilla-opd", preset="cpu", lr_schedule="cosine")
    with pytest.raises(ValueError, match="sft_group_by_length orders SFT's batches"):
        build_config("vanilla-opd", preset="cpu", sft_group_by_length=4)
    with pytest.raises(ValueError, match="sft_group_by_length must be a non-negative integer"):
        build_config("sft", preset="cpu", sft_group_by_length=-1)
    from jaxopd_experiments.train import build_parser, config_from_args
    args = build_parser().parse_args(["--method", "sft", "--out", "unused", "--sft-group-by-length", "32"])
    assert config_from_args(args).sft_group_by_length == 32
    with pytest.raises(ValueError, match="sft_action_weight weights SFT's demonstration tokens"):
        build_config("actfirst", preset="cpu", sft_action_weight=2.0)
    with pytest.raises(ValueError, match="sft_action_weight must be > 0"):
        build_config("sft", preset="cpu", sft_action_weight=0.0)
    args = build_parser().parse_args(["--method", "sft", "--out", "unused", "--sft-action-weight", "3"])
    assert config_from_args(args).sft_action_weight == 3.0
    weighted = sft_corpus(build_config("sft", preset="cpu", sft_thinking="state", sft_action_weight=3.0),
                          source, tokenizer, progress=False)
    assert len(weighted.samples) == plain.stats.samples
    for a, b in zip(plain.samples, weighted.samples):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        assert a.loss_weight is None
        assert tokenizer.decode(b.tokens[b.loss_weight == 3.0].tolist()).startswith("<action>")


def _after_go_or_open(text: str) -> bool:
    """Whether a rendered sample's last history action (the one right before the current observation) went to or
    opened a receptacle."""
    import re

    actions = re.findall(r"\[Step \d+ action\] ([^\n]*)", text)
    return bool(actions) and actions[-1].startswith(("go to ", "open "))


def test_take_copies_add_renamed_copies_of_the_take_turns_only(source):
    """``sft_take_copies=2``: after the whole corpus (here with one renamed copy), two more renamed copies of exactly
    its ``take`` turns, each renamed afresh: none equals a sample before it or the other copy. ``sft_arrival_copies``
    then adds renamed copies of the turns after a ``go to`` or ``open``."""
    from jaxopd.methods.sft import sft_corpus

    tokenizer = Qwen3Tokenizer()

    def action(sample):
        text = tokenizer.decode(sample.tokens.tolist())
        return text[text.rindex("<action>") + len("<action>"):text.rindex("</action>")]

    base = sft_corpus(build_config("sft", preset="cpu", sft_thinking="state", sft_renamed_copies=1), source,
                      tokenizer, progress=False)
    more = sft_corpus(build_config("sft", preset="cpu", sft_thinking="state", sft_renamed_copies=1,
                                   sft_take_copies=2), source, tokenizer, progress=False)
    takes = [s for s in base.samples[:len(base.samples) // 2] if action(s).startswith("take ")]
    assert len(takes) >= 2                                    # the two games' walkthroughs each take something
    assert more.stats.samples == len(more.samples) == base.stats.samples + 2 * len(takes)
    assert more.stats.turns == base.stats.turns + 2 * len(takes)
    assert [s.tokens.tolist() for s in more.samples[:base.stats.samples]] == [s.tokens.tolist() for s in base.samples]
    extra = more.samples[base.stats.samples:]
    assert all(action(s).startswith("take ") for s in extra)
    texts = [tokenizer.decode(s.tokens.tolist()) for s in extra]
    before = {tokenizer.decode(s.tokens.tolist()) for s in base.samples}
    assert len(set(texts)) == len(texts) and not before & set(texts)
    # arrival copies: the turns after a go to or open, renamed afresh again (copies 4 and 5 here)
    both = sft_corpus(build_config("sft", preset="cpu", sft_thinking="state", sft_renamed_copies=1, sft_take_copies=2,
                                   sft_arrival_copies=2), source, tokenizer, progress=False)
    originals = base.samples[:len(base.samples) // 2]
    arrivals = [s for s in originals if _after_go_or_open(tokenizer.decode(s.tokens.tolist()))]
    assert 0 < len(arrivals) < len(originals) and base.stats.history_truncated == 0   # every last action shown
    assert len(both.samples) == len(more.samples) + 2 * len(arrivals)
    assert [s.tokens.tolist() for s in both.samples[:len(more.samples)]] == [s.tokens.tolist() for s in more.samples]
    arrival_texts = [tokenizer.decode(s.tokens.tolist()) for s in both.samples[len(more.samples):]]
    assert all(_after_go_or_open(text) for text in arrival_texts)
    assert len(set(arrival_texts)) == len(arrival_texts) and not (before | set(texts)) & set(arrival_texts)
    with pytest.raises(ValueError, match="sft_take_copies 0"):
        build_config("sft", preset="cpu", benchmark="scienceworld", sft_take_copies=1)
    with pytest.raises(ValueError, match="non-negative"):
        build_config("sft", preset="cpu", sft_take_copies=-1)


def _rewritten_copies(source, tokenizer, thinking, rewrite, **copies):
    """The corpus without and with one copy of ``rewrite``'s turns: checks that exactly the turns it keeps are added,
    after the base samples, each prompt ending on a refused ``go to``; returns the base corpus."""
    from jaxopd_envs.alfworld import REFUSED_FEEDBACK
    from jaxopd.methods.sft import sft_corpus
    from jaxopd.methods.sft_data import walkthrough_turns

    base = sft_corpus(build_config("sft", preset="cpu", sft_thinking=thinking), source, tokenizer, progress=False)
    more = sft_corpus(build_config("sft", preset="cpu", sft_thinking=thinking, **copies), source, tokenizer,
                      progress=False)
    turns = [t for r in base.references.values() for t in walkthrough_turns(r)]
    kept = [rewrite(t) for t in turns]
    assert 0 < sum(k is not None for k in kept) < len(turns)
    assert len(more.samples) == len(base.samples) + sum(k is not None for k in kept)
    assert [s.tokens.tolist() for s in more.samples[:len(base.samples)]] == [s.tokens.tolist() for s in base.samples]
    for sample in more.samples[len(base.samples):]:
        text = tokenizer.decode(sample.tokens.tolist())
        prompt = text[:text.rindex("<think>")]
        assert f"{REFUSED_FEEDBACK}" in prompt[prompt.rindex("action] go to "):]
    return base


def test_refused_copies_add_the_turns_after_a_refused_go_to(source):
    """``sft_refused_copies=1``: after the corpus, one renamed copy of each turn ``refused_turn`` keeps, its prompt
    ending on the refused ``go to`` and "Nothing happens.", its action the demonstrated one; and the engine does answer
    a ``go to`` the receptacle the agent stands at with that refusal."""
    from jaxopd_envs.alfworld import REFUSED_FEEDBACK
    from jaxopd.methods.sft_data import refused_turn

    base = _rewritten_copies(source, Qwen3Tokenizer(), "task-list-act-here", refused_turn, sft_refused_copies=1)
    # the engine's answer to a go to where the agent stands
    reference = next(iter(base.references.values()))
    with source.env_factory() as env:
        task = next(t for t in base.tasks if t.task_id == reference.task_id)
        env.reset(task)
        first = reference.actions[0]
        assert first.startswith("go to ") and env.step(first).text.startswith("You arrive at")
        assert env.step(first).text == REFUSED_FEEDBACK
    with pytest.raises(ValueError, match="sft_refused_copies 0"):
        build_config("sft", preset="cpu", benchmark="scienceworld", sft_refused_copies=1)


def test_missing_copies_add_the_turns_after_a_go_to_a_missing_receptacle(source):
    """``sft_missing_copies=1``: one renamed copy of each turn ``missing_turn`` keeps, its prompt ending on a ``go to``
    one past the last receptacle of the class here and "Nothing happens."; and the engine does refuse that command."""
    from jaxopd_envs.alfworld import REFUSED_FEEDBACK
    from jaxopd.methods.sft_data import missing_receptacle, missing_turn, walkthrough_turns

    base = _rewritten_copies(source, Qwen3Tokenizer(), "task-tool-act-here", missing_turn, sft_missing_copies=1)
    # the engine refuses a go to one past the last receptacle of the class where the agent arrived
    reference = next(iter(base.references.values()))
    first_turns = walkthrough_turns(reference)
    with source.env_factory() as env:
        task = next(t for t in base.tasks if t.task_id == reference.task_id)
        env.reset(task)
        first = reference.actions[0]
        assert first.startswith("go to ") and env.step(first).text.startswith("You arrive at")
        target = missing_receptacle(first_turns[1].inputs, first[len("go to "):])
        assert env.step(f"go to {target}").text == REFUSED_FEEDBACK
    with pytest.raises(ValueError, match="sft_missing_copies 0"):
        build_config("sft", preset="cpu", benchmark="scienceworld", sft_missing_copies=1)


def test_fast_copies_add_every_turn_as_actfirst_fast_requests(source):
    """``sft_fast_copies=1``: after the corpus, every turn once as a next-action request and once as an
    inverse-dynamics request (one renaming for both), each prompt of that mode closed by the empty think block and
    answered by the action tag alone; an inverse-dynamics prompt shows as its target the observation the engine
    answers the demonstrated action with."""
    from jaxopd.methods.sft import sft_corpus
    from jaxopd.methods.sft_data import walkthrough_samples, walkthrough_turns

    tokenizer = Qwen3Tokenizer()
    base = sft_corpus(build_config("sft", preset="cpu", sft_thinking="task-tool-act-here"), source, tokenizer,
                      progress=False)
    more = sft_corpus(build_config("sft", preset="cpu", sft_thinking="task-tool-act-here", sft_fast_copies=1),
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
        assert f"\n{action}\n" in prompt            # one of the state's admissible actions (renamed as the prompt)
        assert ("Target next observation" in prompt) == (index >= turns)
        assert "Respond with only that action" in prompt and "<think>\n\n</think>" not in answer
    # the inverse-dynamics target is the engine's answer to the demonstrated action (unrenamed references here)
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
    with pytest.raises(ValueError, match="sft_fast_copies 0"):
        build_config("sft", preset="cpu", benchmark="scienceworld", sft_fast_copies=1)
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


def test_sft_action_format_is_checked_and_parsed():
    from jaxopd_experiments.train import build_parser, config_from_args
    with pytest.raises(ValueError, match="unknown SFT action format 'wide'"):
        build_config("sft", preset="cpu", sft_action_format="wide")
    assert build_config("vanilla-opd", preset="cpu", sft_action_format="said").sft_action_format == "said"
    args = build_parser().parse_args(["--method", "sft", "--out", "unused", "--sft-action-format", "spaced"])
    assert config_from_args(args).sft_action_format == "spaced"
    assert config_from_args(build_parser().parse_args(["--method", "sft", "--out", "unused"])).sft_action_format \
        == "tight"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--method", "sft", "--out", "unused", "--sft-action-format", "wide"])
