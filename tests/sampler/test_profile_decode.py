"""bench/profile_decode.py: the trace-events summary on hand-made GPU-like and CPU-like traces (exact figures), the
choice of a sweep's best kernel point, the tar.gz size cap, and the whole script on CPU with a micro model (both
drivers, scan_layers, the trace, the HLO and ``--summarize``)."""
import gzip
import json
import tarfile

import pytest

from bench import profile_decode as pd
from jaxopd import cli

pytestmark = pytest.mark.slow  # heavier than the README's test run allows (run in CI: pytest -m slow)


def _meta(pid, name, tid=None):
    e = {"ph": "M", "pid": pid, "name": "thread_name" if tid is not None else "process_name", "args": {"name": name}}
    if tid is not None:
        e["tid"] = tid
    return e


def _x(pid, tid, ts, dur, name, **args):
    e = {"ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": dur, "name": name}
    if args:
        e["args"] = args
    return e


def gpu_like_trace():
    """Two decode steps on a GPU as xprof writes them: host annotations and launches on /host:CPU, kernels on a
    stream line of /device:GPU:0, plus the derived lines (XLA Ops duplicates the kernels, XLA Modules the step)."""
    host, gpu = 1, 2
    events = [_meta(host, "/host:CPU"), _meta(host, "python3", 10), _meta(gpu, "/device:GPU:0"),
              _meta(gpu, "Stream #7(Compute)", 7), _meta(gpu, "XLA Ops", 100), _meta(gpu, "XLA Modules", 101)]
    # step 0 dispatched at 0 (ends 50), step 1 at 200 (ends 240)
    events += [_x(host, 10, 0, 50, "decode_step#24"), _x(host, 10, 200, 40, "decode_step#25")]
    events += [_x(host, 10, 5 + 10 * i, 2, "cuLaunchKernel") for i in range(3)]
    events += [_x(host, 10, 205 + 10 * i, 2, "cuLaunchKernel") for i in range(3)]
    # a kernel of the step before (started before the first annotation): left out
    events.append(_x(gpu, 7, -30, 20, "fusion_old", hlo_module="jit_decode_step", hlo_op="fusion.0"))
    # step 0: kernels 10-40, 45-95, 100-110 (gaps 5 and 5); step 1 starts at 210 (the device waited for the host:
    # gap 110-210 holds the annotation start at 200); step 1: 210-240, 240-290, 300-310 (gap 10)
    for base in (10, 210):
        events.append(_x(gpu, 7, base, 30, "gemm_qkv", hlo_module="jit_decode_step", hlo_op="dot.1"))
        events.append(_x(gpu, 7, base + 35 - (5 if base == 210 else 0), 50, "paged_attention_rows_16x128",
                         hlo_module="jit_decode_step", hlo_op="custom-call.3"))
        events.append(_x(gpu, 7, base + 90, 10, "loop_fusion", hlo_module="jit_decode_step", hlo_op="fusion.7"))
    # a kernel of another module (a prefill step): left out
    events.append(_x(gpu, 7, 400, 100, "fusion_prefill", hlo_module="jit_prefill_step", hlo_op="fusion.1"))
    # derived lines: never counted as kernels
    events += [_x(gpu, 100, 10, 100, "dot.1"), _x(gpu, 101, 10, 100, "jit_decode_step(123)"),
               _x(gpu, 101, 210, 100, "jit_decode_step(123)")]
    return events


def test_summary_of_a_gpu_like_trace():
    s = pd.summarize_trace(gpu_like_trace(), top=2)
    assert s["source"] == "device" and s["steps"] == 2
    assert s["kernels"] == 6 and s["kernels_per_step"] == 3 and s["distinct_kernels"] == 3
    # busy: (30 + 50 + 10) + (30 + 50 + 10) - overlap 0 = 180 µs; span 10..310 = 300 µs; gaps 120 µs
    assert s["device_busy_ms_per_step"] == pytest.approx(0.090)
    assert s["device_span_ms_per_step"] == pytest.approx(0.150)
    assert s["gap_ms_per_step"] == pytest.approx(0.060)
    assert s["gap_waiting_host_ms_per_step"] == pytest.approx(0.050)         # 110 -> 210, dispatch at 200
    assert s["gap_within_device_ms_per_step"] == pytest.approx(0.010)
    assert s["idle_share"] == pytest.approx(120 / 300)
    assert [k["name"] for k in s["top_kernels"]] == ["paged_attention_rows_16x128", "gemm_qkv"]
    assert s["top_kernels"][0]["us_per_step"] == pytest.approx(50) and s["top_kernels"][0]["calls_per_step"] == 1
    assert s["top_kernels"][0]["hlo_op"] == "custom-call.3"
    assert s["largest_gaps"][0]["us"] == pytest.approx(100) and s["largest_gaps"][0]["before"] == "gemm_qkv"
    per = s["per_step"]
    assert per["steps"] == 2 and per["kernels"] == 3
    assert per["device_period_ms"] == pytest.approx(0.200) and per["gap_before_ms"] == pytest.approx(0.100)
    assert s["launches_per_step"] == 3 and s["graph_launches_per_step"] == 0
    assert s["module_runs"] == 2 and s["module_ms_median"] == pytest.approx(0.100)
    assert s["host_dispatch_ms_median"] == pytest.approx(0.045)
    assert s["host_step_period_ms_median"] == pytest.approx(0.2)
    text = pd.format_summary(s, title="gpu")
    assert "3.0 per step" in text and "paged_attention_rows_16x128" in text and "waiting for the host" in text


def test_summary_of_a_cpu_like_trace():
    """No device process: XLA's ops on host threads carry hlo_op (and run_id: one per step)."""
    host = 1
    events = [_meta(host, "/host:CPU"), _meta(host, "python", 1), _meta(host, "tf_XLAPjRtCpuClient/1", 2)]
    events += [_x(host, 1, 0, 5, "decode_step#4"), _x(host, 1, 100, 5, "decode_step#5"),
               _x(host, 1, 200, 5, "decode_step#6")]
    for step, base in enumerate((10, 110, 210)):
        for i, name in enumerate(("ynn_fusion", "wrapped_sine", "ynn_fusion.1")):
            events.append(_x(host, 2, base + 20 * i, 10, name, hlo_module="jit_decode_step", hlo_op=name,
                             run_id=str(step)))
        events.append(_x(host, 2, base + 70, 1, "end: ynn_fusion"))             # no hlo_op: not a kernel
    events.append(_x(host, 2, 260, 10, "other", hlo_module="jit_score_step", hlo_op="other", run_id="9"))
    s = pd.summarize_trace(events)
    assert s["source"].startswith("host threads") and s["steps"] == 3
    assert s["kernels_per_step"] == 3 and s["per_step"]["steps"] == 3 and s["per_step"]["kernels"] == 3
    assert s["per_step"]["busy_ms"] == pytest.approx(0.030) and s["per_step"]["gaps_within_ms"] == pytest.approx(0.020)
    assert s["per_step"]["device_period_ms"] == pytest.approx(0.100)
    assert s["launches_per_step"] == 0


def test_trace_without_kernels_still_summarises():
    """A GPU trace whose device lines are missing (no CUPTI): the host figures still come out."""
    events = [_meta(1, "/host:CPU"), _x(1, 1, 0, 5, "decode_step#0"), _x(1, 1, 10, 5, "decode_step#1")]
    s = pd.summarize_trace(events)
    assert s["kernels"] == 0 and s["steps"] == 2 and s["host_step_period_ms_median"] == pytest.approx(0.010)
    assert "no kernel events" in pd.format_summary(s)


def test_trace_files_are_found_and_read(tmp_path):
    folder = tmp_path / "plugins" / "profile" / "run"
    folder.mkdir(parents=True)
    with gzip.open(folder / "host.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": gpu_like_trace()}, f)
    assert pd.find_trace_file(tmp_path).name == "host.trace.json.gz"
    assert pd.summarize_trace(pd.load_trace_events(tmp_path))["kernels"] == 6
    with tarfile.open(tmp_path / "t.tar.gz", "w:gz") as tar:
        tar.add(folder / "host.trace.json.gz", arcname="trace_b1/plugins/profile/run/host.trace.json.gz")
    assert len(pd.load_trace_events(tmp_path / "t.tar.gz", member="trace_b1")) == len(gpu_like_trace())
    with pytest.raises(FileNotFoundError):
        pd.load_trace_events(tmp_path / "t.tar.gz", member="trace_b256")


def test_best_sweep_point(tmp_path):
    def row(batch, ratio, **params):
        return {"backend": "x", "batch": batch, "ratio_to_roofline": ratio,
                "params": {"k_splits": 0, "pages_per_block": 8, "num_warps": 4, "num_stages": 2, **params}}
    rows = [row(1, 10.0), row(256, 3.0),                                     # geometric mean 5.48
            row(1, 6.0, pages_per_block=4), row(256, 4.0, pages_per_block=4),    # 4.90: the best
            row(1, 2.0, num_warps=8),                                        # cut short: timed at one batch only
            {"backend": "reference-hnd", "batch": 1, "ratio_to_roofline": 1.0, "params": None}]
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps({"rows": rows}))
    assert pd.best_sweep_point(path) == {"k_splits": 0, "pages_per_block": 4, "num_warps": 4, "num_stages": 2}
    path.write_text(json.dumps({"rows": rows[-1:]}))
    with pytest.raises(cli.UsageError):
        pd.best_sweep_point(path)


def test_pack_leaves_out_the_xplane_over_the_limit(tmp_path):
    import os

    raw = tmp_path / "raw"
    (raw / "trace").mkdir(parents=True)
    (raw / "trace" / "h.xplane.pb").write_bytes(os.urandom(300_000))
    (raw / "trace" / "h.trace.json.gz").write_bytes(b"x" * 1000)
    assert pd.pack(raw, tmp_path / "a.tar.gz", limit_mb=1) == []
    assert pd.pack(raw, tmp_path / "b.tar.gz", limit_mb=0.1) == ["trace/h.xplane.pb"]
    with tarfile.open(tmp_path / "b.tar.gz") as tar:
        assert tar.getnames() == ["trace/h.trace.json.gz"]


def test_usage_errors(tmp_path):
    def code(*argv):
        return cli.run_main(lambda: pd.main(["--model", "micro", "--out", str(tmp_path), *argv]))
    assert code("--batches", "1", "--trace-batches", "4") == 2
    assert code("--k-splits", "2", "--backend", "reference") == 2
    assert code("--warm-steps", "2") == 2
    assert code("--from-sweep", str(tmp_path / "missing.json"), "--backend", "pallas-gpu") == 2
    assert cli.run_main(lambda: pd.main(["--model", "nope", "--out", str(tmp_path)])) == 2


def test_engine_driver_end_to_end(tmp_path, capsys):
    """The micro model through the engine on CPU: timing rows, a trace summary with kernels, the HLO, the tar.gz,
    and ``--summarize`` on it."""
    pd.main(["--model", "micro", "--batches", "1", "4", "--trace-batches", "4", "--steps", "4", "--timed-steps",
             "6", "--prompt-len", "20", "--out", str(tmp_path), "--label", "t"])
    result = json.loads((tmp_path / "t.json").read_text())
    assert [r["batch"] for r in result["rows"]] == [1, 4]
    for r in result["rows"]:
        assert r["timed_steps"] == 6 and r["decode_step_ms"] > 0 and r["roofline_ms"] > 0
        assert r["hlo"]["entry_instructions"] > 0 and r["hlo"]["seconds"] < 5      # the run's compilation
    assert "trace" not in result["rows"][0]
    trace = result["rows"][1]["trace"]
    assert trace["steps"] == 4 and trace["kernels_per_step"] > 10 and trace["top_kernels"]
    assert trace["host_dispatch_ms_median"] > 0 and trace["device_busy_ms_per_step"] > 0
    with tarfile.open(tmp_path / "t.tar.gz") as tar:
        names = tar.getnames()
    assert "hlo/decode_step_b1.txt" in names and any(n.endswith(".trace.json.gz") for n in names)
    assert "median step" in (tmp_path / "t.txt").read_text()
    capsys.readouterr()
    pd.main(["--summarize", str(tmp_path / "t.tar.gz")])
    assert "kernels from host threads" in capsys.readouterr().out


def test_executor_driver_with_scan_layers(tmp_path):
    """The executor alone, scan_layers, no trace: one decode shape per batch, the scan's while loop in the HLO."""
    pd.main(["--model", "micro", "--driver", "executor", "--scan-layers", "--batches", "2", "--no-trace",
             "--steps", "3", "--timed-steps", "5", "--context", "24", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "scan_exec.json").read_text())
    assert result["scan_layers"] and result["label"] == "scan_exec"
    (row,) = result["rows"]
    assert row["driver"] == "executor" and row["decode_step_ms"] > 0 and "trace" not in row
    assert row["hlo"]["while_loops"] >= 1
