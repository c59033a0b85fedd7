"""``experiments.train --config FILE``: a TOML, YAML or JSON file of config fields (a run's own config.json is
one), overridden by the flags given; bad files are one line naming the problem, exit 2, nothing written."""
from __future__ import annotations

import dataclasses
import json

import pytest

from jaxopd.methods.config import RunConfig, build_config, read_config_file


@pytest.fixture(autouse=True)
def no_official_games(monkeypatch):
    monkeypatch.delenv("ALFWORLD_DATA", raising=False)


def config_of(*argv):
    from jaxopd_experiments.train import build_parser, config_from_args
    return config_from_args(build_parser().parse_args([*argv, "--out", "unused"]))


def test_toml_file_sets_fields_and_flags_override_them(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('method = "sti"\npreset = "cpu"\nlearning_rate = 3e-5\nupdates = 7\neval_seeds = [1, 2]\n')
    config = config_of("--config", str(path))
    assert (config.method, config.preset, config.learning_rate, config.updates) == ("sti", "cpu", 3e-5, 7)
    assert config.eval_seeds == (1, 2)
    assert config.batch_size == build_config("sti", preset="cpu").batch_size       # the rest: method and preset
    overridden = config_of("--config", str(path), "--learning-rate", "1e-4", "--method", "vanilla-opd")
    assert (overridden.method, overridden.learning_rate, overridden.updates) == ("vanilla-opd", 1e-4, 7)


def test_a_saved_config_json_reproduces_the_run(tmp_path):
    saved = build_config("actfirst", preset="cpu", learning_rate=2e-5, updates=3, eval_tasks=2)
    path = tmp_path / "config.json"
    path.write_text(saved.to_json())                      # what a run writes, departures included
    assert config_of("--config", str(path)) == saved


def test_yaml_file(tmp_path):
    pytest.importorskip("yaml")
    path = tmp_path / "run.yaml"
    path.write_text("method: vanilla-opd\nupdates: 4\nclip_eps: 0.3\n")
    config = config_of("--config", str(path))
    assert (config.method, config.preset, config.updates, config.clip_eps) == ("vanilla-opd", "cpu", 4, 0.3)


@pytest.mark.parametrize("name, text, needle", [
    ("run.toml", 'method = "sti"\nlearning_rte = 1e-5\n', "unknown config fields ['learning_rte']"),
    ("run.toml", 'method = "sti"\nlearning_rate = \n', "is not valid TOML"),
    ("run.json", '[1, 2]', "must hold a mapping of config fields"),
    ("run.ini", 'method = sti', "expected a .toml / .yaml / .yml / .json file"),
    ("run.toml", 'updates = 3\n', "--method is required"),
    ("run.toml", 'method = "grpo"\n', "unknown method 'grpo'"),
    ("run.toml", 'method = "sti"\nlearning_rate = "fast"\n', "DistillConfig.learning_rate must be a finite number"),
])
def test_bad_config_files_are_one_line_and_exit_2(tmp_path, capsys, name, text, needle):
    from jaxopd_experiments import train

    path = tmp_path / name
    path.write_text(text)
    out = tmp_path / "run"
    code = train.main(["--config", str(path), "--out", str(out), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], err
    assert not out.exists()


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ValueError, match="cannot be read"):
        read_config_file(tmp_path / "absent.toml")


def test_read_config_file_ignores_the_derived_departures(tmp_path):
    path = tmp_path / "c.json"
    data = build_config("sti", preset="cpu").to_dict()
    assert "departures" in data
    path.write_text(json.dumps(data))
    assert RunConfig.from_dict(read_config_file(path)) == build_config("sti", preset="cpu")


def test_every_config_field_has_one_flag_made_from_the_field():
    """The flags come from the config dataclasses: one per field of the distillation and the SFT config, its help
    the field's own (the one owner of the text)."""
    from jaxopd_experiments.train import build_parser, config_fields
    from jaxopd.methods.config import DistillConfig, SFTConfig

    actions = {a.dest: a for a in build_parser()._actions}
    fields = config_fields()
    assert set(fields) == {f.name for cls in (DistillConfig, SFTConfig) for f in dataclasses.fields(cls)}
    for name, field in fields.items():
        assert name in actions, name
        if name not in ("method", "preset"):
            assert actions[name].help.startswith(field.metadata["help"].replace("%", "%%")), name
            assert actions[name].default is None


def test_generated_flags_parse_to_the_fields_types():
    config = config_of("--method", "actfirst", "--eval-seeds", "7", "8", "--prefix-sharing", "off",
                       "--eval-greedy", "on", "--top-p", "0.9", "--rollout-backlog", "0")
    assert (config.eval_seeds, config.prefix_sharing, config.eval_greedy, config.top_p, config.rollout_backlog) == (
        (7, 8), False, True, 0.9, 0)
    sft = config_of("--method", "sft", "--sft-group-by-length", "32", "--sft-thinking", "plan", "--steps", "5")
    assert (type(sft).__name__, sft.sft_group_by_length, sft.sft_thinking, sft.updates) == ("SFTConfig", 32, "plan", 5)


def test_a_field_of_the_other_config_is_refused_by_the_library_too():
    with pytest.raises(ValueError, match="sft_group_by_length 4: sft_group_by_length is an SFT setting"):
        build_config("vanilla-opd", preset="cpu", sft_group_by_length=4)
    with pytest.raises(ValueError, match="clip_eps 0.1: clip_eps is a distillation setting; --method sft"):
        build_config("sft", preset="cpu", clip_eps=0.1)
    with pytest.raises(ValueError, match="sft_group_by_length must be a non-negative integer"):
        build_config("sft", preset="cpu", sft_group_by_length=-1)
