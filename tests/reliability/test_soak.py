"""A short soak (``python -m bench.soak``, 12 episodes on real ALFWorld and ScienceWorld environments through the
real engine): its outputs exist, its counts add up, no JVM outlives it and its thread count ends where it started.
The 1,000-episode soak itself is run separately (see bench/soak.py)."""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EPISODES = 12

pytestmark = pytest.mark.slow        # about 1.5 to 3 minutes on 2 CPU cores (engine warm-up, a JVM per slot)


@pytest.fixture(scope="module")
def soak(tmp_path_factory):
    pytest.importorskip("scienceworld")
    pytest.importorskip("alfworld")
    out = tmp_path_factory.mktemp("soak")
    environment = {k: v for k, v in os.environ.items() if k != "ALFWORLD_DATA"}
    result = subprocess.run([sys.executable, "-m", "bench.soak", "--episodes", str(EPISODES), "--slots", "2",
                             "--max-turns", "2", "--sample-every", "4", "--max-prompt-tokens", "768", "--no-progress",
                             "--out", str(out)], cwd=ROOT, env=environment, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, (result.returncode, result.stdout[-3000:], result.stderr[-3000:])
    return out, json.loads((out / "soak.json").read_text())


def test_outputs_exist(soak):
    out, _ = soak
    for name in ("soak.json", "soak.csv", "soak.md", "soak.png"):
        assert (out / name).stat().st_size > 0, name
    assert "JVMs left" in (out / "soak.md").read_text()


def test_counts_add_up(soak):
    out, result = soak
    summary, config = result["summary"], result["config"]
    assert summary["episodes"] == EPISODES
    assert config["alfworld_episodes"] + config["scienceworld_episodes"] == EPISODES
    assert config["alfworld_episodes"] == config["scienceworld_episodes"] == EPISODES // 2
    assert sum(result["end_reasons"].values()) + summary["failed"] == EPISODES
    assert sum(result["failures"].values()) == summary["failed"]
    per_benchmark = result["per_benchmark"]
    assert sum(b.get("episodes", 0) + b.get("failed", 0) for b in per_benchmark.values()) == EPISODES
    samples = result["samples"]
    assert [s["episodes"] for s in samples] == [0, 4, 8, 12]
    with open(out / "soak.csv") as f:
        assert [int(row["episodes"]) for row in csv.DictReader(f)] == [0, 4, 8, 12]
    assert all(s["pages_free"] == s["pages_total"] for s in samples), "KV pages held by an idle engine"
    assert result["command"].startswith("python -m bench.soak --episodes 12")


def test_no_jvm_left_and_threads_back(soak):
    _, result = soak
    summary = result["summary"]
    assert max(s["java_processes"] for s in result["samples"]) >= 1        # ScienceWorld ran in JVMs
    assert summary["after_close"]["java_processes"] == 0
    threads = summary["threads_python"]
    assert threads["end"] == threads["steady_start"]
    assert threads["after_close"] == threads["baseline"]
    assert summary["threads_os"]["end"] == summary["threads_os"]["steady_start"]
    verdict = summary["verdict"]
    assert verdict["no_jvm_left"] and verdict["threads_flat"] and verdict["threads_back_to_baseline"]
    assert verdict["rss_flat"] is None                  # 12 episodes are too few to judge a memory slope
    assert verdict["pass"]
