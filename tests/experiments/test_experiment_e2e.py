"""A seconds-long miniature of ``python -m experiments.actfirst_alfworld`` on the real engine: 2 b_max values,
2 horizons, both full lengths, a micro Qwen3 with the real vocabulary, the real tokenizer and prompts."""
import csv
import dataclasses
import json
import math

import pytest

from jaxopd_experiments.actfirst_alfworld import report
from jaxopd_experiments.actfirst_alfworld import (PRESETS, Preset, RunOptions, build_parser, departures_from_paper,
                                                  options_from_args, resolve_preset, run_experiment)
from jaxopd_experiments.actfirst_alfworld.contexts import ALFWORLD_TASK_TYPES, ContextSet, InitialContext

pytestmark = pytest.mark.slow  # heavier than the README's test run allows (run in CI: pytest -m slow)

MINIATURE = Preset(
    name="test-miniature", model="micro", tasks_per_batch=2, num_contexts=2, num_batches=1, repeats=2,
    fast_tokens=2, full_lengths=(4, 8), bmax_scan=(2, 4), bmax_scan_T=2, horizon_scan=(1, 2), horizon_scan_bmax=4,
    calibration_contexts=2, calibration_measurements=3, prefill_chunk=64, max_prefill_tokens=64,
    max_prefill_rows=1, page_size=64, note="test miniature")   # few shape buckets: 4 compilations


def micro_model():
    from flax import nnx
    from jaxopd.models.decoder import CausalLM
    from jaxopd.models.weights import model_record
    from micro_models import MICRO, micro_config
    cfg = micro_config(MICRO, vocab_size=151_936)
    model = CausalLM(cfg, rngs=nnx.Rngs(0))
    return model, model_record(model, name="micro", weights=None)


def context_set():
    contexts = tuple(InitialContext(
        task_id=f"alfworld/train/synthetic-{i}", task_type=ALFWORLD_TASK_TYPES[i],
        instruction="Your task is to: put a clean mug in coffeemachine.",
        observation="You are in the middle of a room. Looking quickly around you, you see a cabinet 1, a "
                    "coffeemachine 1, a countertop 1, and a sinkbasin 1.",
        admissible_actions=("go to cabinet 1", "go to coffeemachine 1", "go to countertop 1", "go to sinkbasin 1",
                            "inventory", "look")) for i in range(2))
    return ContextSet(contexts, {"benchmark": "alfworld", "games": "generated", "seed": 42, "pool_size": 2,
                                 "distinct_tasks": 2})


@pytest.fixture(scope="module")
def miniature_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("actfirst_miniature")
    options = RunOptions(preset=MINIATURE, model="micro", weights=None, policies=("fifo",), out=out,
                         progress=False, command="pytest miniature")
    results = run_experiment(options, model_and_info=micro_model(), context_set=context_set())
    return out, results


def test_miniature_writes_every_output(miniature_run):
    out, results = miniature_run
    for name in report.OUTPUT_FILES:
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    for png in (report.BMAX_PLOT, report.HORIZON_PLOT):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = json.loads((out / report.RESULTS_FILE).read_text())
    assert saved["model"]["random_weights"] is True and saved["model"]["name"] == "micro"
    assert saved["machine"]["backend"] == "cpu" and saved["machine"]["jax"]
    summary = (out / report.SUMMARY_FILE).read_text()
    assert "random weights" in summary and "Departures from the paper" in summary
    assert "tasks per batch: 2 (paper: 16)" in summary
    with (out / report.CSV_FILE).open() as f:
        rows = list(csv.DictReader(f))
    # per full length: (T=2, b=2), (T=2, b=4) of the b_max scan, (T=1, b=4) of the T scan; (2, 4) is shared
    assert sorted((int(r["full_tokens"]), int(r["T"]), int(r["b_max"])) for r in rows) == \
        [(4, 1, 4), (4, 2, 2), (4, 2, 4), (8, 1, 4), (8, 2, 2), (8, 2, 4)]
    assert {r["scans"] for r in rows if r["T"] == "2" and r["b_max"] == "4"} == {"bmax+horizon"}


def test_miniature_timings_are_positive_and_speedups_finite(miniature_run):
    _, results = miniature_run
    assert len(results["points"]) == 6
    for p in results["points"]:
        assert len(p["repeats"]) == 2
        assert [r["order"] for r in p["repeats"]] == [["vanilla", "actfirst"], ["actfirst", "vanilla"]]
        for r in p["repeats"]:
            times = r["vanilla_batch_times_s"] + r["actfirst_batch_times_s"]
            assert len(times) == 2 and all(t > 0 and math.isfinite(t) for t in times)
            assert math.isfinite(r["speedup"]) and r["speedup"] > 0
            assert r["speedup"] == pytest.approx(r["vanilla_total_s"] / r["actfirst_total_s"])
            # the engine's recorded events were checked against the protocol for every batch
            assert r["schedule_verified"] is True
            assert r["preemptions"] == 0
            # the cap holds; reaching 2 needs the two episodes' requests to overlap, which depends on thread
            # timing (a loaded machine ran them one after the other: peak 1)
            assert 1 <= r["vanilla_peak_concurrency"] <= min(p["b_max"], 2)
            assert r["actfirst_peak_concurrency"] <= p["b_max"]
        assert math.isfinite(p["speedup_mean"]) and math.isfinite(p["speedup_std"])      # two repeats: a std
        speedups = [r["speedup"] for r in p["repeats"]]                                   # and its spread fields
        assert (p["speedup_min"], p["speedup_max"]) == (min(speedups), max(speedups))
        assert p["speedup_sem"] == pytest.approx(p["speedup_std"] / math.sqrt(2))
        ideal = p["idealized"]
        assert math.isfinite(ideal["calibrated_speedup"]) and ideal["calibrated_speedup"] >= 1.0 - 1e-9
        assert p["paper_speedup"] is None
    cal = results["calibration"]
    assert set(cal["medians"]) == {"fast", "full4", "full8"}
    assert all(len(m) == 3 and all(v > 0 for v in m) for per in cal["latencies_s"].values() for m in per)
    for key in ("contexts", "tokenize", "model_init", "engine_warmup", "calibration", "scan", "total"):
        assert results["timing_s"][key] >= 0
    lines = report.key_numbers(results)
    assert lines[-1].startswith("model micro (random weights) on cpu")


def test_presets_and_cli_options():
    assert resolve_preset("auto", "cpu").name == "cpu"
    assert resolve_preset("auto", "gpu").name == "gpu-quick"
    assert resolve_preset("auto", "tpu").name == "gpu-quick"
    paper = PRESETS["paper"]
    assert (paper.tasks_per_batch, paper.num_contexts, paper.num_batches, paper.repeats) == (16, 1024, 64, 3)
    assert paper.bmax_scan == (16, 32, 64, 128, 256) and paper.horizon_scan == (1, 2, 4, 8, 16, 30)
    assert ((paper.fast_tokens, paper.full_lengths, paper.bmax_scan_T, paper.horizon_scan_bmax)
            == (16, (128, 512), 30, 256))
    assert len(paper.scan_points()) == 5 + 6 - 1            # (T=30, b_max=256) is shared by both scans
    for preset in PRESETS.values():
        preset.validate()
        assert preset.full_lengths == (128, 512)
        if preset.name != "cpu":
            assert len(preset.bmax_scan) >= 4 and len(preset.horizon_scan) >= 4
    cpu = PRESETS["cpu"]
    # 2 cores and 10 minutes: a mean and a spread (2 paired repeats; 3 took 13 min) at fewer points, both
    # b_max/N ends and T 1-3
    assert cpu.repeats == 2 and cpu.bmax_scan == (2, 6) and cpu.horizon_scan == (1, 2, 3)
    assert departures_from_paper(paper, model_name="qwen3-1.7b", paper_architecture=True, random_weights=False,
                                 policies=("fifo",), contexts_source={"games": "official"}, backend="gpu") == \
        [departures_from_paper(paper, model_name="x", paper_architecture=True, random_weights=False,
                               policies=("fifo",), contexts_source={}, backend="gpu")[0]]   # only the engine
    assert len(departures_from_paper(cpu, model_name="tiny", paper_architecture=False, random_weights=True,
                                     policies=("fifo",), contexts_source={"games": "generated"}, backend="cpu")) >= 8
    opts = options_from_args(build_parser().parse_args(["--preset", "paper", "--contexts", "64", "--repeats", "1",
                                                        "--policy", "both", "--out", "x"]))
    assert (opts.preset.num_contexts, opts.preset.num_batches, opts.preset.repeats) == (64, 4, 1)
    assert opts.preset.calibration_contexts == 64 and opts.policies == ("fifo", "fast-first")
    opts = options_from_args(build_parser().parse_args(["--preset", "cpu", "--batches", "2", "--out", "x"]))
    assert (opts.preset.num_batches, opts.preset.num_contexts) == (2, 4)
    with pytest.raises(ValueError):
        options_from_args(build_parser().parse_args(["--preset", "cpu", "--contexts", "3", "--batches", "2"]))
    with pytest.raises(ValueError):
        dataclasses.replace(PRESETS["cpu"], bmax_scan=(2, 2)).validate()
