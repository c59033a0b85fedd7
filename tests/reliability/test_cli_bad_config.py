"""Every command line refuses bad configuration the same way (``jaxopd.cli``): one line on stderr naming the
problem (the flag or variable and the bad value), exit code 2, no traceback, before any model or game is built.

Faults (where the command has the input): a missing checkpoint / input folder, a wrong preset name, an unwritable
output, ``$ALFWORLD_DATA`` pointing at nothing, a teacher whose vocabulary differs from the student's. Each case runs
the command in a subprocess from the repository root, without ``$ALFWORLD_DATA`` unless the case sets it.
(``python -m experiments.train`` has the same cases in tests/methods/test_train_cli.py.)
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # heavier than the README's test run allows (run in CI: pytest -m slow)

ROOT = Path(__file__).resolve().parents[2]

# (command, fault, argv, environment, fragments of the one line); in argv and fragments "{missing}" is a folder that
# does not exist, "{blocked}" a path below a plain file (nothing can be created there), "{out}" a fresh folder,
# "{run}" a folder holding a config.json, "{empty}" an empty folder, "{file}" a plain file, "{student}" /
# "{teacher}" tiny checkpoints with 300 / 400 tokens. Environment None: $ALFWORLD_DATA unset.
MISSING_DATA = {"ALFWORLD_DATA": "{missing}"}
CASES = [
    # experiments.actfirst_alfworld
    ("experiments.actfirst_alfworld", "checkpoint", ["--preset", "cpu", "--weights", "{missing}", "--out", "{out}"],
     None, ["--weights", "{missing}", "no such folder"]),
    ("experiments.actfirst_alfworld", "preset", ["--preset", "laptop", "--out", "{out}"], None,
     ["--preset", "laptop"]),
    ("experiments.actfirst_alfworld", "out", ["--preset", "cpu", "--out", "{blocked}"], None,
     ["--out", "{blocked}", "not writable"]),
    ("experiments.actfirst_alfworld", "alfworld_data", ["--preset", "cpu", "--out", "{out}"], MISSING_DATA,
     ["ALFWORLD_DATA", "{missing}", "not a folder"]),
    # experiments.evaluate
    ("experiments.evaluate", "checkpoint", ["--student", "{missing}", "--out", "{out}"], None,
     ["--student", "{missing}", "no such folder"]),
    ("experiments.evaluate", "checkpoint", ["--student", "{empty}", "--out", "{out}"], None,
     ["--student", "{empty}", "no config.json"]),
    ("experiments.evaluate", "preset", ["--model-preset", "laptop", "--out", "{out}"], None,
     ["--model-preset", "laptop"]),
    ("experiments.evaluate", "out", ["--model-preset", "tiny", "--out", "{blocked}"], None,
     ["--out", "{blocked}", "not writable"]),
    ("experiments.evaluate", "alfworld_data", ["--model-preset", "tiny", "--out", "{out}"], MISSING_DATA,
     ["ALFWORLD_DATA", "{missing}", "not a folder"]),
    # experiments.train_report
    ("experiments.train_report", "checkpoint", ["{missing}", "--out", "{out}"], None,
     ["run folder", "{missing}", "no such folder"]),
    ("experiments.train_report", "out", ["{run}", "--out", "{blocked}"], None, ["--out", "{blocked}", "not writable"]),
    # experiments.actfirst_alfworld.report
    ("experiments.actfirst_alfworld.report", "checkpoint", ["{missing}"], None,
     ["OUT_DIR", "{missing}", "no such folder"]),
    ("experiments.actfirst_alfworld.report", "out", ["{file}"], None, ["OUT_DIR", "{file}", "not a folder"]),
    # bench.sampler_throughput
    ("bench.sampler_throughput", "preset", ["--model", "laptop", "--out", "{out}/r.json"], None,
     ["--model", "laptop", "neither an architecture preset", "nor"]),
    ("bench.sampler_throughput", "out", ["--out", "{blocked}/r.json"], None, ["--out", "{blocked}", "not writable"]),
    # bench.engine_overhead
    ("bench.engine_overhead", "preset", ["--model", "laptop", "--out", "{out}/r.json"], None,
     ["--model", "laptop", "not a model preset"]),
    ("bench.engine_overhead", "out", ["--out", "{blocked}/r.json"], None, ["--out", "{blocked}", "not writable"]),
    # bench.mixed_steps
    ("bench.mixed_steps", "preset", ["--model", "laptop", "--out", "{out}/r.json"], None,
     ["--model", "laptop", "not a model preset"]),
    ("bench.mixed_steps", "out", ["--out", "{blocked}/r.json"], None, ["--out", "{blocked}", "not writable"]),
    # bench.env_pool
    ("bench.env_pool", "checkpoint", ["--games-root", "{missing}", "--out", "{out}/r.json"], None,
     ["--games-root", "{missing}", "no such folder"]),
    ("bench.env_pool", "out", ["--out", "{blocked}/r.json"], None, ["--out", "{blocked}", "not writable"]),
    # bench.env_throughput
    ("bench.env_throughput", "checkpoint", ["--weights", "{missing}", "--out", "{out}/r.json"], None,
     ["--weights", "{missing}", "no such folder"]),
    ("bench.env_throughput", "preset", ["--model", "laptop", "--out", "{out}/r.json"], None,
     ["--model", "laptop", "not a model preset"]),
    ("bench.env_throughput", "out", ["--out", "{blocked}/r.json"], None, ["--out", "{blocked}", "not writable"]),
    # bench.rollout_quality
    ("bench.rollout_quality", "checkpoint", ["--teacher-weights", "{missing}", "--out", "{out}/r.json"], None,
     ["--teacher-weights", "{missing}", "no such folder"]),
    ("bench.rollout_quality", "preset", ["--model", "laptop", "--out", "{out}/r.json"], None,
     ["--model", "laptop", "not a model preset"]),
    ("bench.rollout_quality", "out", ["--out", "{blocked}/r.json"], None, ["--out", "{blocked}", "not writable"]),
    ("bench.rollout_quality", "teacher_vocabulary",
     ["--weights", "{student}", "--teacher-weights", "{teacher}", "--out", "{out}/r.json"], None,
     ["vocabulary", "400", "300", "--teacher-weights", "{teacher}"]),
    # bench.prefill_padding
    ("bench.prefill_padding", "checkpoint", ["--model", "{missing}", "--out", "{out}/r.json"], None,
     ["--model", "{missing}", "no such folder"]),
    ("bench.prefill_padding", "out", ["--model", "{student}", "--out", "{blocked}/r.json"], None,
     ["--out", "{blocked}", "not writable"]),
    # bench.decode_attention
    ("bench.decode_attention", "preset", ["--backends", "laptop", "--out", "{out}/r.json"], None,
     ["--backends", "laptop"]),
    ("bench.decode_attention", "out", ["--out", "{blocked}/r.json"], None, ["--out", "{blocked}", "not writable"]),
    # bench.soak
    ("bench.soak", "preset", ["--model", "laptop", "--out", "{out}"], None,
     ["--model", "laptop", "not a model preset"]),
    ("bench.soak", "out", ["--out", "{blocked}"], None, ["--out", "{blocked}", "not writable"]),
    ("bench.soak", "alfworld_data", ["--out", "{out}"], MISSING_DATA, ["ALFWORLD_DATA", "{missing}", "not a folder"]),
]


@pytest.fixture(scope="module")
def checkpoints(mismatched_checkpoints):
    """Two tiny Hugging Face model folders whose vocabularies differ (300 and 400 tokens)."""
    student, teacher = mismatched_checkpoints
    return {"student": str(student), "teacher": str(teacher)}


def _places(tmp_path: Path, checkpoints: dict[str, str] | None) -> dict[str, str]:
    plain = tmp_path / "plain-file"
    plain.write_text("")
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text("{}")
    (tmp_path / "empty").mkdir()
    places = {"missing": str(tmp_path / "no-such-folder"), "blocked": str(plain / "sub"), "out": str(tmp_path / "o"),
              "run": str(run), "file": str(plain), "empty": str(tmp_path / "empty")}
    return {**places, **(checkpoints or {})}


@pytest.mark.parametrize("command, fault, argv, env, fragments", CASES,
                         ids=[f"{c[0]}-{c[1]}-{i}" for i, c in enumerate(CASES)])
def test_bad_configuration_is_one_line_and_exit_code_2(command, fault, argv, env, fragments, tmp_path, request):
    needs_checkpoints = fault == "teacher_vocabulary" or "{student}" in argv
    places = _places(tmp_path, request.getfixturevalue("checkpoints") if needs_checkpoints else None)
    environment = {k: v for k, v in os.environ.items() if k != "ALFWORLD_DATA"}
    environment.update({k: v.format(**places) for k, v in (env or {}).items()})
    result = subprocess.run([sys.executable, "-m", command, *(a.format(**places) for a in argv)], cwd=ROOT,
                            env=environment, capture_output=True, text=True, timeout=180)
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith("error: "), lines[0]
    for fragment in fragments:
        assert fragment.format(**places) in lines[0], (fragment, lines[0])
    assert not Path(places["out"], "r.json").exists()


def test_every_command_line_is_covered():
    """Each command has its cases, and each command that reads a given input has that fault's case."""
    faults: dict[str, set[str]] = {}
    for command, fault, *_ in CASES:
        faults.setdefault(command, set()).add(fault)
    expected = {"experiments.actfirst_alfworld": {"checkpoint", "preset", "out", "alfworld_data"},
                "experiments.evaluate": {"checkpoint", "preset", "out", "alfworld_data"},
                "experiments.train_report": {"checkpoint", "out"},
                "experiments.actfirst_alfworld.report": {"checkpoint", "out"},
                "bench.sampler_throughput": {"preset", "out"}, "bench.engine_overhead": {"preset", "out"},
                "bench.mixed_steps": {"preset", "out"},
                "bench.env_pool": {"checkpoint", "out"}, "bench.env_throughput": {"checkpoint", "preset", "out"},
                "bench.rollout_quality": {"checkpoint", "preset", "out", "teacher_vocabulary"},
                "bench.decode_attention": {"preset", "out"}, "bench.soak": {"preset", "out", "alfworld_data"},
                "bench.prefill_padding": {"checkpoint", "out"}}
    assert faults == expected
    bench = {f"bench.{p.stem}" for p in (ROOT / "bench").glob("*.py")
             if "__main__" in p.read_text() and p.stem not in ("__init__", "common")}
    # every bench script with a command line is in the matrix (new ones under review by their owners aside)
    assert {name for name in expected if name.startswith("bench.")} <= bench
