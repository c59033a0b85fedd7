"""Bad values that used to pass the checks of the training commands (the issue "Training defects", items 8-10 and
12): each is refused by ``RunConfig`` (so the library refuses it too) or by the command's own checks, as one line
naming the field on stderr, exit code 2, and nothing written, not even the ``--out`` folder.

Before: ``--learning-rate inf`` trained and exported an all-NaN model with exit 0; ``--seed -1``, ``$ALFWORLD_DATA``
without games, ``--exact-top-k`` beyond the vocabulary, ``--sft-epochs inf`` and token limits under which nothing fits
failed late with a traceback; ``--loss action-opd`` / ``--loss sft`` on a distillation method trained nothing,
``--games`` with ScienceWorld, ``--train-tasks`` beyond the tasks there are and ``--phase-log`` with SFT did nothing;
and the main job's malformed ``--contexts-file`` ended in a ``KeyError``.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from jaxopd.methods.config import DistillConfig, SFTConfig, build_config, config_class


def run_train(capsys, tmp_path, *argv):
    """``experiments.train.main`` on ``argv`` with ``--out tmp_path/run``: (exit code, stderr, whether the --out
    folder exists)."""
    from jaxopd_experiments import train

    out = tmp_path / "run"
    code = train.main([*argv, "--out", str(out), "--no-progress"])
    return code, capsys.readouterr().err, out.exists()


def assert_refused(result, *words):
    code, err, out_exists = result
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for word in words:
        assert word in lines[0], (word, lines[0])
    assert "Traceback" not in err and not out_exists


@pytest.fixture(autouse=True)
def no_official_games(monkeypatch):
    monkeypatch.delenv("ALFWORLD_DATA", raising=False)


# --------------------------------------------------------------------------------------------- 8: non-finite values
FLOAT_FIELDS = ["learning_rate", "weight_decay", "max_grad_norm", "clip_eps", "dual_clip", "temperature", "top_p",
                "match_bonus_scale", "teacher_temperature", "teacher_top_p", "eval_temperature", "sft_epochs",
                "lora_alpha"]


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("field", FLOAT_FIELDS)
def test_every_float_field_of_the_config_must_be_finite(field, value):
    method = "sft" if field.startswith("sft_") else "vanilla-opd"
    cls = config_class(method)
    assert cls.__dataclass_fields__[field].type == "float"
    with pytest.raises(ValueError, match=f"{cls.__name__}.{field} must be a finite number"):
        build_config(method, preset="cpu", **{field: value})


def test_every_float_field_is_checked():
    floats = sorted({f.name for cls in (DistillConfig, SFTConfig) for f in cls.__dataclass_fields__.values()
                     if f.type == "float"})
    assert floats == sorted(FLOAT_FIELDS)


@pytest.mark.parametrize("argv,field", [
    (["--method", "vanilla-opd", "--learning-rate", "inf", "--export", "EXPORT"], "learning_rate"),
    (["--method", "actfirst", "--temperature", "nan"], "temperature"),
    (["--method", "sti", "--eval-temperature", "inf"], "eval_temperature"),
    (["--method", "sft", "--sft-epochs", "inf"], "sft_epochs"),
])
def test_train_refuses_non_finite_values(capsys, tmp_path, argv, field):
    argv = [str(tmp_path / "export") if a == "EXPORT" else a for a in argv]
    assert_refused(run_train(capsys, tmp_path, *argv), field)
    assert not (tmp_path / "export").exists()


# --------------------------------------------------------------------------------------------- 9: late failures
def test_negative_or_oversized_seed_is_refused(capsys, tmp_path):
    assert_refused(run_train(capsys, tmp_path, "--method", "vanilla-opd", "--seed", "-1"), "seed")
    assert_refused(run_train(capsys, tmp_path, "--method", "sft", "--seed", str(2**32)), "seed")
    with pytest.raises(ValueError, match="DistillConfig.eval_seeds"):
        build_config("vanilla-opd", preset="cpu", eval_seeds=(42, -1))
    assert build_config("vanilla-opd", preset="cpu", seed=0).seed == 0


def test_lora_and_layer_cuts_are_checked(capsys, tmp_path):
    assert_refused(run_train(capsys, tmp_path, "--method", "sft", "--lora-rank", "-1"), "lora_rank")
    assert_refused(run_train(capsys, tmp_path, "--method", "sft", "--lora-rank", "4"), "lora_rank",
                   "pretrained --student")
    assert_refused(run_train(capsys, tmp_path, "--method", "sft", "--student-layers", "0", "2"), "student_layers",
                   "without a student")
    with pytest.raises(ValueError, match="student_layers must be increasing"):
        build_config("sft", preset="cpu", student="x", student_layers=(2, 1))
    with pytest.raises(ValueError, match="lora_alpha must be > 0"):
        build_config("vanilla-opd", preset="cpu", student="x", lora_rank=8, lora_alpha=0.0)
    config = build_config("vanilla-opd", preset="cpu", student="x", lora_rank=8, lora_alpha=16.0, student_layers=[0, 3])
    assert (config.lora_config().rank, config.lora_config().scale, config.student_layers) == (8, 2.0, (0, 3))
    assert build_config("sft", preset="cpu").lora_config() is None
    with pytest.raises(ValueError, match="lora_layers places LoRA adapters; set lora_rank"):
        build_config("sft", preset="cpu", student="x", lora_layers=[1])
    with pytest.raises(ValueError, match="lora_layers must be increasing"):
        build_config("sft", preset="cpu", student="x", lora_rank=4, lora_layers=[3, 1])
    upper = build_config("sft", preset="cpu", student="x", lora_rank=4, lora_layers=[2, 3]).lora_config()
    assert (upper.layers, config.lora_config().layers) == ((2, 3), None)


def test_unknown_model_preset_without_a_folder_is_refused(capsys, tmp_path):
    assert_refused(run_train(capsys, tmp_path, "--method", "vanilla-opd", "--student-model-preset", "laptop"),
                   "student_model_preset", "laptop")
    assert_refused(run_train(capsys, tmp_path, "--method", "sti", "--teacher-model-preset", "huge"),
                   "teacher_model_preset", "huge")
    with pytest.raises(ValueError, match="student_model_preset"):
        DistillConfig(method="actfirst", student_model_preset="qwen9")
    # with a folder the preset is not used; SFT has no teacher
    assert "teacher_model_preset" not in SFTConfig.__dataclass_fields__
    with pytest.raises(ValueError, match="teacher_model_preset 'tiny': teacher_model_preset is a distillation"):
        build_config("sft", teacher_model_preset="tiny")


def fake_official_tree(root: Path, games: dict[str, int]) -> Path:
    """An ALFWorld tree in the official layout (``json_2.1.1/<split>/<task>/<trial>/``) with ``games[split]``
    solvable games per split, as ``jaxopd_envs.alfworld.discover_games`` reads them."""
    for split, count in games.items():
        for i in range(count):
            folder = root / "json_2.1.1" / split / f"pick_and_place_simple-Apple-None-Fridge-{i}" / "trial_0"
            folder.mkdir(parents=True)
            (folder / "traj_data.json").write_text(json.dumps({"task_type": "pick_and_place_simple"}))
            (folder / "game.tw-pddl").write_text(json.dumps({"solvable": True}))
    return root


def test_alfworld_data_without_games_is_refused_before_anything_is_written(capsys, tmp_path, monkeypatch):
    empty = tmp_path / "alfworld"
    (empty / "train" / "nothing-here").mkdir(parents=True)      # a split folder, but no game in it
    monkeypatch.setenv("ALFWORLD_DATA", str(empty))
    assert_refused(run_train(capsys, tmp_path, "--method", "vanilla-opd"), "ALFWORLD_DATA", "no solvable", "train")
    # the training games are there, the evaluation split is not: refused unless the run does not evaluate
    games = fake_official_tree(tmp_path / "official", {"train": 2})
    monkeypatch.setenv("ALFWORLD_DATA", str(games))
    assert_refused(run_train(capsys, tmp_path, "--method", "vanilla-opd"), "ALFWORLD_DATA", "valid_unseen")
    from jaxopd.methods.config import check_task_source
    check_task_source(build_config("vanilla-opd", preset="cpu"), evaluate=False)


def test_evaluate_refuses_a_split_without_games(capsys, tmp_path, monkeypatch):
    from jaxopd_experiments import evaluate

    games = fake_official_tree(tmp_path / "official", {"train": 1})
    (games / "json_2.1.1" / "valid_unseen" / "empty").mkdir(parents=True)
    monkeypatch.setenv("ALFWORLD_DATA", str(games))
    out = tmp_path / "eval"
    code = evaluate.main(["--model-preset", "tiny", "--num-tasks", "1", "--seeds", "42", "--no-progress",
                          "--out", str(out)])
    assert_refused((code, capsys.readouterr().err, out.exists()), "valid_unseen")


def test_exact_top_k_beyond_the_student_vocabulary_is_refused(capsys, tmp_path):
    flags = ["--method", "vanilla-opd", "--loss", "opd-exact", "--max-supervised-tokens", "80"]
    assert_refused(run_train(capsys, tmp_path, *flags, "--exact-top-k", "151936"), "exact_top_k", "151,936")
    student = tmp_path / "student"                 # a folder's vocabulary comes from its config.json
    student.mkdir()
    (student / "config.json").write_text(json.dumps({"model_type": "qwen3", "vocab_size": 512}))
    assert_refused(run_train(capsys, tmp_path, *flags, "--student", str(student), "--exact-top-k", "600"),
                   "exact_top_k", "512")
    assert build_config("vanilla-opd", preset="cpu", loss="opd-exact", exact_top_k=64).exact_top_k == 64


@pytest.mark.parametrize("argv,words", [
    (["--method", "vanilla-opd", "--max-train-tokens", "1000"], ["max_train_tokens", "1024 + 64"]),
    (["--method", "actionopd", "--max-prompt-tokens", "2000"], ["max_train_tokens", "max_prompt_tokens"]),
    (["--method", "sft", "--max-train-tokens", "1024"], ["max_train_tokens", "max_prompt_tokens"]),
    (["--method", "vanilla-opd", "--max-prompt-tokens", "40", "--max-train-tokens", "200"],
     ["max_prompt_tokens (40)", "system prompt"]),
    (["--method", "actfirst", "--eval-max-prompt-tokens", "64"], ["eval_max_prompt_tokens (64)", "system prompt"]),
    (["--method", "vanilla-opd", "--total-tokens", "96", "--max-train-tokens", "2048"],
     ["max_supervised_tokens (80)", "total_tokens (96)"]),
])
def test_token_limits_under_which_nothing_fits_are_refused(capsys, tmp_path, argv, words):
    assert_refused(run_train(capsys, tmp_path, *argv), *words)


# ------------------------------------------------------------------------------------- 10: flags that do nothing
@pytest.mark.parametrize("argv,words", [
    (["--method", "vanilla-opd", "--loss", "action-opd"], ["loss 'action-opd'", "0"]),
    (["--method", "sti", "--loss", "action-opd"], ["loss 'action-opd'"]),
    (["--method", "actfirst", "--loss", "sft"], ["loss 'sft'", "--method sft"]),
    (["--method", "sft", "--loss", "opd"], ["loss 'opd'"]),
    (["--method", "actionopd", "--loss", "opd"], ["loss 'opd'", "action-opd"]),
    (["--method", "actionopd", "--advantage-logp", "sampled"], ["advantage_logp"]),
    (["--method", "sti", "--benchmark", "scienceworld", "--games", "generated"], ["games 'generated'"]),
    (["--method", "vanilla-opd", "--train-tasks", "241"], ["train_tasks 241", "240 generated"]),
    (["--method", "vanilla-opd", "--games", "generated", "--generated-train-games", "8", "--train-tasks", "9"],
     ["train_tasks 9", "8 generated"]),
    (["--method", "sti", "--benchmark", "scienceworld", "--train-tasks", "100000"], ["train_tasks 100000"]),
    (["--method", "sft", "--phase-log", "PHASES"], ["--phase-log", "sft"]),
    (["--method", "vanilla-opd", "--steps", "5"], ["--steps", "--updates"]),
    (["--method", "vanilla-opd", "--no-eval", "--first-eval-from", "PHASES"], ["--first-eval-from", "--no-eval"]),
    (["--method", "sft", "--first-eval-from", "PHASES"], ["--first-eval-from", "--method sft"]),
])
def test_flags_that_would_train_nothing_or_do_nothing_are_refused(capsys, tmp_path, argv, words):
    argv = [str(tmp_path / "phases") if a == "PHASES" else a for a in argv]
    assert_refused(run_train(capsys, tmp_path, *argv), *words)
    assert not (tmp_path / "phases").exists()


def test_train_tasks_beyond_the_official_games_is_refused(capsys, tmp_path, monkeypatch):
    games = fake_official_tree(tmp_path / "official", {"train": 3, "valid_unseen": 1})
    monkeypatch.setenv("ALFWORLD_DATA", str(games))
    assert_refused(run_train(capsys, tmp_path, "--method", "vanilla-opd", "--train-tasks", "4"),
                   "train_tasks 4", "3 training tasks")


def test_the_refusals_are_the_librarys_too():
    for overrides in ({"loss": "action-opd"}, {"loss": "sft"}, {"train_tasks": 241, "games": "generated"},
                      {"max_train_tokens": 100}, {"seed": -3}, {"learning_rate": math.inf}):
        with pytest.raises(ValueError, match="DistillConfig"):
            build_config("vanilla-opd", preset="cpu", **overrides)
    with pytest.raises(ValueError, match="games"):
        DistillConfig(method="sti", benchmark="scienceworld", games="official")


# --------------------------------------------------------------------------------------------- 12: other commands
@pytest.mark.parametrize("payload", [{"format": 1}, {"format": 1, "contexts": [{"task_id": "a"}], "order": ["a"],
                                                     "source": {}},
                                     {"format": 1, "contexts": [], "order": ["missing"], "source": {}}, [1, 2]])
def test_main_job_refuses_a_malformed_contexts_file(capsys, tmp_path, payload):
    from jaxopd_experiments import actfirst_alfworld

    contexts = tmp_path / "contexts.json"
    contexts.write_text(json.dumps(payload))
    out = tmp_path / "job"
    code = actfirst_alfworld.main(["--preset", "cpu", "--contexts-file", str(contexts), "--out", str(out)])
    assert_refused((code, capsys.readouterr().err, out.exists()), str(contexts))
