"""experiments.copy_probe: the A F A and multi-copy batches, a short run's records (random weights predict at chance),
and the warm-up's export: the trained sub-vocabulary model scattered back into a full Hugging Face folder."""
import json
import math

import numpy as np
import pytest

from experiments.copy_probe import copy_batch, main, multi_copy_batch, recent_copy_batch


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


def test_multi_copy_rows_copy_spans_within_the_gap():
    rng = np.random.default_rng(1)
    length, max_gap, width = 4, 9, 40
    tokens, mask, second = multi_copy_batch(rng, 200, width, length, max_gap, 300)
    assert tokens.shape == (200, width) and mask.all() and tokens.min() >= 0 and tokens.max() < 300
    copies = 0
    for row in range(200):
        for start in range(0, width, length):
            flagged = second[row, start:start + length]
            if start == 0 or start + length > width:
                assert not flagged.any()
                continue
            assert not flagged[0] and (flagged[1:].all() or not flagged.any())
            if flagged.any():
                copies += 1
                span = tokens[row, start:start + length]
                # some source ending 0..max_gap ids before the segment holds the same ids
                assert any(np.array_equal(tokens[row, start - g - length:start - g], span)
                           for g in range(0, min(max_gap, start - length) + 1)), (row, start)
    segments = 200 * (width // length - 1)
    assert abs(copies / segments - 0.5) < 0.05   # about half the segments are copies


def test_export_scatters_the_trained_rows_into_the_full_model(tmp_path):
    from flax import nnx

    from jaxopd.models.decoder import CausalLM, ModelConfig
    from jaxopd.models.weights import load_model

    out, hf = tmp_path / "probe.json", tmp_path / "hf"
    assert main(["--steps", "3", "--evaluations", "3", "--length", "4", "--filler", "4", "--vocab", "20",
                 "--held-out-gaps", "2", "--seed", "3", "--no-progress", "--export", str(hf), "--out", str(out)]) == 0
    exported = load_model(hf)
    start = CausalLM(ModelConfig.preset("tiny"), rngs=nnx.Rngs(3))
    rows = np.sort(np.random.default_rng(3).choice(start.config.vocab_size, 20, replace=False))
    moved = np.flatnonzero(np.abs(np.asarray(exported.embedding_vd[...]) - np.asarray(start.embedding_vd[...]))
                           .max(axis=1) > 0)
    assert moved.tolist() == rows.tolist()   # the trained rows, and no other
    # the exported model, restricted to those rows, gives the run's last held-out NLL
    import jax
    import jax.numpy as jnp

    from jaxopd.models.decoder import dense_causal_attend
    tokens, mask, second = copy_batch(np.random.default_rng(4), 32, 4, 2, 20, fixed_filler=2)
    exported.embedding_vd = nnx.Param(exported.embedding_vd[...][rows])
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    hidden, _ = exported.hidden_states(jnp.asarray(tokens), positions, dense_causal_attend(positions, mask))
    logp = jax.nn.log_softmax(exported.logits(hidden[:, :-1]), axis=-1)
    picked = np.take_along_axis(np.asarray(logp), tokens[:, 1:, None], axis=-1)[..., 0]
    nll = -(picked * second[:, 1:]).sum() / second[:, 1:].sum()
    last = json.loads(out.read_text())["records"][-1]
    assert abs(nll - last["held_out_gap2_nll"]) < 1e-4
    # a second stage starts from the export: its first record continues from there, not from chance
    again = tmp_path / "again.json"
    assert main(["--init", str(hf), "--steps", "1", "--evaluations", "1", "--length", "4", "--filler", "4",
                 "--vocab", "20", "--held-out-gaps", "2", "--seed", "3", "--learning-rate", "1e-9", "--no-progress",
                 "--out", str(again)]) == 0
    assert abs(json.loads(again.read_text())["records"][0]["held_out_gap2_nll"] - nll) < 1e-3


def test_multi_rows_need_room_for_a_copy(tmp_path, capsys):
    assert main(["--rows", "multi", "--width", "10", "--length", "8", "--out", str(tmp_path / "x.json")]) == 2
    assert "--width must be >= 2 x --length (16)" in capsys.readouterr().err


def test_recent_rows_recall_the_most_recent_span_after_their_key():
    """Each recall is its key and the span after the key's most recent earlier occurrence, which ends within
    max_gap ids; the key's earlier (decoy) occurrences are followed by another first id; the key occurs nowhere
    else in its row."""
    rng = np.random.default_rng(3)
    length, max_gap, width, decoys, vocab = 4, 12, 64, 2, 40
    tokens, mask, second = recent_copy_batch(rng, 300, width, length, max_gap, vocab, decoys)
    assert tokens.shape == (300, width) and mask.all() and tokens.min() >= 0 and tokens.max() < vocab
    recalls = 0
    for row in range(300):
        recall_keys = set()
        for start in range(0, width, length):
            flagged = second[row, start:start + length]
            assert not flagged[0] and (flagged[1:].all() or not flagged.any())
            if not flagged.any():
                continue
            recalls += 1
            key = tokens[row, start]
            recall_keys.add(int(key))
            earlier = np.flatnonzero(tokens[row, :start] == key)
            assert len(earlier) == decoys + 1, (row, start)
            latest = earlier[-1]
            assert latest % length == 0 and start - (latest + length) <= max_gap
            assert np.array_equal(tokens[row, latest:latest + length], tokens[row, start:start + length])
            assert all(tokens[row, at + 1] != tokens[row, start + 1] for at in earlier[:-1])
        for key in recall_keys:   # the key: its decoys, its source and its recall, nothing else
            assert (tokens[row] == key).sum() == decoys + 2
    assert recalls > 300   # more than one recall per row on average
    with pytest.raises(ValueError, match="length >= 2"):
        recent_copy_batch(rng, 1, width, 1, max_gap, vocab, decoys)
    with pytest.raises(ValueError, match="too small"):
        recent_copy_batch(rng, 1, width, length, max_gap, 4, decoys)


def test_short_recent_run_records_the_held_out_recall_at_chance(tmp_path, capsys):
    out = tmp_path / "recent.json"
    assert main(["--rows", "recent", "--width", "64", "--length", "4", "--filler", "12", "--decoys", "2", "--steps",
                 "2", "--evaluations", "1", "--vocab", "50", "--no-progress", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    record = result["records"][0]
    assert result["settings"]["rows"] == "recent" and result["settings"]["decoys"] == 2
    assert abs(record["held_out_recent_nll"] - math.log(50)) < 0.5   # two steps: the recall is still at chance
    assert "held-out recall NLL / acc" in out.with_suffix(".md").read_text()
    for flags, message in ((["--decoys", "-1"], "--decoys must be >= 0"),
                           (["--length", "1"], "--length >= 2"),
                           (["--width", "16", "--length", "4"], "--width must hold --decoys + 3 segments (20 ids)")):
        assert main(["--rows", "recent", *flags, "--out", str(tmp_path / "x.json")]) == 2
        assert message in capsys.readouterr().err
