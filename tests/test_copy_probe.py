"""experiments.copy_probe: the A F A batches, and a short run's records (random weights predict at chance)."""
import json
import math

import numpy as np

from experiments.copy_probe import copy_batch, main


def test_copy_batch_rows_repeat_their_first_ids_after_the_filler():
    rng = np.random.default_rng(0)
    tokens, mask, second = copy_batch(rng, 8, 5, 7, 11)
    assert tokens.shape == mask.shape == second.shape == (8, 17)
    for row in range(8):
        n = int(mask[row].sum())
        gap = n - 10
        assert 0 <= gap <= 7 and mask[row, :n].all() and not mask[row, n:].any()
        np.testing.assert_array_equal(tokens[row, :5], tokens[row, 5 + gap:n])
        # the second copy after its first id: exactly the positions an induction head can predict
        assert np.flatnonzero(second[row]).tolist() == list(range(5 + gap + 1, n))
    assert tokens.max() < 11 and tokens.min() >= 0
    fixed, _, fixed_second = copy_batch(rng, 4, 5, 7, 11, fixed_filler=3)
    assert (fixed_second.sum(axis=1) == 4).all() and (fixed[:, :5] == fixed[:, 8:13]).all()


def test_short_run_writes_records_at_chance(tmp_path, capsys):
    out = tmp_path / "probe.json"
    assert main(["--steps", "2", "--evaluations", "2", "--length", "4", "--filler", "4", "--vocab", "50",
                 "--no-progress", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["step"] for r in result["records"]] == [1, 2]
    assert result["chance_nll"] == math.log(50)
    first = result["records"][0]
    # two steps from random weights: every copied id is still predicted at about chance
    for key in ("second_nll", "held_out_gap4_nll", "held_out_gap16_nll"):
        assert abs(first[key] - math.log(50)) < 0.5, (key, first[key])
    assert out.with_suffix(".md").read_text().startswith("| step |")
    assert out.with_suffix(".png").stat().st_size > 0
    assert "python -m experiments.copy_probe --steps 2" in result["command"]


def test_bad_flags_are_usage_errors(tmp_path, capsys):
    assert main(["--filler", "-1", "--out", str(tmp_path / "x.json")]) == 2
    assert "--filler must be >= 0" in capsys.readouterr().err


def test_command_line_quotes_the_arguments():
    from jaxopd.cli import command_line

    expected = "python -m x --out 'a b.json' --steps 2"
    assert command_line("python -m x", ["--out", "a b.json", "--steps", "2"]) == expected
    assert command_line("python -m x", []) == "python -m x"
