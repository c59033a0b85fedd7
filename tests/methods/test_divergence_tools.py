"""The held-out measurements of the training chain: ``response_nll`` is the answers' negative log-likelihood computed
densely by hand from the model's logits; ``experiments.probes.cut_layers`` parses its layer sets and refuses bad
ones; ``experiments.divergence`` refuses bad input in one line and, on micro models over a small ALFWorld tree,
measures a model equal to its teacher at zero KL and a different one above it."""
from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from flax import nnx

from jaxopd.methods.divergence import exact_reverse_kl, response_nll
from jaxopd.models.decoder import CausalLM
from jaxopd.sample import Sample
from micro_models import MICRO, micro_config


def samples_of(rng, vocab, lengths=(9, 14, 6)):
    out = []
    for length in lengths:
        tokens = rng.integers(0, vocab, length).astype(np.int32)
        mask = np.zeros(length, bool)
        mask[length // 2:] = True
        out.append(Sample(tokens, mask, np.zeros(length, np.float32), 0))
    return out


def test_response_nll_is_the_dense_negative_log_likelihood_of_the_answers():
    model = CausalLM(micro_config(MICRO, 97), rngs=nnx.Rngs(3))
    samples = samples_of(np.random.default_rng(0), 97)
    total, count = 0.0, 0
    for s in samples:
        logp = np.asarray(jax.nn.log_softmax(model(s.tokens[None])[0], axis=-1), np.float64)
        for position in np.flatnonzero(s.loss_mask):
            total -= logp[position - 1, s.tokens[position]]
            count += 1
    pair = nnx.split(model, nnx.Param)
    np.testing.assert_allclose(response_nll(pair, samples, batch_size=2), total / count, rtol=1e-5)
    assert exact_reverse_kl(pair, pair, samples) == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(ValueError, match="at least one sample"):
        response_nll(pair, [])


def test_cut_layer_specs():
    from experiments.probes.cut_layers import parse_keep
    from jaxopd.cli import UsageError

    assert parse_keep("0-13,29") == (*range(14), 29)
    assert parse_keep("0-28:2") == tuple(range(0, 29, 2))
    assert parse_keep("5") == (5,)
    for bad in ("3-1", "0,0", "a-b", "1,0"):
        with pytest.raises(UsageError, match="--keep"):
            parse_keep(bad)


def test_divergence_refuses_bad_input(capsys, micro_checkpoints, tmp_path):
    from experiments import divergence

    student, teacher = micro_checkpoints
    cases = [(["--model", f"{student}"], "expected LABEL=DIR"),
             (["--model", f"a={tmp_path / 'none'}"], "no such folder"),
             (["--model", f"a={student}", "--model", f"a={student}"], "given twice"),
             (["--model", f"a={student}", "--tasks", "0"], "--tasks must be at least 1")]
    for extra, message in cases:
        assert divergence.main(["--teacher", str(teacher), *extra, "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1


@pytest.mark.slow
def test_divergence_of_the_teacher_itself_is_zero(micro_checkpoints, tmp_path, monkeypatch):
    pytest.importorskip("alfworld")
    from experiments import divergence
    from jaxopd_envs import alfworld_gen

    root = alfworld_gen.ensure_games(tmp_path / "games", seed=0, counts={"train": 0, "valid_seen": 0,
                                                                        "valid_unseen": 1}, workers=1, progress=False)
    monkeypatch.setenv("ALFWORLD_DATA", str(root))
    monkeypatch.setenv("JAXOPD_CACHE", str(tmp_path / "cache"))
    student, teacher = micro_checkpoints
    out = tmp_path / "out"
    assert divergence.main(["--teacher", str(teacher), "--model", f"self={teacher}", "--model", f"other={student}",
                            "--modes", "full", "next_action", "--no-progress", "--out", str(out)]) == 0
    result = json.loads((out / "divergence.json").read_text())
    assert result["states"]["full"] == result["states"]["next_action"] > 0
    for mode in ("full", "next_action"):
        assert result["models"]["self"]["reverse_kl"][mode] == pytest.approx(0.0, abs=1e-5)
        assert result["models"]["other"]["reverse_kl"][mode] > 1e-3
        assert result["models"]["self"]["nll"][mode] == pytest.approx(result["teacher"]["nll"][mode], rel=1e-5)
    assert "| other |" in (out / "divergence.md").read_text()
