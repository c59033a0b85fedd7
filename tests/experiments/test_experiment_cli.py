"""The main job's command line rejects bad input with one line and exit code 2, before any model is built
(issue 15, items 20-22)."""
from __future__ import annotations

import pytest

from jaxopd_experiments import actfirst_alfworld as job


@pytest.fixture(autouse=True)
def no_model(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was built before the input was checked")
    monkeypatch.setattr(job, "build_model", refuse)
    monkeypatch.setattr(job, "collect_initial_contexts", refuse)


def run(argv, capsys):
    code = job.main(["--preset", "cpu", "--no-progress", *argv])
    err = capsys.readouterr().err
    return code, err


def test_unwritable_out_is_found_before_the_run(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    code, err = run(["--out", str(blocker / "results")], capsys)
    assert code == 2
    assert err.startswith("error: --out") and "not writable" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_writable_out_is_created_by_preflight(tmp_path):
    out = tmp_path / "deep" / "results"
    args = job.build_parser().parse_args(["--preset", "cpu", "--out", str(out)])
    options = job.options_from_args(args)
    job.preflight(options)
    assert out.is_dir()


@pytest.mark.parametrize("argv, needle", [
    (["--model", "nope"], "--model 'nope' is not a model preset"),
    (["--weights", "/nonexistent"], "--weights '/nonexistent': no such folder"),
    (["--contexts-file", "/nonexistent/contexts.json"], "cannot read the context snapshot"),
    (["--contexts-source", "snapshot", "--contexts", "2000"], "2000 were asked for"),
])
def test_bad_values_give_one_line_and_exit_code_2(argv, needle, tmp_path, capsys):
    code, err = run([*argv, "--out", str(tmp_path / "out")], capsys)
    assert code == 2
    assert needle in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_weights_folder_without_config(tmp_path, capsys):
    code, err = run(["--weights", str(tmp_path), "--out", str(tmp_path / "out")], capsys)
    assert code == 2 and "no config.json" in err


def test_malformed_contexts_file(tmp_path, capsys):
    bad = tmp_path / "contexts.json"
    bad.write_text("{not json")
    code, err = run(["--contexts-file", str(bad), "--out", str(tmp_path / "out")], capsys)
    assert code == 2 and "cannot read the context snapshot" in err


@pytest.mark.parametrize("count", ["0", "-5"])
def test_snapshot_writer_checks_the_count(count, tmp_path, capsys):
    code = job.main(["--write-contexts-snapshot", str(tmp_path / "snap.json"), "--contexts", count])
    err = capsys.readouterr().err
    assert code == 2
    assert f"--contexts must be a positive number of contexts to sample, got {count}" in err
    assert not (tmp_path / "snap.json").exists()
