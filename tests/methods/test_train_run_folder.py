"""A run folder holds one run: a second process is refused, a resume is checked against the config its checkpoints
were trained with, a damaged newest checkpoint is passed over with a warning, every step is logged once after a
restart, SIGINT / SIGTERM write a checkpoint and stop with one line, and bad command lines create no folder."""
from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from flax import nnx

from jaxopd.methods.config import build_config
from jaxopd.methods.metrics_log import read_jsonl
from jaxopd.methods.run_folder import (Interrupted, RunFolderError, RunLock, check_resume, config_differences,
                                       save_config)
from jaxopd.models.decoder import CausalLM, ModelConfig
from jaxopd.models.weights import save_model

pytestmark = pytest.mark.slow  # heavier than the README's test run allows (run in CI: pytest -m slow)

ROOT = Path(__file__).resolve().parents[2]
MICRO = ModelConfig(hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8, intermediate_size=32,
                    vocab_size=64, dtype="float32", param_dtype="float32")


def run_cli(*args, env=None, timeout=300):
    environment = {k: v for k, v in os.environ.items() if k != "ALFWORLD_DATA"}
    environment.update(env or {})
    return subprocess.run([sys.executable, "-m", "experiments.train", *args], cwd=ROOT, env=environment,
                          capture_output=True, text=True, timeout=timeout)


def one_line(result, code, *fragments):
    assert result.returncode == code, (result.returncode, result.stderr[-3000:])
    lines = [line for line in result.stderr.splitlines() if line.strip() and not line.startswith(("W1", "I1"))]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


# ---------------------------------------------------------------------------------------------------- the lock
def test_a_second_process_is_refused_with_the_owners_pid(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from jaxopd.methods.run_folder import RunLock
        with RunLock({str(tmp_path)!r}):
            print("held", flush=True)
            time.sleep(60)
        """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunFolderError, match=f"is in use by pid {holder.pid}"):
            with RunLock(tmp_path):
                pass
    finally:
        holder.kill()
        holder.wait()
    with RunLock(tmp_path), RunLock(tmp_path):      # free again once its owner is gone; re-entrant in a process
        pass


# ---------------------------------------------------------------------------------------------------- resume
def _checkpoint_with_config(folder: Path, config, step: int = 2) -> None:
    """A checkpoint folder as the loop writes it, with the run's config in its metadata."""
    import jax

    from jaxopd.train.checkpoint import TrainCheckpointer
    from jaxopd.train.mesh import RolePlan, build_meshes
    from jaxopd.train.state import OptimizerConfig, init_train_state, make_optimizer, train_state_shardings

    _, params = nnx.split(CausalLM(MICRO, rngs=nnx.Rngs(0)), nnx.Param)
    optimizer = make_optimizer(OptimizerConfig(learning_rate=1e-3))
    shardings = train_state_shardings(params, optimizer, build_meshes(RolePlan.for_device_count(
        len(jax.devices()))).trainer)
    with TrainCheckpointer(folder / "checkpoints") as checkpointer:
        for s in range(1, step + 1):
            checkpointer.save(init_train_state(params, optimizer, shardings),
                              metadata={"cursor": 0, "config": config.to_dict()}, step=s)


def test_resume_checks(tmp_path):
    config = build_config("vanilla-opd", preset="cpu", updates=4, student=str(tmp_path / "student"))
    # no checkpoint: a stale config.json from a failed start holds no run to protect
    save_config(tmp_path, build_config("vanilla-opd", preset="cpu", learning_rate=0.5))
    assert check_resume(tmp_path, config) is None
    _checkpoint_with_config(tmp_path, config)
    (tmp_path / "config.json").unlink()         # the checkpoint's own copy is the reference
    assert check_resume(tmp_path, config) == 2
    slash = build_config("vanilla-opd", preset="cpu", updates=4, student=str(tmp_path / "student") + "/")
    assert check_resume(tmp_path, slash) == 2   # the same folder spelled with a trailing slash
    with pytest.raises(RunFolderError, match="different config.*learning_rate"):
        check_resume(tmp_path, build_config("vanilla-opd", preset="cpu", updates=4, learning_rate=0.5,
                                            student=str(tmp_path / "student")))
    with pytest.raises(RunFolderError, match="--updates 1 is below update 2"):
        check_resume(tmp_path, build_config("vanilla-opd", preset="cpu", updates=1,
                                            student=str(tmp_path / "student")))
    assert config_differences({"updates": 1}, {"updates": 9}, {}) == []


def test_checkpoints_without_a_record_of_their_config_are_refused(tmp_path):
    config = build_config("vanilla-opd", preset="cpu", updates=4)
    _checkpoint_with_config(tmp_path, config, step=1)
    for meta in glob.glob(str(tmp_path / "checkpoints" / "*" / "metadata" / "metadata")):
        data = json.loads(Path(meta).read_text())
        data["user"].pop("config")
        Path(meta).write_text(json.dumps(data))
    with pytest.raises(RunFolderError, match="no record of the config"):
        check_resume(tmp_path, config)


@pytest.mark.parametrize("damage", ["data", "metadata", "empty-step"])
def test_a_damaged_newest_checkpoint_is_passed_over(tmp_path, damage):
    import jax

    from jaxopd.train.checkpoint import TrainCheckpointer
    from jaxopd.train.mesh import RolePlan, build_meshes
    from jaxopd.train.state import OptimizerConfig, abstract_train_state, make_optimizer, train_state_shardings

    config = build_config("vanilla-opd", preset="cpu", updates=4)
    _checkpoint_with_config(tmp_path, config, step=2)
    root = tmp_path / "checkpoints"
    if damage == "data":
        for path in glob.glob(str(root / "2" / "train_state" / "**" / "d" / "*"), recursive=True):
            os.truncate(path, 5)
    elif damage == "metadata":
        os.truncate(root / "2" / "metadata" / "metadata", 5)
    else:
        shutil.rmtree(root / "2")
        (root / "3").mkdir()
    _, params = nnx.split(CausalLM(MICRO, rngs=nnx.Rngs(0)), nnx.Param)
    optimizer = make_optimizer(OptimizerConfig(learning_rate=1e-3))
    shardings = train_state_shardings(params, optimizer, build_meshes(RolePlan.for_device_count(
        len(jax.devices()))).trainer)
    warnings = []
    with TrainCheckpointer(root) as checkpointer:
        restored = checkpointer.restore_latest(abstract_train_state(params, optimizer, shardings),
                                               warn=warnings.append)
    assert restored.step == 1
    bad = 3 if damage == "empty-step" else 2
    assert len(warnings) == 1 and f"checkpoint of step {bad} " in warnings[0] and "damaged" in warnings[0]
    assert sorted(p.name for p in root.iterdir()) == ["1", f"{bad}.damaged"]


# ---------------------------------------------------------------------------------------------------- the loop
@pytest.fixture(scope="module")
def loop_parts(tmp_path_factory):
    from tests.methods import test_train_loop as loop

    pytest.importorskip("alfworld")
    from jaxopd_envs import alfworld_gen
    from jaxopd_envs.alfworld import AlfWorldEnv
    from jaxopd.methods.benchmarks import BenchmarkSource
    from jaxopd.tokenizer import Qwen3Tokenizer

    import functools
    root = alfworld_gen.ensure_games(tmp_path_factory.mktemp("games"), seed=0,
                                     counts={"train": 2, "valid_seen": 0, "valid_unseen": 0}, workers=1,
                                     progress=False)
    source = BenchmarkSource("alfworld", root, "generated", functools.partial(AlfWorldEnv, root))
    return loop, source, Qwen3Tokenizer()


def _trainer(loop_parts, out, *, on_phase=None, **overrides):
    from jaxopd.methods.loop import Trainer

    loop, source, tokenizer = loop_parts
    config = build_config("vanilla-opd", preset="cpu", **{**loop.SMALL, "rollout_mode": "sync", **overrides})
    return Trainer(config, student=CausalLM(loop.MICRO, rngs=nnx.Rngs(0)), teacher=CausalLM(loop.MICRO,
                   rngs=nnx.Rngs(1)), tokenizer=tokenizer, source=source, out_dir=out, progress=False,
                   tensorboard=False, log=lambda message: None, on_phase=on_phase)


def test_a_run_killed_before_its_first_checkpoint_logs_each_step_once(loop_parts, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    # what a run killed before its first checkpoint leaves: steps 1 and 2 logged, no checkpoint
    (out / "train.jsonl").write_text("".join(json.dumps({"kind": "train", "step": s, "loss": 9.0}) + "\n"
                                             for s in (1, 2)))
    _trainer(loop_parts, out, updates=3, checkpoint_every=10).run()
    steps = [r["step"] for r in read_jsonl(out / "train.jsonl")]
    assert steps == [1, 2, 3]
    assert all(r["loss"] != 9.0 for r in read_jsonl(out / "train.jsonl"))


def test_sigint_writes_a_checkpoint_and_the_rerun_continues(loop_parts, tmp_path):
    out = tmp_path / "run"

    def interrupt(phase, update):
        if phase == "step" and update == 2:
            os.kill(os.getpid(), signal.SIGINT)

    with pytest.raises(Interrupted) as stopped:
        _trainer(loop_parts, out, updates=4, checkpoint_every=10, on_phase=interrupt).run()
    assert stopped.value.update == 2 and stopped.value.exit_code == 130
    assert str(stopped.value) == "interrupted at update 2; checkpoint written; rerun the same command to resume"
    assert (out / "checkpoints" / "2").is_dir()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler      # handlers given back
    summary = _trainer(loop_parts, out, updates=4, checkpoint_every=10).run()
    assert summary["updates"] == 4
    assert [r["step"] for r in read_jsonl(out / "train.jsonl")] == [1, 2, 3, 4]


# ---------------------------------------------------------------------------------------------------- the CLI
def test_export_into_the_run_folder_is_refused_and_nothing_is_created(tmp_path):
    out = tmp_path / "run"
    one_line(run_cli("--method", "vanilla-opd", "--out", str(out), "--export", str(out)), 2, "--export",
             "run folder")
    assert not out.exists()
    one_line(run_cli("--method", "vanilla-opd", "--out", str(out), "--export", str(tmp_path / "hf"),
                     "--student", str(tmp_path / "missing")), 2, "--student")
    assert not out.exists() and not (tmp_path / "hf").exists()


def test_phase_log_naming_a_folder_is_refused(tmp_path):
    one_line(run_cli("--method", "vanilla-opd", "--out", str(tmp_path / "run"), "--phase-log", str(tmp_path)), 2,
             "--phase-log", "is a folder")
    assert not (tmp_path / "run").exists()


def test_a_changed_config_is_one_line_and_exit_2(tmp_path):
    out = tmp_path / "run"
    save_model(CausalLM(MICRO, rngs=nnx.Rngs(0)), tmp_path / "student")
    config = build_config("vanilla-opd", preset="cpu", updates=4, student=str(tmp_path / "student"),
                          teacher=str(tmp_path / "student"))
    _checkpoint_with_config(out, config)
    line = one_line(run_cli("--method", "vanilla-opd", "--out", str(out), "--student", str(tmp_path / "student"),
                            "--teacher", str(tmp_path / "student"), "--updates", "4", "--learning-rate", "0.5"), 2,
                    "different config", "learning_rate")
    assert str(out) in line
    one_line(run_cli("--method", "vanilla-opd", "--out", str(out), "--student", str(tmp_path / "student"),
                     "--teacher", str(tmp_path / "student"), "--updates", "1"), 2, "--updates 1 is below update 2")


@pytest.mark.slow
def test_sigterm_stops_a_training_command_with_a_checkpoint(loop_parts, tmp_path):
    """A real ``python -m experiments.train`` process, SIGTERM during its second update: one line, exit 143, a
    checkpoint, no process left behind."""
    from tests.reliability.test_train_kill_resume import alive, descendants

    loop, source, _ = loop_parts
    from jaxopd.tokenizer import QWEN3_VOCAB_SIZE
    micro = ModelConfig(**{**MICRO.__dict__, "vocab_size": QWEN3_VOCAB_SIZE})
    save_model(CausalLM(micro, rngs=nnx.Rngs(0)), tmp_path / "student")
    save_model(CausalLM(micro, rngs=nnx.Rngs(1)), tmp_path / "teacher")
    out, phases = tmp_path / "run", tmp_path / "phases"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update({"ALFWORLD_DATA": str(source.root), "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"})
    process = subprocess.Popen(
        [sys.executable, "-m", "experiments.train", "--method", "vanilla-opd", "--games", "official",
         "--student", str(tmp_path / "student"), "--teacher", str(tmp_path / "teacher"), "--out", str(out),
         "--updates", "6", "--batch-size", "2", "--rollout-slots", "2", "--checkpoint-every", "10", "--max-turns",
         "2", "--max-prompt-tokens", "1536", "--max-train-tokens", "1600", "--first-stage-tokens", "8",
         "--total-tokens", "16", "--second-stage-tokens", "4", "--fast-action-tokens", "6", "--no-eval",
         "--no-progress", "--phase-log", str(phases)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and process.poll() is None:
        if phases.is_file() and "step 2 " in phases.read_text():
            break
        time.sleep(0.05)
    below = descendants(process.pid)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 143, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.startswith("interrupted")]
    assert lines and lines[-1].startswith("interrupted at update ") and "checkpoint written" in lines[-1]
    assert "Traceback" not in stderr
    assert any(p.name.isdigit() for p in (out / "checkpoints").iterdir())
    deadline = time.monotonic() + 10
    while alive(below) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(below)
