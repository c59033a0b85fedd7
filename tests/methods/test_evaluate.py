"""Student evaluation (``jaxopd.methods.evaluate``, ``experiments.evaluate``): the summary against hand-counted
values, the episode record, an end-to-end evaluation with a scripted engine on a generated ALFWorld game (a won
episode, an episode whose engine raises, a turn-limit episode), the command line's outputs and bad-input exit
codes, and the learning-curve plots."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from tests.rollout.test_strategies import ScriptedEngine, full_text

from jaxopd_envs.base import Observation, Task
from jaxopd_envs.pool import EnvPool
from jaxopd_experiments import evaluate as cli
from jaxopd.methods.benchmarks import GeneratedCounts, resolve_source
from jaxopd.methods.evaluate import (CURVE_FILES, OUTPUT_FILES, EpisodeRecord, evaluate_policy, markdown_table,
                                     plot_learning_curves, read_history, summarize, write_evaluation)
from jaxopd.rollout.strategies.base import RolloutConfig, request_seed
from jaxopd.rollout.thinking import ThinkingBudget
from jaxopd.rollout.trajectory import Trajectory, Turn
from jaxopd.tokenizer import Qwen3Tokenizer

ROOT = Path(__file__).resolve().parents[2]
BUDGET = ThinkingBudget(first_stage_tokens=64, total_tokens=96, second_stage_max_tokens=16)


def rec(task_id, task_type, seed, won, rounds, score):
    return EpisodeRecord(task_id=task_id, task_type=task_type, seed=seed, won=won, score=score, rounds=rounds,
                         end_reason="done" if won else "max_turns", split="eval")


# Two seeds x three tasks: t1, t2 of type A, t3 of type B.
HAND = [rec("t1", "A", 42, True, 5, 100.0), rec("t2", "A", 42, False, 30, 40.0), rec("t3", "B", 42, True, 7, 100.0),
        rec("t1", "A", 43, False, 30, 20.0), rec("t2", "A", 43, False, 30, 0.0), rec("t3", "B", 43, True, 9, 100.0)]


# ------------------------------------------------------------------------------------------------- summarize
def test_summarize_matches_hand_counts():
    s = summarize(HAND, benchmark="scienceworld", split="eval")
    assert list(s) == ["benchmark", "split", "seeds", "std", "num_episodes", "num_tasks", "num_errors",
                       "end_reasons", "overall", "per_seed", "task_types"]
    assert s["seeds"] == [42, 43] and s["num_episodes"] == 6 and s["num_tasks"] == 3 and s["num_errors"] == 0
    assert s["end_reasons"] == {"done": 3, "max_turns": 3}
    # per seed: 42 -> SR 2/3, rounds (5+30+7)/3 = 14, successful (5+7)/2 = 6, score 80; 43 -> 1/3, 23, 9, 40
    assert s["per_seed"]["42"] == {"episodes": 3, "successes": 2, "success_rate": pytest.approx(2 / 3),
                                   "mean_rounds": 14.0, "mean_rounds_success": 6.0, "mean_score": 80.0, "errors": 0}
    assert s["per_seed"]["43"] == {"episodes": 3, "successes": 1, "success_rate": pytest.approx(1 / 3),
                                   "mean_rounds": 23.0, "mean_rounds_success": 9.0, "mean_score": 40.0, "errors": 0}
    root2 = math.sqrt(2)                # sample std of two values a, b is |a - b| / sqrt(2)
    o = s["overall"]
    assert o["success_rate"] == {"mean": pytest.approx(0.5), "std": pytest.approx(root2 / 6), "n": 2}
    assert o["mean_rounds"] == {"mean": 18.5, "std": pytest.approx(4.5 * root2), "n": 2}
    assert o["mean_rounds_success"] == {"mean": 7.5, "std": pytest.approx(1.5 * root2), "n": 2}
    assert o["mean_score"] == {"mean": 60.0, "std": pytest.approx(20 * root2), "n": 2}
    a, b = s["task_types"]["A"], s["task_types"]["B"]
    assert list(s["task_types"]) == ["A", "B"] and a["episodes"] == 4 and a["tasks"] == 2 and b["tasks"] == 1
    assert a["success_rate"] == {"mean": 0.25, "std": pytest.approx(0.25 * root2), "n": 2}     # 1/2 and 0
    assert a["mean_score"] == {"mean": 40.0, "std": pytest.approx(30 * root2), "n": 2}         # 70 and 10
    assert a["mean_rounds_success"] == {"mean": 5.0, "std": None, "n": 1}                      # no success in 43
    assert b["success_rate"] == {"mean": 1.0, "std": 0.0, "n": 2}
    assert b["per_seed_success_rate"] == {"42": 1.0, "43": 1.0}
    table = markdown_table(s)
    assert "| Success rate (%) | 50.0 ± 23.6 |" in table and "| Score | 60.0 ± 28.3 |" in table
    assert summarize(list(reversed(HAND)), benchmark="scienceworld", split="eval") == s      # order-free


def test_summarize_one_seed_has_no_std_and_orders_alfworld_types_like_table_1():
    records = [EpisodeRecord("x", "pick_two_obj_and_place", 42, True, 1.0, 12, "done"),
               EpisodeRecord("y", "pick_and_place_simple", 42, False, 0.0, 3, "error: RuntimeError: boom")]
    s = summarize(records, benchmark="alfworld", split="valid_seen")
    assert s["overall"]["success_rate"] == {"mean": 0.5, "std": None, "n": 1}
    assert list(s["task_types"]) == ["pick_and_place_simple", "pick_two_obj_and_place"]
    assert [t["label"] for t in s["task_types"].values()] == ["Pick", "Pick2"]
    assert s["num_errors"] == 1 and s["per_seed"]["42"]["errors"] == 1 and s["end_reasons"] == {"done": 1, "error:": 1}
    assert "| Success rate (%) | 50.0 |" in markdown_table(s)


def test_write_evaluation_writes_every_output(tmp_path):
    s = summarize(HAND, benchmark="scienceworld", split="eval")
    paths = write_evaluation(tmp_path, s, HAND, {"command": "test", "departures": ["none really"]})
    assert [p.name for p in paths] == list(OUTPUT_FILES) and all(p.stat().st_size > 0 for p in paths)
    data = json.loads((tmp_path / "evaluation.json").read_text())
    assert data["summaries"][0]["overall"]["success_rate"]["mean"] == 0.5 and len(data["episodes"]) == 6
    lines = (tmp_path / "episodes.csv").read_text().splitlines()
    assert lines[0] == "task_id,task_type,seed,won,score,rounds,end_reason,split,instruction" and len(lines) == 7
    assert "none really" in (tmp_path / "evaluation.md").read_text()


# ------------------------------------------------------------------------------------------------- records
def test_episode_record_from_trajectory():
    task = Task(benchmark="scienceworld", split="eval", task_id="scienceworld/eval/boil-5", task_type="boil")

    def obs(text, turn, score, won=False):
        return Observation(text=text, instruction="Boil water.", turn=turn, score=score, won=won, done=won)

    first = obs("You are in the kitchen.", 0, 0.0)
    turns = (Turn(index=1, observation=first, action="look around", next_observation=obs("A kitchen.", 1, 10.0),
                  action_source="full"),
             Turn(index=2, observation=obs("A kitchen.", 1, 10.0), action="",
                  next_observation=obs("No known action matches that input.", 2, 35.0), action_source="full"))
    trajectory = Trajectory(task=task, strategy="vanilla", initial_observation=first, turns=turns,
                            end_reason="max_turns")
    assert EpisodeRecord.from_trajectory(trajectory, 43) == EpisodeRecord(
        task_id="scienceworld/eval/boil-5", task_type="boil", seed=43, won=False, score=35.0, rounds=2,
        end_reason="max_turns", split="eval", actions=("look around", ""),
        feedback=("A kitchen.", "No known action matches that input."), answers=("", ""), instruction="Boil water.")
    won = trajectory.replace(turns=turns[:1] + (turns[1].replace(next_observation=obs("Boiled.", 2, 100.0, True)),),
                             end_reason="done")
    record = EpisodeRecord.from_trajectory(won, 44)
    assert record.won and record.score == 100.0 and record.rounds == 2 and record.end_reason == "done"
    empty = Trajectory(task=task, strategy="vanilla", initial_observation=first, turns=(),
                       end_reason="prompt_over_budget")
    assert EpisodeRecord.from_trajectory(empty, 42).rounds == 0


# ------------------------------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def tok():
    return Qwen3Tokenizer()


@pytest.fixture(scope="module")
def alfworld(tmp_path_factory):
    """One generated ALFWorld valid_unseen game, its walkthrough and a one-slot thread pool."""
    pytest.importorskip("alfworld")
    source = resolve_source("alfworld", "generated",
                            counts=GeneratedCounts(train=0, valid_seen=0, valid_unseen=1),
                            cache_dir=tmp_path_factory.mktemp("eval_games"), progress=False)
    (task,) = source.tasks("valid_unseen")
    with source.env_factory() as env:
        walkthrough = env.walkthrough(task)
    with EnvPool(source.env_factory, num_slots=1, backend="thread") as pool:
        yield source, pool, task, walkthrough


def walkthrough_script(walkthrough):
    return lambda seen: full_text(walkthrough[seen.turn - 1] if seen.turn <= len(walkthrough) else "look")


class FailingEngine(ScriptedEngine):
    """A scripted engine whose ``submit`` raises ``error()`` for one sampling seed."""

    def __init__(self, tokenizer, script, fail_seed, error=lambda: RuntimeError("scripted failure")):
        super().__init__(tokenizer, script)
        self.fail_seed = fail_seed
        self.error = error

    def submit(self, request):
        if request.params.seed == self.fail_seed:
            raise self.error()
        return super().submit(request)


def test_evaluate_policy_end_to_end_with_a_scripted_engine(tok, alfworld):
    source, pool, task, walkthrough = alfworld
    assert 1 < len(walkthrough) <= 10
    # seed 42 follows the walkthrough and wins; seed 43's engine raises at turn 2, after one executed turn
    engine = FailingEngine(tok, walkthrough_script(walkthrough),
                           fail_seed=request_seed(43, task.task_id, 2, "full"))
    config = RolloutConfig(max_turns=10, max_prompt_tokens=4096, thinking_budget=BUDGET, temperature=0.7)
    summary, records = evaluate_policy(engine, pool, tok, [task], seeds=(42, 43), rollout_config=config,
                                       greedy=True, progress=False)
    assert records[0].instruction.startswith("Your task is to: ") and records[1].instruction == records[0].instruction
    common = dict(task_id=task.task_id, task_type=task.task_type, split="valid_unseen",
                  instruction=records[0].instruction)
    won_feedback, won_answers = records[0].feedback, records[0].answers
    assert len(won_feedback) == len(walkthrough) and all(won_feedback)
    assert won_answers == tuple(full_text(action) for action in walkthrough)
    assert records == [
        EpisodeRecord(**common, seed=42, won=True, score=1.0, rounds=len(walkthrough), end_reason="done",
                      actions=tuple(walkthrough), feedback=won_feedback, answers=won_answers),
        EpisodeRecord(**common, seed=43, won=False, score=0.0, rounds=1,
                      end_reason="error: RuntimeError: scripted failure", actions=(walkthrough[0],),
                      feedback=won_feedback[:1]),
    ]
    assert {s.request.params.temperature for s in engine.seen} == {0.0}              # greedy
    assert summary["overall"]["success_rate"] == {"mean": 0.5, "std": pytest.approx(math.sqrt(0.5)), "n": 2}
    assert summary["num_errors"] == 1 and summary["split"] == "valid_unseen"
    assert summary["task_types"][task.task_type]["episodes"] == 2

    # sampled at the config's temperature, never a valid move: every episode runs to the turn limit
    engine = ScriptedEngine(tok, lambda seen: full_text("look"))
    config = RolloutConfig(max_turns=3, max_prompt_tokens=4096, thinking_budget=BUDGET, temperature=0.4)
    summary, records = evaluate_policy(engine, pool, tok, [task], seeds=(44,), rollout_config=config,
                                       greedy=False, progress=False)
    assert records[0].actions == ("look",) * 3 and len(records[0].feedback) == 3
    assert records == [EpisodeRecord(**common, seed=44, won=False, score=0.0, rounds=3, end_reason="max_turns",
                                     actions=("look",) * 3, feedback=records[0].feedback,
                                     answers=(full_text("look"),) * 3)]
    assert {s.request.params.temperature for s in engine.seen} == {0.4} and len(engine.seen) == 3
    assert pool.trajectory(0).actions == ("look",) * 3
    assert summary["overall"]["mean_rounds"] == {"mean": 3.0, "std": None, "n": 1}


def test_cli_run_writes_its_outputs(tok, alfworld, tmp_path):
    source, _, task, walkthrough = alfworld
    args = cli.build_parser().parse_args([
        "--model-preset", "tiny", "--seeds", "42", "43", "--max-turns", "8", "--max-prompt-tokens", "4096",
        "--think-tokens", "64", "96", "--slots", "2", "--out", str(tmp_path / "out"), "--no-progress"])
    options = cli.options_from_args(args)
    assert cli.preflight(options, source=source) is source
    config = cli.engine_config_for(options)
    assert config.max_seq_len >= 4096 + 96 and config.max_slots == 2 and not config.scoring
    results = cli.run_evaluation(
        options, source, model_and_info=(None, {"name": "scripted"}), tokenizer=tok, pool_backend="thread",
        engine_factory=lambda model, config, tokenizer: ScriptedEngine(tokenizer, walkthrough_script(walkthrough)))
    out = tmp_path / "out"
    assert all((out / name).stat().st_size > 0 for name in OUTPUT_FILES)
    data = json.loads((out / "evaluation.json").read_text())
    (summary,) = data["summaries"]
    assert summary["overall"]["success_rate"] == {"mean": 1.0, "std": 0.0, "n": 2}
    assert summary["overall"]["mean_rounds"]["mean"] == len(walkthrough)
    meta = data["meta"]
    assert meta["random_weights"] and meta["sampling"]["temperature"] == 0.4 and meta["task_counts"] == {
        "valid_unseen": 1}
    assert any("RANDOM weights" in d for d in meta["departures"]) and "machine" in meta
    assert "RANDOM weights" in (out / "evaluation.md").read_text()
    assert [r.won for r in results["records"]] == [True, True]


class Killed(BaseException):
    """What a kill looks like to the evaluation: not an episode's error (those are recorded), the end of the run."""


def test_cli_a_killed_evaluation_resumes_with_the_episodes_it_played(tok, alfworld, tmp_path):
    source, _, task, walkthrough = alfworld
    out = tmp_path / "out"

    def options(*extra):
        return cli.options_from_args(cli.build_parser().parse_args([
            "--model-preset", "tiny", "--seeds", "42", "43", "44", "--max-turns", "8", "--max-prompt-tokens", "4096",
            "--think-tokens", "64", "96", "--slots", "1", "--out", str(out), "--no-progress", *extra]))

    engines = []

    def run(engine_class, opts, **kwargs):
        def factory(model, config, tokenizer):
            engines.append(engine_class(tokenizer, walkthrough_script(walkthrough), **kwargs))
            return engines[-1]
        return cli.run_evaluation(opts, source, model_and_info=(None, {"name": "scripted"}), tokenizer=tok,
                                  pool_backend="thread", engine_factory=factory)

    # one slot plays the seeds in order: 42 and 43 finish, then the run dies at seed 44's first request
    with pytest.raises(Killed):
        run(FailingEngine, options(), fail_seed=request_seed(44, task.task_id, 1, "full"), error=Killed)
    lines = (out / cli.PARTIAL_FILE).read_text().splitlines()
    assert len(lines) == 3 and json.loads(lines[0])["identity"]["seeds"] == [42, 43, 44]
    assert [json.loads(line)["record"]["seed"] for line in lines[1:]] == [42, 43]
    assert not (out / "evaluation.json").exists()
    errored = EpisodeRecord(task_id=task.task_id, task_type=task.task_type, seed=44, won=False, score=0.0, rounds=0,
                            end_reason="error: RuntimeError: the pool was shut down", split="valid_unseen")
    with (out / cli.PARTIAL_FILE).open("a") as handle:       # an episode the kill broke, then a torn line
        handle.write(json.dumps({"record": errored.as_dict()}) + "\n" + '{"record": {"task_id": ')

    # another setting does not take those episodes
    with pytest.raises(ValueError, match="holds the episodes of another evaluation"):
        run(ScriptedEngine, options("--max-turns", "9"))

    results = run(ScriptedEngine, options())
    assert {s.request.params.seed for s in engines[-1].seen} == {request_seed(44, task.task_id, turn, "full")
                                                                  for turn in range(1, len(walkthrough) + 1)}
    assert [(r.seed, r.won, r.rounds) for r in results["records"]] == [(s, True, len(walkthrough))
                                                                      for s in (42, 43, 44)]
    assert results["meta"]["resumed_episodes"] == 2
    assert results["summaries"][0]["overall"]["success_rate"] == {"mean": 1.0, "std": 0.0, "n": 3}
    assert all((out / name).stat().st_size > 0 for name in OUTPUT_FILES)
    assert not (out / cli.PARTIAL_FILE).exists()
    data = json.loads((out / "evaluation.json").read_text())
    assert [episode["seed"] for episode in data["episodes"]] == [42, 43, 44]


def test_evaluation_identity_tells_a_re_exported_student_apart(tmp_path, alfworld):
    source = alfworld[0]
    student = tmp_path / "student"
    student.mkdir()
    (student / "model.safetensors").write_bytes(b"12345678")
    options = cli.options_from_args(cli.build_parser().parse_args(["--student", str(student), "--out", "x"]))
    first = cli.evaluation_identity(options, source)
    assert first["student_files"][0][:2] == ["model.safetensors", 8] and "out" not in first and "slots" not in first
    (student / "model.safetensors").write_bytes(b"123456789")              # exported again
    assert cli.evaluation_identity(options, source) != first


# ------------------------------------------------------------------------------------------------- bad input
def test_cli_bad_input_exits_2_with_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("ALFWORLD_DATA", raising=False)
    out = str(tmp_path / "out")
    cases = [
        (["--student", str(tmp_path / "missing"), "--out", out], "--student"),
        (["--model-preset", "tiny", "--split", "bogus", "--out", out], "'bogus'"),
        (["--model-preset", "tiny", "--benchmark", "scienceworld", "--split", "valid_seen", "--out", out],
         "'valid_seen'"),
        (["--model-preset", "nope", "--out", out], "--model-preset"),
        (["--out", out], "--student"),
        (["--model-preset", "tiny", "--think-tokens", "64", "32", "--out", out], "--think-tokens"),
    ]
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    cases.append((["--model-preset", "tiny", "--out", str(blocker / "sub")], "--out"))
    for argv, needle in cases:
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "\n" not in err and needle in err, (argv, err)
    monkeypatch.setenv("ALFWORLD_DATA", str(tmp_path / "nothing"))
    assert cli.main(["--model-preset", "tiny", "--out", out]) == 2
    err = capsys.readouterr().err.strip()
    assert "ALFWORLD_DATA" in err and "\n" not in err


def test_cli_missing_student_in_a_subprocess_has_no_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "experiments.evaluate", "--student", str(tmp_path / "missing"),
                           "--out", str(tmp_path / "out")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr and "--student" in proc.stderr


# ------------------------------------------------------------------------------------------------- curves
def test_plot_learning_curves_and_history_cli(tmp_path, capsys):
    history = [{"update": u, "wall_s": 600.0 * u, "success_rate_mean": 0.1 * u, "success_rate_std": 0.02,
                "method": method} for method in ("vanilla", "actfirst") for u in (0, 1, 2)]
    paths = plot_learning_curves(history, tmp_path / "plots")
    assert [p.name for p in paths] == list(CURVE_FILES) and all(p.stat().st_size > 0 for p in paths)

    good = tmp_path / "run.jsonl"
    good.write_text("\n".join(json.dumps({k: v for k, v in r.items() if k != "method"}) for r in history[:3]) + "\n")
    assert {r["label"] for r in read_history([good])} == {"run"}
    assert cli.main(["--history", str(good), "--out", str(tmp_path / "curves")]) == 0
    assert all((tmp_path / "curves" / name).is_file() for name in CURVE_FILES)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"update": 1, "wall_s": 2.0}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        read_history([bad])
    capsys.readouterr()
    assert cli.main(["--history", str(bad), "--out", str(tmp_path / "curves2")]) == 2
    assert "success_rate_mean" in capsys.readouterr().err
