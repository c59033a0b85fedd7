"""Paired comparison of evaluations (jaxopd.methods.paired, experiments.compare_evals): hand-counted values, the
bootstrap against a plain loop, and bad inputs."""
from __future__ import annotations

import json

import numpy as np
import pytest

from jaxopd_experiments import compare_evals
from jaxopd.methods.paired import mcnemar_exact_p, outcomes_of, paired_comparison, restrict_to_common


def _episodes(wins: dict[tuple[str, int], bool]) -> list[dict]:
    return [{"task_id": t, "seed": s, "won": w, "task_type": "pick_and_place_simple"} for (t, s), w in wins.items()]


@pytest.mark.parametrize("first, second, expected", [
    (0, 0, 1.0), (5, 0, 2 / 32), (0, 5, 2 / 32), (1, 4, 2 * 6 / 32), (3, 3, 1.0), (10, 2, 2 * (1 + 12 + 66) / 4096),
])
def test_mcnemar_exact_p_hand_computed(first, second, expected):
    assert mcnemar_exact_p(first, second) == pytest.approx(expected)


def test_mcnemar_rejects_negative_counts():
    with pytest.raises(ValueError, match="discordant counts"):
        mcnemar_exact_p(-1, 2)


def test_hand_counted_comparison():
    base = {("A", 42): True, ("A", 43): False, ("B", 42): False, ("B", 43): False}
    other = {("A", 42): True, ("A", 43): True, ("B", 42): True, ("B", 43): False}
    result = paired_comparison({"base": base, "other": other}, resamples=200)
    assert (result["episodes"], result["tasks"], result["seeds"], result["baseline"]) == (4, 2, [42, 43], "base")
    b, o = result["agents"]["base"], result["agents"]["other"]
    assert (b["successes"], b["success_rate"], b["per_seed"]) == (1, 0.25, {"42": 0.5, "43": 0.0})
    assert (o["successes"], o["success_rate"], o["per_seed"]) == (3, 0.75, {"42": 1.0, "43": 0.5})
    assert "difference" not in b
    assert o["difference"] == pytest.approx(0.5)
    assert (o["only_this"], o["only_baseline"]) == (2, 0)
    assert o["mcnemar_p"] == pytest.approx(0.5)
    # every task: the other agent wins exactly one episode more of its two -> every resample differs by 0.5
    assert o["difference_ci"] == pytest.approx([0.5, 0.5])


def test_identical_agents_have_a_zero_interval_and_p_one():
    wins = {(f"t{i}", s): (i + s) % 3 == 0 for i in range(7) for s in (42, 43, 44)}
    result = paired_comparison({"a": wins, "b": dict(wins)}, resamples=500)
    row = result["agents"]["b"]
    assert row["difference"] == 0.0 and row["difference_ci"] == [0.0, 0.0] and row["mcnemar_p"] == 1.0


def test_bootstrap_matches_a_plain_loop():
    rng = np.random.default_rng(3)
    tasks, seeds = [f"task{i}" for i in range(9)], (42, 43, 44)
    a = {(t, s): bool(rng.random() < 0.3) for t in tasks for s in seeds}
    b = {(t, s): bool(rng.random() < 0.5) for t in tasks for s in seeds}
    result = paired_comparison({"a": a, "b": b}, resamples=300, seed=11)
    draws = np.random.default_rng(11).integers(0, len(tasks), size=(300, len(tasks)))
    rates_a, rates_b = [], []
    for row in draws:
        picked = [(tasks[i], s) for i in row for s in seeds]
        rates_a.append(np.mean([a[k] for k in picked]))
        rates_b.append(np.mean([b[k] for k in picked]))
    rates_a, rates_b = np.array(rates_a), np.array(rates_b)
    assert result["agents"]["a"]["success_ci"] == pytest.approx(list(np.quantile(rates_a, [0.025, 0.975])))
    assert result["agents"]["b"]["difference_ci"] == pytest.approx(list(np.quantile(rates_b - rates_a,
                                                                                    [0.025, 0.975])))
    low, high = result["agents"]["b"]["difference_ci"]
    assert low <= result["agents"]["b"]["difference"] <= high


def test_baseline_by_name():
    a = {("A", 1): True, ("B", 1): False}
    b = {("A", 1): False, ("B", 1): False}
    result = paired_comparison({"a": a, "b": b}, baseline="b", resamples=10)
    assert result["baseline"] == "b" and result["agents"]["a"]["difference"] == 0.5
    assert (result["agents"]["a"]["only_this"], result["agents"]["a"]["only_baseline"]) == (1, 0)
    with pytest.raises(ValueError, match="baseline 'c' is not one"):
        paired_comparison({"a": a, "b": b}, baseline="c")


def test_different_episodes_are_an_error_and_common_restricts():
    a = {("A", 42): True, ("B", 42): False, ("C", 42): True}
    b = {("A", 42): False, ("B", 42): True}
    with pytest.raises(ValueError, match=r"1 of 'a'.s episodes are missing \(first: task 'C', seed 42\)"):
        paired_comparison({"a": a, "b": b})
    common, left_out = restrict_to_common({"a": a, "b": b})
    assert left_out == 1 and set(common["a"]) == set(common["b"]) == {("A", 42), ("B", 42)}
    assert paired_comparison(common, resamples=10)["agents"]["b"]["difference"] == 0.0


def test_outcomes_of_rejects_duplicates_and_missing_fields():
    assert outcomes_of(_episodes({("A", 42): True})) == {("A", 42): True}
    with pytest.raises(ValueError, match="repeats task 'A' under seed 42"):
        outcomes_of(_episodes({("A", 42): True}) * 2)
    with pytest.raises(ValueError, match="episode 0 has no task_id"):
        outcomes_of([{"seed": 42, "won": True}])


def _write(folder, wins):
    folder.mkdir(parents=True)
    (folder / "evaluation.json").write_text(json.dumps({"meta": {}, "summaries": [], "episodes": _episodes(wins)}))
    return folder


def test_command_line_writes_the_comparison(tmp_path, capsys):
    base = _write(tmp_path / "base", {("A", 42): True, ("A", 43): False, ("B", 42): False, ("B", 43): False})
    other = _write(tmp_path / "other", {("A", 42): True, ("A", 43): True, ("B", 42): True, ("B", 43): False})
    out = tmp_path / "out"
    assert compare_evals.main(["--eval", f"base={base}", "--eval", f"other={other}", "--resamples", "50",
                               "--out", str(out)]) == 0
    result = json.loads((out / "compare.json").read_text())
    assert result["agents"]["other"]["difference"] == pytest.approx(0.5)
    assert result["sources"]["base"].endswith("evaluation.json") and "compare_evals" in result["command"]
    table = (out / "compare.md").read_text()
    assert "| other | 3/4 | 75.0 [" in table and "+50.0 [+50.0, +50.0]" in table and "| 2 / 0 | 0.500 |" in table
    assert (out / "compare.png").stat().st_size > 0


def test_command_line_bad_inputs(tmp_path, capsys):
    a = _write(tmp_path / "a", {("A", 42): True, ("B", 42): False})
    b = _write(tmp_path / "b", {("A", 42): True})
    out = str(tmp_path / "out")
    assert compare_evals.main(["--eval", f"a={a}", "--out", out]) == 2
    assert "at least two evaluations" in capsys.readouterr().err
    assert compare_evals.main(["--eval", f"a={a}", "--eval", f"b={b}", "--out", out]) == 2
    assert "did not play the same episodes" in capsys.readouterr().err
    assert compare_evals.main(["--eval", f"a={a}", "--eval", f"b={b}", "--baseline", "z", "--out", out]) == 2
    assert "--baseline 'z' is not one of" in capsys.readouterr().err
    assert compare_evals.main(["--eval", f"a={a}", "--eval", f"a={b}", "--out", out]) == 2
    assert "labels must differ" in capsys.readouterr().err
    assert compare_evals.main(["--eval", f"a={a}", "--eval", f"b={tmp_path / 'none'}", "--out", out]) == 2
    assert "no evaluation file" in capsys.readouterr().err
    assert compare_evals.main(["--eval", f"a={a}", "--eval", f"b={b}", "--common", "--resamples", "10",
                               "--out", out]) == 0
    assert "1 episodes played by some evaluations only were left out" in capsys.readouterr().out
