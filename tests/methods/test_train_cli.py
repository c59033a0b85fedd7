"""``python -m experiments.train`` refuses bad input with one line naming the problem and exit code 2, before any
training starts: a missing checkpoint folder, a wrong preset, an unwritable --out, $ALFWORLD_DATA pointing at
nothing, a teacher whose vocabulary differs from the student's."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # heavier than the README's test run allows (run in CI: pytest -m slow)

ROOT = Path(__file__).resolve().parents[2]


def run_cli(*args, env=None):
    environment = {k: v for k, v in os.environ.items() if k != "ALFWORLD_DATA"}
    environment.update(env or {})
    return subprocess.run([sys.executable, "-m", "experiments.train", *args], cwd=ROOT, env=environment,
                          capture_output=True, text=True, timeout=300)


def assert_one_line(result, *fragments):
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.fixture
def official_data(tmp_path):
    """$ALFWORLD_DATA naming an official-layout tree with one solvable game in the train and valid_unseen splits (as
    ``jaxopd_envs.alfworld.discover_games`` reads them: the run's task-source check passes, no game is generated)."""
    import json

    for split in ("train", "valid_unseen"):
        game = tmp_path / "alfworld" / split / "pick_and_place_simple-Apple-None-Fridge-1" / "trial_0"
        game.mkdir(parents=True)
        (game / "traj_data.json").write_text(json.dumps({"task_type": "pick_and_place_simple"}))
        (game / "game.tw-pddl").write_text(json.dumps({"solvable": True}))
    return {"ALFWORLD_DATA": str(tmp_path / "alfworld")}


def test_missing_checkpoint_folder(tmp_path):
    result = run_cli("--method", "actfirst", "--student", str(tmp_path / "nope"), "--out", str(tmp_path / "o"))
    assert_one_line(result, "--student", "no such folder")


def test_wrong_preset(tmp_path):
    assert_one_line(run_cli("--method", "actfirst", "--preset", "laptop", "--out", str(tmp_path)), "laptop")


def test_unwritable_out(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert_one_line(run_cli("--method", "vanilla-opd", "--out", str(blocker / "run")), "--out", "not writable")
    assert_one_line(run_cli("--method", "sft", "--out", str(tmp_path / "run"), "--export", str(blocker / "hf")),
                    "--export", "not writable")


def test_alfworld_data_pointing_at_nothing(tmp_path):
    result = run_cli("--method", "vanilla-opd", "--out", str(tmp_path / "o"),
                     env={"ALFWORLD_DATA": str(tmp_path / "missing")})
    assert_one_line(result, "ALFWORLD_DATA", "not a folder")


def test_teacher_vocabulary_differs(tmp_path, official_data, mismatched_checkpoints):
    student, teacher = mismatched_checkpoints           # 300 and 400 ids
    result = run_cli("--method", "vanilla-opd", "--student", str(student), "--teacher", str(teacher),
                     "--out", str(tmp_path / "o"), env=official_data)
    assert_one_line(result, "vocabulary", "400", "300")


def test_invalid_number(tmp_path):
    assert_one_line(run_cli("--method", "sti", "--updates", "0", "--out", str(tmp_path)), "updates")


def test_sft_demonstrations(tmp_path):
    assert_one_line(run_cli("--method", "sft", "--sft-demonstrations", "oracle", "--out", str(tmp_path)),
                    "--sft-demonstrations", "oracle")
    assert_one_line(run_cli("--method", "sft", "--benchmark", "scienceworld", "--sft-demonstrations",
                            "searching-expert", "--out", str(tmp_path)), "searching expert plays ALFWorld only")


def test_sft_fast_copies_must_not_be_negative(tmp_path):
    assert_one_line(run_cli("--method", "sft", "--sft-fast-copies", "-1", "--out", str(tmp_path)),
                    "sft_fast_copies")


def test_a_flag_of_the_other_kind_of_run_is_refused(tmp_path):
    assert_one_line(run_cli("--method", "sft", "--clip-eps", "0.3", "--out", str(tmp_path)),
                    "clip_eps", "distillation setting", "--method sft")
    assert_one_line(run_cli("--method", "actfirst", "--sft-epochs", "2", "--out", str(tmp_path)),
                    "sft_epochs", "SFT setting", "--method actfirst")


def test_sft_thinking_values(tmp_path):
    assert_one_line(run_cli("--method", "sft", "--sft-thinking", "chain", "--out", str(tmp_path)),
                    "--sft-thinking", "chain")
    assert_one_line(run_cli("--method", "sft", "--benchmark", "scienceworld", "--sft-thinking", "plan",
                            "--out", str(tmp_path)), "plan thinking reads ALFWorld prompts")


def test_keep_checkpoints_must_be_positive(tmp_path):
    assert_one_line(run_cli("--method", "sft", "--keep-checkpoints", "0", "--out", str(tmp_path)), "keep_checkpoints")


def test_generated_train_games(tmp_path):
    assert_one_line(run_cli("--method", "sft", "--generated-train-games", "0", "--out", str(tmp_path)),
                    "generated_train_games")
    assert_one_line(run_cli("--method", "sft", "--benchmark", "scienceworld", "--generated-train-games", "480",
                            "--out", str(tmp_path)), "generated_train_games=480 sizes generated ALFWorld games")
    from jaxopd_experiments.train import training_counts
    from jaxopd.methods.benchmarks import GeneratedCounts
    from jaxopd.methods.config import build_config
    counts = training_counts(build_config("sft", preset="cpu", generated_train_games=480))
    assert counts == GeneratedCounts(train=480)
    assert (counts.valid_seen, counts.valid_unseen, counts.seed) == (GeneratedCounts().valid_seen,
                                                                     GeneratedCounts().valid_unseen, 0)


def test_generated_train_games_with_official_data(tmp_path, official_data):
    assert_one_line(run_cli("--method", "sft", "--generated-train-games", "480", "--out", str(tmp_path / "o"),
                            env=official_data), "--generated-train-games 480 sizes generated games")
