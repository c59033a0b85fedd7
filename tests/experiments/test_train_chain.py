"""``experiments.train_chain``: the whole chain (teacher, cut probe, student, the four methods, evaluations,
divergence, comparison, report) on a micro base over a small ALFWorld tree with the ``smoke`` profile writes the
summary the results page is built from, every model as an adapter folder that loads, and a second call finds every
stage done and only rebuilds the report; bad input is one line and exit code 2."""
from __future__ import annotations

import json

import pytest

from experiments import train_chain

KEYS = {"success", "success_std", "episodes"}
METHOD_KEYS = KEYS | {"paired_delta", "paired_ci", "reverse_kl_before", "reverse_kl_after", "train_seconds", "updates"}


def test_bad_input_is_refused(capsys, tmp_path):
    assert train_chain.main(["--only", "nothing", "--work", str(tmp_path / "w")]) == 2
    err = capsys.readouterr().err
    assert "no such stage" in err and "teacher" in err and err.count("\n") == 1
    assert train_chain.main(["--base", str(tmp_path / "missing"), "--work", str(tmp_path / "w")]) == 2
    assert "no such folder" in capsys.readouterr().err


@pytest.mark.slow
def test_the_smoke_chain_runs_end_to_end_and_resumes(tmp_path, monkeypatch, capsys):
    pytest.importorskip("alfworld")
    from jaxopd.models.folders import load_folder
    from jaxopd_envs import alfworld_gen
    from micro_models import TWO_LAYER, save_micro_pair

    base, _ = save_micro_pair(tmp_path / "models", shape=TWO_LAYER)
    root = alfworld_gen.ensure_games(tmp_path / "games", seed=0, counts={"train": 2, "valid_seen": 1,
                                                                        "valid_unseen": 1}, workers=1, progress=False)
    monkeypatch.setenv("ALFWORLD_DATA", str(root))
    monkeypatch.setenv("JAXOPD_CACHE", str(tmp_path / "cache"))
    results, work = tmp_path / "results", tmp_path / "work"
    argv = ["--profile", "smoke", "--base", str(base), "--results", str(results), "--work", str(work)]
    assert train_chain.main(argv) == 0
    summary = json.loads((results / "summary.json").read_text())
    assert KEYS <= set(summary["teacher"]) and KEYS <= set(summary["student"])
    assert set(summary["methods"]) == set(train_chain.METHODS)
    for method, entry in summary["methods"].items():
        assert METHOD_KEYS <= set(entry), method
        assert entry["episodes"] == 1 and 0.0 <= entry["success"] <= 1.0
        assert entry["reverse_kl_before"] > 0 and entry["reverse_kl_after"] > 0
    assert summary["env_throughput"]["ratio"] > 0 and summary["env_throughput"]["paper"]["ratio"] == 1.56
    assert [row["strategy"] for row in summary["rollout_quality"]] == ["vanilla", "actfirst", "sti", "actionopd"]
    student = load_folder(results / "models" / "student")
    assert student.config.num_layers == 1                       # cut to the probe's best layer
    for name in ("teacher", *train_chain.METHODS):
        assert (results / "models" / name / "adapter_config.json").is_file(), name
        assert load_folder(results / "models" / name).config.num_layers == (2 if name == "teacher" else 1)
    assert (results / "curves" / "success_vs_update.png").is_file()
    assert "| actfirst |" in (results / "summary.md").read_text()
    from jaxopd.methods.metrics_log import read_jsonl
    firsts = {m: next(r for r in read_jsonl(results / "curves" / m / "eval.jsonl") if r["step"] == 0)
              for m in train_chain.METHODS}
    assert "copied_from" not in firsts["vanilla-opd"] and "copied_from" not in firsts["actionopd"]  # greedy: its own
    for method in ("actfirst", "sti"):      # the untrained student is evaluated once for methods that evaluate alike
        assert firsts[method]["copied_from"] == str(work / "runs" / "vanilla-opd"), firsts[method]
        assert firsts[method]["success_rate_mean"] == firsts["vanilla-opd"]["success_rate_mean"]
    capsys.readouterr()
    assert train_chain.main(argv) == 0                          # everything done: only the report is rebuilt
    lines = capsys.readouterr().out.splitlines()
    assert sum(line.endswith(": done") for line in lines) == len(train_chain.Chain(
        train_chain.PROFILES["smoke"], results=results, work=work, base=str(base), progress=False).stages()) - 1

    # what the results keep is enough to go on from on another machine: without the work folder (checkpoints, logs,
    # run folders) every stage is still done and the report is the same
    import shutil
    for name in ("teacher", "student", *train_chain.METHODS):
        assert (results / "eval" / name / "evaluation.json").is_file(), name
    for method in train_chain.METHODS:
        assert (results / "curves" / method / "config.json").is_file(), method
    assert set(json.loads((results / "timings.json").read_text())) >= {"teacher", "student", *train_chain.METHODS}
    shutil.rmtree(work)
    capsys.readouterr()
    assert train_chain.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    ran = [line.split("] ")[1] for line in lines if not line.endswith(": done")]
    assert ran[:1] == [f"report: running (log {work}/logs/report.log)"]
    again = json.loads((results / "summary.json").read_text())
    assert again["methods"] == summary["methods"] and again["teacher"] == summary["teacher"]


def _run(updates, train_s, curve):
    return {"updates": updates, "train_wall_s": train_s, "eval_split": "valid_seen",
            "history": [{"update": u, "wall_s": w, "success_rate_mean": s} for u, w, s in curve]}


def test_actfirst_against_vanilla_times_the_papers_ratio_and_says_when_it_is_undefined():
    vanilla = _run(10, 3000.0, [(0, 0.0, 0.1), (5, 1600.0, 0.3), (10, 3100.0, 0.5)])
    actfirst = _run(10, 2500.0, [(0, 0.0, 0.1), (5, 1200.0, 0.5), (10, 2400.0, 0.6)])
    speed = train_chain.speed_comparison({"vanilla-opd": vanilla, "actfirst": actfirst})
    # vanilla's training seconds (its runs' own count, not the last evaluation's) over ActFirst's time to 50 %
    assert speed["vanilla_gain"] == pytest.approx(0.4) and speed["actfirst_time_to_it_s"] == 1200.0
    assert speed["ratio"] == pytest.approx(3000.0 / 1200.0)
    assert speed["same_updates_ratio"] == pytest.approx(3000.0 / 2500.0)
    assert "in 2.50x less training time" in train_chain.summary_table(
        {"teacher": None, "student": None, "methods": {}, "actfirst_vs_vanilla": speed})

    slow = _run(10, 2500.0, [(0, 0.0, 0.1), (10, 2400.0, 0.4)])
    assert train_chain.speed_comparison({"vanilla-opd": vanilla, "actfirst": slow})["ratio"] is None

    # a vanilla run that never rose: every ActFirst point "reaches" it at update 0, which is no speed-up at all
    flat = _run(10, 3000.0, [(0, 0.0, 0.0), (10, 3100.0, 0.0)])
    speed = train_chain.speed_comparison({"vanilla-opd": flat, "actfirst": _run(8, 2000.0, [(0, 0.0, 0.0)])})
    assert speed["ratio"] is None and speed["actfirst_time_to_it_s"] is None and speed["vanilla_gain"] == 0.0
    assert speed["same_updates_ratio"] is None                  # different numbers of updates are not compared
    text = train_chain.summary_table({"teacher": None, "student": None, "methods": {}, "actfirst_vs_vanilla": speed})
    assert "undefined, vanilla OPD did not raise it (0.0 → 0.0 % on valid_seen)" in text
