"""experiments.train_report: evaluations made after training (``--evaluation RUN UPDATE DIR``) join a run's
report at the right update and training wall-clock, with the success rate of the evaluation's episodes."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from jaxopd_experiments import train_report
from jaxopd.methods.evaluate import EpisodeRecord, summarize, write_evaluation


def _run_folder(root: Path, name: str, walls: list[float], in_loop: list[dict] = ()) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"method": "actfirst"}))
    lines = [json.dumps({"kind": "train", "step": i + 1, "wall_s": w, "rollout_s": 1.0, "scoring_s": 2.0,
                         "step_s": 3.0, "sync_s": 0.0}) for i, w in enumerate(walls)]
    (folder / "train.jsonl").write_text("\n".join(lines) + "\n")
    if in_loop:
        (folder / "eval.jsonl").write_text("\n".join(json.dumps(r) for r in in_loop) + "\n")
    return folder


def _evaluation(root: Path, name: str, wins: dict[int, list[bool]]) -> Path:
    """An evaluate output folder whose episodes (one per task) win as given per seed."""
    kind = "pick_and_place_simple"
    records = [EpisodeRecord(task_id=f"alfworld/valid_unseen/{kind}-{i}", task_type=kind, seed=seed, won=won,
                             score=float(won), rounds=10 if won else 30,
                             end_reason="done" if won else "max_turns", split="valid_unseen")
               for seed, outcomes in wins.items() for i, won in enumerate(outcomes)]
    summary = summarize(records, benchmark="alfworld", split="valid_unseen")
    write_evaluation(root / name, summary, records, {"command": "test"})
    return root / name


def test_joined_evaluations_take_the_updates_wall_clock_and_success(tmp_path):
    run = _run_folder(tmp_path, "actfirst", [10.0, 25.0, 41.5, 60.0],
                      in_loop=[{"kind": "eval", "step": 2, "wall_s": 25.0, "success_rate_mean": 0.9,
                                "success_rate_std": 0.0}])
    start = _evaluation(tmp_path, "student", {42: [False, False], 43: [True, False], 44: [False, False]})
    middle = _evaluation(tmp_path, "mid", {42: [True, False], 43: [True, True], 44: [False, False]})
    end = _evaluation(tmp_path, "end", {42: [True, True], 43: [True, False], 44: [True, True]})
    out = tmp_path / "report"
    assert train_report.main([str(run), "--evaluation", "actfirst", "0", str(start), "--evaluation", "actfirst", "2",
                              str(middle), "--evaluation", "actfirst", "4", str(end), "--out", str(out)]) == 0
    row = json.loads((out / "runs.json").read_text())[0]
    # per-seed success 0, 0.5, 0 -> mean 1/6; 0.5, 1, 0 -> 0.5 (replaces the in-loop record at update 2); 1, .5, 1
    assert [(h["update"], h["wall_s"]) for h in row["history"]] == [(0, 0.0), (2, 25.0), (4, 60.0)]
    assert [h["success_rate_mean"] for h in row["history"]] == pytest.approx([1 / 6, 0.5, 5 / 6])
    assert row["history"][2]["success_rate_std"] == pytest.approx(0.2886751345948129)   # std(1, .5, 1), ddof 1
    assert row["success_first"] == pytest.approx(1 / 6) and row["success_last"] == pytest.approx(5 / 6)
    assert row["first_eval_update"] == 0 and row["last_eval_update"] == 4
    assert (out / "actfirst" / "eval" / "update_00004" / "evaluation.json").is_file()
    assert (out / "success_vs_update.png").is_file() and (out / "success_vs_wallclock.png").is_file()
    assert "16.7 ± 28.9 → 83.3 ± 28.9" in (out / "table.md").read_text()


@pytest.mark.parametrize("given, message", [
    (["other", "0", "{eval}"], "not one of the runs"),
    (["actfirst", "two", "{eval}"], "whole number"),
    (["actfirst", "-1", "{eval}"], ">= 0"),
    (["actfirst", "9", "{eval}"], "has no update 9"),
    (["actfirst", "1", "{missing}"], "no such folder"),
    (["actfirst", "1", "{run}"], "no evaluation.json"),
])
def test_bad_evaluations_are_named(tmp_path, capsys, given, message):
    run = _run_folder(tmp_path, "actfirst", [10.0, 20.0])
    evaluation = _evaluation(tmp_path, "e", {42: [True]})
    paths = {"{eval}": str(evaluation), "{missing}": str(tmp_path / "nope"), "{run}": str(run)}
    argv = [str(run), "--evaluation", *[paths.get(g, g) for g in given], "--out", str(tmp_path / "out")]
    assert train_report.main(argv) == 2
    assert message in capsys.readouterr().err
