"""experiments.teacher_recipe: the chain's commands are results/train's, stages chain by their exports, done stages
are skipped, a cut-off checkpoint is not done, a failed stage stops the chain, bad flags are usage errors."""
import json
import shlex
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from experiments import teacher_recipe as recipe
from experiments.train import build_parser as train_parser
from jaxopd import machine
from jaxopd.models.decoder import ModelConfig

REPO = Path(__file__).resolve().parents[1]


def write_checkpoint(folder: Path) -> None:
    """A Qwen3 config and a (small, stand-in) safetensors file: what the completeness check reads."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(ModelConfig.preset("tiny").to_hf_dict()))
    save_file({"w": np.arange(6, dtype=np.float32)}, str(folder / "model.safetensors"))


COMMITTED_EVALUATIONS = {"evaluate-teacher": "eval48/eval-teacher", "evaluate-student": "eval48/eval-student",
                         "evaluate-teacher-one": "stop42/eval-teacher-one", "evaluate-sub1600": "stop48/eval-sub1600",
                         "evaluate-sub2800": "stop49/eval-sub2800"}
ALL_STAGES = tuple({stage.name: stage for stages in recipe.RECIPES.values() for stage in stages}.values())


def test_every_stage_is_a_command_of_results_train():
    """The recipe replays the documented commands verbatim (the evaluations: the commands their committed
    evaluation.json records, and the success rates they measured): a change to either shows here."""
    documented = (REPO / "results" / "train" / "README.md").read_text()
    for stage in ALL_STAGES:
        if stage.evaluation is None:
            assert stage.command("runs") in documented, stage.name
            continue
        committed = REPO / "results" / "train" / COMMITTED_EVALUATIONS[stage.name]
        meta = json.loads((committed / "evaluation.json").read_text())["meta"]
        assert stage.command("runs") == meta["command"]
        assert recipe.evaluation_success(committed) == pytest.approx(stage.documented_success)
    assert set(COMMITTED_EVALUATIONS) == {s.name for s in ALL_STAGES if s.evaluation}


@pytest.mark.parametrize("name", sorted(recipe.RECIPES))
def test_stages_chain_through_their_exports(name):
    """Each stage starts from a folder an earlier stage of its recipe exports; train stages parse with
    experiments.train."""
    made = set()
    for stage in recipe.RECIPES[name]:
        argv = stage.argv("runs")
        flags = {argv[i]: argv[i + 1] for i in range(len(argv) - 1) if argv[i].startswith("--")}
        start = flags.get("--student") or flags.get("--init")
        if stage.name == "copy-warmup-1":
            assert start is None
        else:
            assert start is not None and Path(start).name in made, (stage.name, start)
        if stage.evaluation is not None:
            assert stage.exports == () and flags["--out"] == f"runs/{stage.evaluation}"
            continue
        exports = [flags.get("--export")] + ([argv[argv.index("--export-at") + 2]] if "--export-at" in argv else [])
        assert sorted(Path(e).name for e in exports) == sorted(stage.exports)
        made.update(stage.exports)
        if stage.module == "experiments.train":
            args = train_parser().parse_args(argv)
            assert args.method == "sft" and args.out.startswith("runs/")
    if name == "chain":
        assert {"teacher-more-hf", "student-tool40-hf"} <= made
        assert [s.name for s in recipe.STAGES[-3:]] == ["teacher-more", "evaluate-teacher", "evaluate-student"]
    elif name == "one-sft-sub":
        assert made == {"copy1-hf", "copy2-hf", "sub800-hf", "sub1600-hf", "sub2400-hf", "sub2800-hf"}
        segments = [s for s in recipe.ONE_SFT_SUB[2:] if s.evaluation is None]
        assert all("--sub-vocabulary" in s.argv("runs") and "runs/sft-sub" in s.argv("runs") for s in segments)
        assert [int(s.argv("runs")[s.argv("runs").index("--steps") + 1]) for s in segments] == [800, 1600, 2400, 2800]
        assert recipe.ONE_SFT_SUB[:2] == recipe.STAGES[:2]
    else:
        assert made == {"copy1-hf", "copy2-hf", "teacher-one-hf", "student-one-hf"}
        assert recipe.ONE_SFT[-1].argv("runs")[1] == "runs/teacher-one-hf"
        assert recipe.ONE_SFT[:2] == recipe.STAGES[:2]                 # the same copy warm-up


def test_checkpoint_complete(tmp_path):
    folder = tmp_path / "ckpt"
    assert not recipe.checkpoint_complete(folder)
    write_checkpoint(folder)
    assert recipe.checkpoint_complete(folder)
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[:-4])            # writing cut off
    assert not recipe.checkpoint_complete(folder)
    (folder / "model.safetensors").write_bytes(data[:5])             # not even the header length
    assert not recipe.checkpoint_complete(folder)
    (folder / "model.safetensors").write_bytes(data)
    (folder / "config.json").unlink()
    assert not recipe.checkpoint_complete(folder)
    sharded = tmp_path / "sharded"
    write_checkpoint(sharded)
    (sharded / "model.safetensors").rename(sharded / "model-00001-of-00002.safetensors")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    assert not recipe.checkpoint_complete(sharded)                  # a shard missing
    save_file({"v": np.ones(3, np.float32)}, str(sharded / "model-00002-of-00002.safetensors"))
    assert recipe.checkpoint_complete(sharded)


class FakeRunner:
    """Plays each stage: writes its exports (or fails at ``fail_at``), remembering the commands it ran."""

    def __init__(self, runs: Path, fail_at: str | None = None):
        self.runs, self.fail_at, self.ran = runs, fail_at, []

    def __call__(self, argv, log: Path) -> int:
        stage = next(s for s in ALL_STAGES if argv[3:] == s.argv(str(self.runs)))
        assert argv[1:3] == ["-m", stage.module]
        self.ran.append(stage.name)
        if stage.name == self.fail_at:
            return 3
        for folder in stage.exports:
            write_checkpoint(self.runs / folder)
        if stage.evaluation is not None:
            write_evaluation(self.runs / stage.evaluation, 0.25)
        return 0


def write_evaluation(folder: Path, success: float) -> None:
    from jaxopd.methods.evaluate import OUTPUT_FILES
    folder.mkdir(parents=True, exist_ok=True)
    for name in OUTPUT_FILES[1:]:
        (folder / name).write_text("x")
    summary = {"overall": {"success_rate": {"mean": success, "std": 0.0, "n": 3}}}
    (folder / OUTPUT_FILES[0]).write_text(json.dumps({"meta": {}, "summaries": [summary], "episodes": []}))


def test_evaluation_success(tmp_path):
    folder = tmp_path / "eval"
    assert recipe.evaluation_success(folder) is None
    write_evaluation(folder, 0.375)
    assert recipe.evaluation_success(folder) == 0.375
    (folder / "success_by_task_type.png").unlink()                 # the last file written
    assert recipe.evaluation_success(folder) is None
    write_evaluation(folder, 0.375)
    (folder / "evaluation.json").write_text("{\"summaries\": [")
    assert recipe.evaluation_success(folder) is None


def test_run_recipe_skips_done_stages_stops_at_failure_and_records(tmp_path, monkeypatch):
    monkeypatch.setattr(machine, "cpu_features", lambda: ["avx", "avx2", "fma"])   # this machine, wherever it runs
    runs = tmp_path / "runs"
    write_checkpoint(runs / "copy1-hf")                       # made by hand with the same command
    runner = FakeRunner(runs, fail_at="teacher-act")
    lines = []
    assert recipe.run_recipe(str(runs), runner=runner, log=lines.append) == 3
    assert runner.ran == ["copy-warmup-2", "teacher-list", "teacher-act"]
    assert any("[copy-warmup-1] done" in line for line in lines)
    assert any("[teacher-act] failed with exit status 3" in line for line in lines)
    record = json.loads((runs / recipe.RECORD).read_text())
    assert [e["exit_status"] for e in record["stages"]["teacher-act"]] == [3]
    assert record["stages"]["teacher-list"][0]["command"] == recipe.STAGES[2].command(str(runs))
    assert "copy-warmup-1" not in record["stages"]
    assert isinstance(record["machine"]["cpu"], str) and record["machine"]["cpu_count"] >= 1
    assert record["stages"]["teacher-list"][0]["cpu"] == record["machine"]["cpu"]
    assert record["stages"]["teacher-list"][0]["machine"]["packages"]["jax"] == record["machine"]["jax"]
    assert not any(line.startswith("note:") for line in lines)
    # a stage done on a CPU with other vector features: the rerun says the chain will not repeat its numbers
    entry = record["stages"]["teacher-list"][0]
    assert entry["machine"]["cpu_features"] == ["avx", "avx2", "fma"]
    entry["machine"] = {**entry["machine"], "cpu_features": ["avx", "avx2", "avx512f", "fma"]}
    (runs / recipe.RECORD).write_text(json.dumps(record))
    # rerun: continues at the failed stage, up to --until
    runner = FakeRunner(runs)
    assert recipe.run_recipe(str(runs), until="student-tool40", runner=runner, log=lines.append) == 0
    assert runner.ran == ["teacher-act", "student-tool40"]
    assert any(line.startswith("note: teacher-list ran on another CPU") for line in lines)
    record = json.loads((runs / recipe.RECORD).read_text())
    assert [e["exit_status"] for e in record["stages"]["teacher-act"]] == [3, 0]
    runner = FakeRunner(runs)
    assert recipe.run_recipe(str(runs), runner=runner, log=lines.append) == 0
    assert runner.ran == ["teacher-tool", "teacher-missing", "teacher-more", "evaluate-teacher", "evaluate-student"]
    assert all(recipe.stage_done(stage, runs) for stage in recipe.STAGES)
    assert "success 25.0 % (results/train, stop 35: 19.4 %" in lines[-1]
    lines.clear()
    assert recipe.run_recipe(str(runs), runner=FakeRunner(runs, fail_at="copy-warmup-1"), log=lines.append) == 0
    assert len(lines) == len(recipe.STAGES) and "[evaluate-teacher] done" in lines[-2] and "40.3 %" in lines[-2]


def test_one_sft_recipe_shares_the_warm_up_and_refuses_other_stages(tmp_path, capsys):
    """The one-sft recipe skips a warm-up the chain made, runs its own SFT and evaluation, never a chain stage;
    --until names a stage of the chosen recipe."""
    runs = tmp_path / "runs"
    write_checkpoint(runs / "copy1-hf")
    write_checkpoint(runs / "copy2-hf")
    runner = FakeRunner(runs)
    lines = []
    assert recipe.run_recipe(str(runs), recipe="one-sft", runner=runner, log=lines.append) == 0
    assert runner.ran == ["teacher-one", "evaluate-teacher-one"]
    assert all(recipe.stage_done(stage, runs) for stage in recipe.ONE_SFT)
    assert not recipe.stage_done(recipe.STAGES[2], runs)
    assert "[evaluate-teacher-one] finished" in lines[-1] and "success 25.0 % (results/train, stop 42:" in lines[-1]
    with pytest.raises(ValueError, match="stage 'teacher-more' is not in the one-sft recipe"):
        recipe.run_recipe(str(runs), recipe="one-sft", until="teacher-more", runner=runner)
    with pytest.raises(ValueError, match="unknown recipe 'nope'"):
        recipe.run_recipe(str(runs), recipe="nope", runner=runner)
    assert recipe.main(["--runs", str(runs), "--recipe", "one-sft", "--until", "teacher-more"]) == 2
    assert "--until 'teacher-more' is not a stage of --recipe one-sft" in capsys.readouterr().err
    assert recipe.main(["--runs", str(runs), "--recipe", "one-sft", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.count("(done;") == 4 and "# left: about 0.0 h" in out
    assert recipe.ONE_SFT[2].command(str(runs)) in out and recipe.STAGES[2].command(str(runs)) not in out


def test_a_stage_that_exits_0_without_its_export_fails(tmp_path):
    runs = tmp_path / "runs"
    lines = []
    assert recipe.run_recipe(str(runs), until="copy-warmup-1", runner=lambda argv, log: 0, log=lines.append) == 1
    assert "did not write copy1-hf" in lines[-1]


def test_real_runner_appends_the_childs_output_to_the_log(tmp_path):
    log = tmp_path / "logs" / "stage.log"
    argv = ["python3", "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(4)"]
    assert recipe.run_in_process(argv, log) == 4
    assert recipe.run_in_process(["python3", "-c", "print('again')"], log) == 0
    text = log.read_text()
    assert text.count("# ") == 2 and "out\nerr\n" in text and "again" in text and shlex.join(argv) in text


def test_cli(tmp_path, capsys):
    runs = tmp_path / "runs"
    write_checkpoint(runs / "copy1-hf")
    assert recipe.main(["--runs", str(runs), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "# copy-warmup-1 (done;" in out and "# copy-warmup-2 (7 min;" in out
    assert recipe.STAGES[-1].command(str(runs)) in out
    left = sum(s.measured_s for s in recipe.STAGES[1:]) / 3600
    assert f"# left: about {left:.1f} h" in out
    with pytest.raises(SystemExit) as error:
        recipe.main(["--until", "teacher-nope"])
    assert error.value.code == 2
    assert "invalid choice" in capsys.readouterr().err
    (tmp_path / "file").write_text("x")
    assert recipe.main(["--runs", str(tmp_path / "file"), "--dry-run"]) == 2
    assert "is not a folder" in capsys.readouterr().err
