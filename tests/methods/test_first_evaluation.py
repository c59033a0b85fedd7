"""``experiments.train --first-eval-from RUN``: a run takes the evaluation of update 0 (the untrained student) from
another run folder only when that run agrees in every setting the evaluation depends on; later updates are
evaluated as usual."""
from __future__ import annotations

import json

import pytest

from experiments.train import reuse_first_evaluation
from jaxopd.cli import UsageError
from jaxopd.methods.config import build_config
from jaxopd.methods.run_folder import FIRST_EVALUATION_FIELDS, save_config

FIRST = {"kind": "eval", "step": 0, "time": 1.0, "wall_s": 0.0, "split": "valid_seen", "tasks": 12, "seeds": [42],
         "success_rate_mean": 0.25, "success_rate_std": 0.0, "exact_reverse_kl": 1.144}


def source_run(folder, config, records=(FIRST,)):
    save_config(folder, config)
    (folder / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    episodes = folder / "eval" / "update_00000"
    episodes.mkdir(parents=True)
    (episodes / "episodes.jsonl").write_text("{}\n")
    return folder


def own_evaluation(engine, update):
    return {"evaluated_here": update}


def test_update_0_comes_from_the_run_and_later_updates_are_evaluated(tmp_path):
    vanilla = build_config("vanilla-opd", preset="cpu", student="models/student", teacher="models/teacher")
    actfirst = build_config("actfirst", preset="cpu", student="models/student", teacher="models/teacher",
                            learning_rate=3e-5, updates=7)        # training settings may differ
    run = source_run(tmp_path / "vanilla", vanilla)
    out = tmp_path / "actfirst"
    evaluate = reuse_first_evaluation(run, actfirst, out, own_evaluation)
    first = evaluate(None, 0)
    assert first == {"split": "valid_seen", "tasks": 12, "seeds": [42], "success_rate_mean": 0.25,
                     "success_rate_std": 0.0, "exact_reverse_kl": 1.144, "copied_from": str(run)}
    assert (out / "eval" / "update_00000" / "episodes.jsonl").read_text() == "{}\n"
    assert evaluate(None, 5) == {"evaluated_here": 5}


@pytest.mark.parametrize("field, value", [("eval_tasks", 24), ("eval_seeds", (43,)), ("teacher", "models/other"),
                                          ("eval_max_turns", 10), ("temperature", 0.7)])
def test_another_evaluation_setting_is_refused_and_named(tmp_path, field, value):
    assert field in FIRST_EVALUATION_FIELDS
    common = {"student": "models/student", "teacher": "models/teacher"}
    run = source_run(tmp_path / "vanilla", build_config("vanilla-opd", preset="cpu", **common))
    mine = build_config("sti", preset="cpu", **{**common, field: value})
    with pytest.raises(UsageError, match=rf"used other settings \({field} differ\)"):
        reuse_first_evaluation(run, mine, tmp_path / "sti", own_evaluation)


def test_actionopd_evaluates_otherwise_and_is_refused(tmp_path):
    common = {"student": "models/student", "teacher": "models/teacher"}
    run = source_run(tmp_path / "vanilla", build_config("vanilla-opd", preset="cpu", **common))
    with pytest.raises(UsageError, match="eval_greedy"):
        reuse_first_evaluation(run, build_config("actionopd", preset="cpu", **common), tmp_path / "a", own_evaluation)


def test_a_folder_without_that_evaluation_is_refused(tmp_path):
    config = build_config("vanilla-opd", preset="cpu", student="models/student", teacher="models/teacher")
    with pytest.raises(UsageError, match="not a run folder with an evaluation"):
        reuse_first_evaluation(tmp_path / "missing", config, tmp_path / "out", own_evaluation)
    later = {**FIRST, "step": 5}
    run = source_run(tmp_path / "later", config, records=(later,))
    with pytest.raises(UsageError, match="holds no evaluation of update 0"):
        reuse_first_evaluation(run, config, tmp_path / "out", own_evaluation)
