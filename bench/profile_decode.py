"""Profile of the sampler's decode step: a JAX profiler trace of steady decode steps, the optimised HLO of the step,
and a summary of where a step's time goes (kernels per step, the top kernels, the device's idle gaps, host time).

Drives the engine as ``bench/sampler_throughput.py`` does (``--driver engine``: ``Engine.generate`` of ``batch``
random prompts with a fixed output length; the decode steps of the full batch are the steady state), or the
executor alone (``--driver executor``: a synthetic ``--context`` already cached for every row, decode steps
fed their own tokens on the device, no prefill: only the decode shapes compile, and the step is timed without
the engine's host loop). Per batch size:

1. ``--warm-steps`` full-batch decode steps (compilation, steady state), then ``--timed-steps`` timed without the
   profiler: the step period (median time between two dispatches; the executor driver: wall time / steps with
   the device kept busy), the dispatch time, and the step against the memory roofline (weight bytes + K/V bytes
   at the mean context, over ``--bandwidth``);
2. ``--steps`` more steps under ``jax.profiler`` (batches of ``--trace-batches``), each wrapped in a
   ``decode_step#k`` annotation, and the trace summarised (``summarize_trace``);
3. the optimised HLO of the decode step at that shape (``lower(...).compile().as_text()``) and XLA's cost analysis.

Writes ``<label>.json`` (every figure), ``<label>.txt`` (the summary as text) and ``<label>.tar.gz`` (the trace
files and the HLO) under ``--out``. Candidates of the decode step are flags: ``--scan-layers``
(``EngineConfig.scan_layers``), the ``pallas-gpu`` kernel's ``--k-splits`` / ``--pages-per-block`` /
``--num-warps`` / ``--num-stages`` or the best point of a ``bench/decode_attention.py --sweep`` JSON
(``--from-sweep``), and XLA command buffers through ``XLA_FLAGS`` (recorded). ``--summarize PATH`` only
summarises a trace already written (a ``*.trace.json.gz``, a folder holding one, or this script's tar.gz);
``--compare PATH...`` prints one table of the decode steps of result JSONs (the candidates side by side).

    python bench/profile_decode.py --model qwen3-1.7b --batches 1 64 256 --trace-batches 1 256 --out $OUT/profile
    python bench/profile_decode.py --model micro --batches 1 4 --steps 5 --out /tmp/profile      # CPU, seconds
    python bench/profile_decode.py --summarize /tmp/profile/baseline.tar.gz
    python bench/profile_decode.py --compare /tmp/profile
"""
from __future__ import annotations

import gzip
import io
import json
import math
import os
import shutil
import statistics
import sys
import tarfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable

import numpy as np

if __package__ in (None, ""):   # run as a script (python bench/NAME.py): make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxopd import cli  # noqa: E402

MARKER = "decode_step#"            # the host annotation around each profiled decode call
MODULE = "decode_step"             # the jitted step's HLO module name contains this ("jit_decode_step")
# Lines of a device in an xprof trace that are derived from the kernels (or from the host), not kernels themselves
DERIVED_LINES = ("XLA Modules", "XLA Ops", "XLA TraceMe", "Steps", "Framework", "TensorFlow", "Source code",
                 "Launch Stats", "Name Scope", "SparseCore")
TRACE_MB_LIMIT = 14                # the tar.gz stays under this (the device tool brings back files up to 16 MiB)


def micro_config():
    """A micro Qwen3 (2 layers, vocabulary 512) for the CPU: the whole script runs in seconds."""
    from jaxopd.models.decoder import ModelConfig

    return ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                       intermediate_size=128, vocab_size=512, max_position_embeddings=4096)


# ----------------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------------
def parse_args(argv=None):
    p = cli.Parser(prog="python bench/profile_decode.py", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-1.7b", help="a jaxopd architecture preset (random weights), or 'micro'")
    p.add_argument("--dtype", default=None, help="model dtype (default: float32 on CPU, bfloat16 on GPU/TPU)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 256])
    p.add_argument("--trace-batches", type=int, nargs="*", default=None,
                   help="batches to trace (default: all of --batches; none: timing only)")
    p.add_argument("--no-trace", action="store_true", help="timing only (the same as --trace-batches with none)")
    p.add_argument("--driver", default="engine", choices=("engine", "executor"))
    p.add_argument("--prompt-len", type=int, default=176,
                   help="engine driver: prompt tokens (prompt + generated tokens stay within 256 = 16 pages, one "
                        "decode shape per batch)")
    p.add_argument("--context", type=int, default=200, help="executor driver: tokens cached per row at the start")
    p.add_argument("--warm-steps", type=int, default=4, help="full-batch decode steps before timing (compilation)")
    p.add_argument("--timed-steps", type=int, default=24, help="full-batch decode steps timed without the profiler")
    p.add_argument("--steps", type=int, default=20, help="full-batch decode steps under the profiler")
    p.add_argument("--backend", default="auto", help="attention backend (default: the platform's)")
    p.add_argument("--scan-layers", action="store_true", help="EngineConfig.scan_layers: the layers as one lax.scan")
    p.add_argument("--k-splits", type=int, default=None, help="pallas-gpu decode k-splits (0: automatic)")
    p.add_argument("--pages-per-block", type=int, default=None, help="pallas-gpu pages per compute block")
    p.add_argument("--num-warps", type=int, default=None, help="pallas-gpu Triton warps")
    p.add_argument("--num-stages", type=int, default=None, help="pallas-gpu Triton pipeline stages")
    p.add_argument("--from-sweep", default=None, metavar="JSON",
                   help="the pallas-gpu options of the best point of a bench/decode_attention.py --sweep result "
                        "(lowest geometric mean of time over roofline across its batches)")
    p.add_argument("--no-hlo", action="store_true", help="skip the optimised HLO dump")
    p.add_argument("--python-tracer", action="store_true", help="also trace Python calls (slows the host down)")
    p.add_argument("--bandwidth", type=float, default=4.8e12, help="memory bandwidth in bytes/s for the roofline")
    p.add_argument("--top", type=int, default=15, help="kernels listed in the summary")
    p.add_argument("--label", default=None, help="names the outputs (default: baseline, or the candidate's flags)")
    p.add_argument("--out", default="results/bench/profile", help="output folder")
    p.add_argument("--keep-raw", action="store_true", help="keep the uncompressed trace folders beside the tar.gz")
    p.add_argument("--summarize", default=None, metavar="PATH",
                   help="only summarise a trace already written (trace.json.gz, a folder, or a tar.gz) and exit")
    p.add_argument("--compare", nargs="+", default=None, metavar="PATH",
                   help="only print one table of the decode steps in these result JSONs (or folders of them) and exit")
    return p.parse_args(argv)


def check_args(args) -> None:
    """The input checks, before anything is built (``jaxopd.cli.UsageError``)."""
    for path in ([args.summarize] if args.summarize else []) + (args.compare or []):
        if not Path(path).exists():
            raise cli.UsageError(f"{'--summarize' if path == args.summarize else '--compare'} {path!r}: no such file "
                                 "or folder")
    if args.summarize or args.compare:
        return
    if args.model != "micro":
        try:
            cli.check_model_preset("--model", args.model)
        except cli.UsageError as error:
            raise cli.UsageError(f"{error}, or 'micro'") from None
    for name in ("warm_steps", "timed_steps", "steps", "prompt_len", "context"):
        if getattr(args, name) < 1:
            raise cli.UsageError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.warm_steps < 3:
        raise cli.UsageError("--warm-steps must be at least 3 (the first steps compile)")
    if min(args.batches) < 1:
        raise cli.UsageError(f"--batches must be positive, got {args.batches}")
    extra = sorted(set(args.trace_batches or ()) - set(args.batches))
    if extra:
        raise cli.UsageError(f"--trace-batches {extra} are not among --batches {args.batches}")
    from jaxopd_kernels import registry as kernels
    choices = [kernels.AUTO, *kernels.available_backends()]
    if args.backend not in choices:
        raise cli.UsageError(f"--backend {args.backend!r} is not an attention backend; choose one of {choices}")
    if args.from_sweep and not Path(args.from_sweep).is_file():
        raise cli.UsageError(f"--from-sweep {args.from_sweep!r}: no such file")
    if kernel_options(args) and kernels.resolve_backend_name(args.backend) != "pallas-gpu":
        raise cli.UsageError("--k-splits / --pages-per-block / --num-warps / --num-stages / --from-sweep set options "
                             "of the pallas-gpu backend: give --backend pallas-gpu")
    cli.check_out_dir("--out", args.out)


def kernel_options(args) -> dict[str, int]:
    """The pallas-gpu options given on the command line (--from-sweep first, explicit flags over it)."""
    options = dict(best_sweep_point(args.from_sweep)) if getattr(args, "from_sweep", None) else {}
    for name in ("k_splits", "pages_per_block", "num_warps", "num_stages"):
        if getattr(args, name, None) is not None:
            options[name] = getattr(args, name)
    return options


def best_sweep_point(path: str | os.PathLike) -> dict[str, int]:
    """The ``params`` of the sweep row set with the lowest geometric mean of ``ratio_to_roofline`` over the batches
    of ``bench/decode_attention.py --sweep``'s JSON (only the parameter sets timed at the most batches compete: all
    of them, unless the sweep was cut short)."""
    rows = json.loads(Path(path).read_text())["rows"]
    by_params: dict[str, list[float]] = defaultdict(list)
    for r in rows:
        if r.get("params") is not None:
            by_params[json.dumps(r["params"], sort_keys=True)].append(float(r["ratio_to_roofline"]))
    if not by_params:
        raise cli.UsageError(f"--from-sweep {str(path)!r} holds no pallas-gpu row with params")
    most = max(len(ratios) for ratios in by_params.values())    # a sweep cut short: the sets timed at most batches
    scored = {key: math.exp(statistics.fmean(math.log(x) for x in ratios))
              for key, ratios in by_params.items() if len(ratios) == most}
    return json.loads(min(scored, key=scored.get))


def default_label(args) -> str:
    parts = []
    if args.scan_layers:
        parts.append("scan")
    options = kernel_options(args)
    if options:
        short = {"k_splits": "k", "pages_per_block": "p", "num_warps": "w", "num_stages": "s"}
        parts.append("kernel-" + "-".join(f"{short[k]}{options[k]}" for k in short if k in options))
    if args.driver == "executor":
        parts.append("exec")
    return "_".join(parts) or "baseline"


# ----------------------------------------------------------------------------------------------------------
# Trace parsing: Chrome trace-events JSON (what jax.profiler writes beside its .xplane.pb); no jax needed
# ----------------------------------------------------------------------------------------------------------
def find_trace_file(path: str | os.PathLike) -> Path:
    """The trace-events file of ``path``: the file itself, or in a folder ``*.trace.json.gz`` (the host's, first)
    else ``perfetto_trace.json.gz``, searched recursively."""
    path = Path(path)
    if path.is_file():
        return path
    for pattern in ("*.trace.json.gz", "*.trace.json", "perfetto_trace.json.gz"):
        found = sorted(path.rglob(pattern))
        if found:
            return found[0]
    raise FileNotFoundError(f"no *.trace.json.gz or perfetto_trace.json.gz under {path}")


def load_trace_events(path: str | os.PathLike, member: str | None = None) -> list[dict]:
    """The events of a trace: a ``.json``/``.json.gz`` file, a folder holding one, or a tar.gz of this script (its
    first trace, or the one whose path contains ``member``)."""
    path = Path(path)
    if path.is_file() and path.name.endswith((".tar.gz", ".tgz")):
        with tarfile.open(path) as tar:
            names = sorted(n for n in tar.getnames() if n.endswith((".trace.json.gz", "perfetto_trace.json.gz"))
                           and (member is None or member in n))
            names.sort(key=lambda n: n.endswith("perfetto_trace.json.gz"))     # the host's trace first
            if not names:
                raise FileNotFoundError(f"no trace in {path}" + (f" matching {member!r}" if member else ""))
            raw = tar.extractfile(names[0]).read()
        return _events(json.loads(gzip.decompress(raw)))
    file = find_trace_file(path)
    opener = gzip.open if file.name.endswith(".gz") else open
    with opener(file, "rt") as f:
        return _events(json.load(f))


def _events(data: Any) -> list[dict]:
    return data.get("traceEvents", []) if isinstance(data, dict) else list(data)


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -math.inf
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def _gaps(intervals: list[tuple[float, float]]) -> list[tuple[float, float, int]]:
    """Idle stretches between the (sorted) intervals' union: (start, end, index of the interval after the gap)."""
    out, end = [], None
    for i, (start, stop) in enumerate(sorted(intervals)):
        if end is not None and start > end:
            out.append((end, start, i))
        end = stop if end is None else max(end, stop)
    return out


def _median(values: Iterable[float]) -> float | None:
    values = list(values)
    return float(statistics.median(values)) if values else None


def summarize_trace(events: list[dict], *, module: str = MODULE, marker: str = MARKER, top: int = 15) -> dict:
    """Where the profiled decode steps' time went, from trace events (Chrome trace format: ``ph`` 'X' events with
    ``ts``/``dur`` in µs, ``pid``/``tid``, ``name``, ``args``; 'M' events name processes and threads).

    Kernels are the events of a device's stream lines (GPU: threads named ``Stream …`` of a ``/device:GPU``
    process), else of its other non-derived lines (TPU); on a CPU, where XLA runs its ops on host threads, the
    events that carry ``args.hlo_op``. Where kernels name their HLO module, only ``module``'s count. Steps are the
    host annotations whose name starts with ``marker``; kernels before the first one are left out (a step still
    running when the trace started). Gaps are the time between kernels on the device's union timeline; a gap during
    which the host began dispatching a step (a ``marker`` annotation starts inside it) counts as waiting for the
    host, the others as gaps within the device's work (launch latency, dependencies)."""
    processes, threads = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            processes[e.get("pid")] = str(e.get("args", {}).get("name", ""))
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e.get("pid"), e.get("tid"))] = str(e.get("args", {}).get("name", ""))
    complete = [e for e in events if e.get("ph") == "X" and "ts" in e]
    markers = sorted((e for e in complete if str(e.get("name", "")).startswith(marker)), key=lambda e: e["ts"])
    device_pids = {pid for pid, name in processes.items() if "/device:" in name and "CPU" not in name.upper()}

    def line(e):
        return threads.get((e.get("pid"), e.get("tid")), "")

    if device_pids:
        on_device = [e for e in complete if e.get("pid") in device_pids]
        streams = [e for e in on_device if line(e).startswith("Stream")]
        kernels = streams or [e for e in on_device if not any(d in line(e) for d in DERIVED_LINES)]
        source = "device"
    else:
        kernels = [e for e in complete if "hlo_op" in (e.get("args") or {})]
        source = "host threads (CPU: XLA ops)"
    if any("hlo_module" in (e.get("args") or {}) for e in kernels):
        kernels = [e for e in kernels if module in str((e.get("args") or {}).get("hlo_module", ""))]
    if markers:
        kernels = [e for e in kernels if e["ts"] >= markers[0]["ts"]]
    steps = len(markers)
    per_step = 1.0 / max(steps, 1)
    copies = [e for e in kernels if "memcpy" in str(e.get("name", "")).lower()
              or "memset" in str(e.get("name", "")).lower()]
    intervals = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))) for e in kernels]
    busy = _union_length(intervals)
    span = (max(b for _, b in intervals) - min(a for a, _ in intervals)) if intervals else 0.0
    gaps = _gaps(intervals)
    ordered = sorted(kernels, key=lambda e: (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))))
    largest = sorted(gaps, key=lambda g: g[0] - g[1])[:5]
    starts = np.asarray(sorted(float(m["ts"]) for m in markers))
    waiting = sum(b - a for a, b, _ in gaps
                  if len(starts) and np.searchsorted(starts, a, side="right") < np.searchsorted(starts, b, side="left"))

    by_name: dict[str, list[float]] = defaultdict(list)
    for e in kernels:
        by_name[str(e.get("name", ""))].append(float(e.get("dur", 0.0)))
    total_kernel = sum(sum(v) for v in by_name.values()) or 1.0
    top_kernels = [{"name": name, "calls_per_step": len(d) * per_step, "us_per_step": sum(d) * per_step,
                    "mean_us": sum(d) / len(d), "share": sum(d) / total_kernel,
                    "hlo_op": next((str((e.get("args") or {}).get("hlo_op")) for e in kernels
                                    if str(e.get("name", "")) == name and "hlo_op" in (e.get("args") or {})), None)}
                   for name, d in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]]

    modules = [e for e in complete if e.get("pid") in device_pids and line(e) == "XLA Modules"
               and module in str(e.get("name", ""))]
    launch_names = ("LaunchKernel", "cuLaunch", "cudaLaunch", "GraphLaunch")
    host_thread = (markers[0].get("pid"), markers[0].get("tid")) if markers else None
    launches = [e for e in complete if e.get("pid") not in device_pids and (not len(starts) or e["ts"] >= starts[0])
                and any(n in str(e.get("name", "")) for n in launch_names)]
    graph_launches = [e for e in launches if "Graph" in str(e.get("name", ""))]
    groups = _step_groups(ordered, steps)
    durations = [float(m.get("dur", 0.0)) for m in markers]
    periods = list(np.diff(starts)) if len(starts) > 1 else []
    return {
        "source": source,
        "steps": steps,
        "kernels": len(kernels),
        "kernels_per_step": len(kernels) * per_step,
        "distinct_kernels": len(by_name),
        "device_busy_ms_per_step": busy * per_step / 1e3,
        "device_span_ms_per_step": span * per_step / 1e3,
        "gap_ms_per_step": (span - busy) * per_step / 1e3,
        "gap_waiting_host_ms_per_step": waiting * per_step / 1e3,
        "gap_within_device_ms_per_step": (span - busy - waiting) * per_step / 1e3,
        "idle_share": (span - busy) / span if span else None,
        "gaps_over_5us_per_step": sum(1 for a, b, _ in gaps if b - a > 5.0) * per_step,
        "largest_gaps": [{"us": b - a, "after": str(ordered[i - 1].get("name", "")) if i else None,
                          "before": str(ordered[i].get("name", ""))} for a, b, i in largest],
        "copies_per_step": len(copies) * per_step,
        "copy_us_per_step": sum(float(e.get("dur", 0.0)) for e in copies) * per_step,
        "top_kernels": top_kernels,
        "per_step": _per_step_medians(groups),
        "module_runs": len(modules),
        "module_ms_median": _median(float(e.get("dur", 0.0)) / 1e3 for e in modules),
        "host_dispatch_ms_median": _median(d / 1e3 for d in durations),
        "host_step_period_ms_median": _median(p / 1e3 for p in periods),
        "host_thread": threads.get(host_thread) if host_thread else None,
        "launches_per_step": len(launches) * per_step,
        "graph_launches_per_step": len(graph_launches) * per_step,
        "processes": sorted(set(processes.values())),
    }


def _step_groups(ordered: list[dict], steps: int) -> list[list[dict]]:
    """The kernels of each step, in time order: grouped by ``args.run_id`` where every kernel has one (the CPU
    runtime's executions), else in ``steps`` equal runs of the time-ordered kernels when they divide evenly (every
    step launches the same kernels); else none."""
    if not ordered:
        return []
    run_ids = [(e.get("args") or {}).get("run_id") for e in ordered]
    if None not in run_ids and len(set(run_ids)) > 1:
        groups: dict[Any, list[dict]] = {}
        for e, run in zip(ordered, run_ids):
            groups.setdefault(run, []).append(e)
        return list(groups.values())
    if steps > 1 and len(ordered) % steps == 0:
        n = len(ordered) // steps
        return [ordered[i:i + n] for i in range(0, len(ordered), n)]
    return []


def _per_step_medians(groups: list[list[dict]]) -> dict | None:
    """Medians over the steps (robust to one slow step): kernels, device busy time, the span from the first kernel's
    start to the last one's end, the gaps inside it, the gap before the step's first kernel (after the previous
    step's last), and the device period (first kernel to the next step's first kernel)."""
    if len(groups) < 2:
        return None
    rows = []
    for i, group in enumerate(groups):
        intervals = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))) for e in group]
        first, last = min(a for a, _ in intervals), max(b for _, b in intervals)
        busy = _union_length(intervals)
        before = None
        if i:
            before = first - max(float(e["ts"]) + float(e.get("dur", 0.0)) for e in groups[i - 1])
        period = None
        if i + 1 < len(groups):
            period = min(float(e["ts"]) for e in groups[i + 1]) - first
        rows.append((len(group), busy, last - first, last - first - busy, before, period))

    def med(j):
        values = [r[j] for r in rows if r[j] is not None]
        return float(statistics.median(values)) if values else None

    return {"steps": len(groups), "kernels": med(0), "busy_ms": med(1) / 1e3, "span_ms": med(2) / 1e3,
            "gaps_within_ms": med(3) / 1e3, "gap_before_ms": med(4) / 1e3 if med(4) is not None else None,
            "device_period_ms": med(5) / 1e3 if med(5) is not None else None}


def format_summary(s: dict, title: str = "") -> str:
    """The summary of ``summarize_trace`` as a few lines of text."""
    def ms(x):
        return "n/a" if x is None else f"{x:.4g} ms"

    lines = [title] if title else []
    lines.append(f"trace: {s['steps']} steps; kernels from {s['source']}: {s['kernels_per_step']:.1f} per step "
                 f"({s['distinct_kernels']} distinct)")
    if s["kernels"]:
        idle = "" if s["idle_share"] is None else f" ({100 * s['idle_share']:.0f} % of the span)"
        lines.append(f"device per step: busy {ms(s['device_busy_ms_per_step'])}, "
                     f"span {ms(s['device_span_ms_per_step'])}, "
                     f"gaps {ms(s['gap_ms_per_step'])}{idle}: waiting for the host "
                     f"{ms(s['gap_waiting_host_ms_per_step'])}, within the device's work "
                     f"{ms(s['gap_within_device_ms_per_step'])}; gaps > 5 µs: {s['gaps_over_5us_per_step']:.1f}")
        per = s.get("per_step")
        if per:
            lines.append(f"median step ({per['steps']} on the device): {per['kernels']:.0f} kernels, busy "
                         f"{ms(per['busy_ms'])}, first to last kernel {ms(per['span_ms'])} (gaps inside "
                         f"{ms(per['gaps_within_ms'])}), idle before its first kernel {ms(per['gap_before_ms'])}, "
                         f"device period {ms(per['device_period_ms'])}")
        lines.append(f"copies per step: {s['copies_per_step']:.1f} ({s['copy_us_per_step']:.1f} µs)")
    else:
        lines.append("no kernel events (a GPU trace without device lines: CUPTI tracing unavailable?)")
    lines.append(f"host: dispatch {ms(s['host_dispatch_ms_median'])} (median call into the jitted step), step period "
                 f"{ms(s['host_step_period_ms_median'])}; kernel launches per step {s['launches_per_step']:.1f}, "
                 f"graph launches {s['graph_launches_per_step']:.1f}")
    if s["module_runs"]:
        lines.append(f"module runs: {s['module_runs']}, median {ms(s['module_ms_median'])}")
    if s["top_kernels"]:
        lines.append(f"top {len(s['top_kernels'])} kernels by time (per step):")
        for k in s["top_kernels"]:
            name = k["name"] if len(k["name"]) <= 70 else k["name"][:67] + "..."
            op = f"  [{k['hlo_op']}]" if k["hlo_op"] and k["hlo_op"] != k["name"] else ""
            lines.append(f"  {k['us_per_step']:9.1f} µs {100 * k['share']:5.1f} %  x{k['calls_per_step']:<6.1f} "
                         f"{name}{op}")
    if s["largest_gaps"]:
        lines.append("largest gaps: " + "; ".join(f"{g['us']:.0f} µs before {g['before'][:40]}"
                                                  for g in s["largest_gaps"]))
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------
# The decode-step probe: wraps the executor module's jitted decode_step (as bench.engine_overhead.StepClock does)
# ----------------------------------------------------------------------------------------------------------
class DecodeProbe:
    """Counts the decode calls of ``rows`` padded rows; times calls ``warm .. warm+timed-1``; traces the next
    ``steps`` (each in a ``decode_step#k`` annotation) into ``trace_dir`` when given; keeps the arguments of call
    ``warm - 1`` (a steady one) for the HLO: lowering the very arrays the call took (the donated cache deleted since,
    which lowering does not read) finds the run's compilation in jit's cache, where shape structs would not (they
    differ in committedness) and would compile the step again."""

    def __init__(self, executor_module, rows: int, *, warm: int, timed: int, steps: int, trace_dir: Path | None,
                 python_tracer: bool = False):
        self.module, self.rows = executor_module, rows
        self.original = executor_module.decode_step
        self.warm, self.timed, self.steps, self.trace_dir = warm, timed, steps, trace_dir
        self.python_tracer = python_tracer
        self.calls = 0
        self.records: list[tuple[float, float]] = []      # (dispatch start, dispatch end) of the timed calls
        self.call_args = None
        self.tracing = False
        self.traced = 0
        self.last = None                                  # the sampled outputs of the last untraced call
        self.done = threading.Event()                     # set once the timed (and traced) steps are over

    def __enter__(self):
        original = self.original

        def probed(*args):
            import jax

            if np.shape(args[5])[0] != self.rows:          # args[5]: the tokens [R]
                return original(*args)
            k = self.calls
            self.calls += 1
            if k == self.warm - 1:                       # a steady call: the previous step's tokens on the device
                self.call_args = args[2:]
            if self.trace_dir is not None and k == self.warm + self.timed:
                jax.block_until_ready(self.last)      # no kernel of an earlier step runs into the trace
                self._start()
            if self.tracing:
                with jax.profiler.TraceAnnotation(f"{MARKER}{k}"):
                    out = original(*args)
                self.traced += 1
                if self.traced == self.steps:
                    jax.block_until_ready(out[1:])
                    self._stop()
                    self.done.set()
                return out
            start = time.perf_counter()
            out = original(*args)
            if self.warm <= k < self.warm + self.timed:
                self.records.append((start, time.perf_counter()))
            if self.trace_dir is None and k == self.warm + self.timed - 1:
                self.done.set()
            self.last = out[1:]
            return out

        probed._cache_size = original._cache_size
        probed.lower = original.lower
        self.module.decode_step = probed
        return self

    def __exit__(self, *exc):
        self.module.decode_step = self.original
        if self.tracing:
            self._stop()

    def _start(self):
        import jax

        options = jax.profiler.ProfileOptions()
        options.python_tracer_level = 1 if self.python_tracer else 0
        jax.profiler.start_trace(str(self.trace_dir), profiler_options=options)
        self.tracing = True

    def _stop(self):
        import jax

        self.tracing = False
        jax.profiler.stop_trace()


# ----------------------------------------------------------------------------------------------------------
# The runs
# ----------------------------------------------------------------------------------------------------------
def build_model(args):
    import jax
    from flax import nnx

    from jaxopd.models.decoder import CausalLM, ModelConfig

    dtype = args.dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    cfg = micro_config().with_dtypes(dtype) if args.model == "micro" else ModelConfig.preset(args.model, dtype=dtype)
    return CausalLM(cfg, rngs=nnx.Rngs(0))


def attention_backend(args) -> tuple[str, dict]:
    """The backend name for ``EngineConfig`` and its kernel options; a pallas-gpu with options is registered as
    ``pallas-gpu-tuned``."""
    from jaxopd_kernels import registry as kernels
    options = kernel_options(args)
    if not options:
        return kernels.resolve_backend_name(args.backend), {}
    fields = {**options, "k_splits": options.get("k_splits") or None}
    kernels.register_backend(kernels.PallasGpuBackend(**fields), "pallas-gpu-tuned")
    return "pallas-gpu-tuned", options


def roofline_seconds(cfg, weight_bytes: int, batch: int, context: float, bandwidth: float) -> float:
    """Bytes one decode step must read (every weight once, K and V of each row's context) over the bandwidth."""
    kv = batch * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * context * np.dtype(cfg.dtype).itemsize
    return (weight_bytes + kv) / bandwidth


def decode_hlo(executor_module, static_args, call_args) -> tuple[str, dict, float]:
    """The optimised HLO text of the decode step called with ``call_args``, XLA's cost analysis, and the seconds it
    took (the run's compilation, from jit's cache)."""
    start = time.perf_counter()
    compiled = executor_module.decode_step.lower(*static_args, *call_args).compile()
    text = compiled.as_text()
    try:
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        cost = {k: float(v) for k, v in (cost or {}).items()
                if k in ("flops", "bytes accessed", "transcendentals", "optimal_seconds")}
    except Exception as error:   # noqa: BLE001 - the analysis is optional
        cost = {"error": str(error)}
    return text, cost, time.perf_counter() - start


def hlo_counts(text: str) -> dict:
    """Rough counts over the optimised HLO: instructions of the entry computation and of all computations,
    fusions, custom calls (Pallas/Triton kernels, cuBLAS), while loops."""
    entry, in_entry = 0, False
    for line in text.splitlines():
        if line.startswith("ENTRY "):
            in_entry = True
            continue
        if in_entry:
            if line.startswith("}"):
                in_entry = False
            elif "=" in line:
                entry += 1
    return {"entry_instructions": entry, "fusions": text.count(" fusion("), "custom_calls": text.count("custom-call("),
            "while_loops": text.count(" while("), "lines": text.count("\n")}


def run_engine_driver(args, model, backend: str, raw: Path, rows_out: list, write):
    """Per batch: ``batch`` random prompts through ``Engine.generate`` with the probe on the full-batch decode
    steps."""
    from jaxopd.sampler import Engine, EngineConfig, Request, SamplingParams
    from jaxopd.sampler import executor as executor_module
    from jaxopd.sampler.buckets import bucket

    cfg = model.config
    max_batch = max(args.batches)
    needed = args.warm_steps + args.timed_steps + args.steps
    stagger = math.ceil(max_batch / 16) + 4           # rows prefilled later lag the first ones by a step per chunk
    seq = args.prompt_len + needed + stagger
    config = EngineConfig(max_slots=max_batch, page_size=16, num_pages=max_batch * (seq // 16 + 2) + 1,
                          max_seq_len=seq, prefill_chunk=min(512, 1 << (args.prompt_len - 1).bit_length()),
                          max_prefill_tokens=4096, eos_token_ids=(), attention_backend=backend, scoring=False,
                          prefix_sharing=False, scan_layers=args.scan_layers)
    rng = np.random.default_rng(0)
    with Engine(model, config) as engine:
        for batch in args.batches:
            rows = bucket(batch, engine.buckets.decode_rows)
            new_tokens = needed + math.ceil(batch / engine.buckets.prefill_rows[-1]) + 4
            prompts = rng.integers(0, cfg.vocab_size, size=(batch, args.prompt_len)).tolist()
            requests = [Request(p, SamplingParams(max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                                  temperature=1.0, seed=i)) for i, p in enumerate(prompts)]
            trace_dir = raw / f"trace_b{batch}" if batch in traced_batches(args) else None
            start = time.perf_counter()
            with DecodeProbe(executor_module, rows, warm=args.warm_steps, timed=args.timed_steps, steps=args.steps,
                             trace_dir=trace_dir, python_tracer=args.python_tracer) as probe:
                futures = [engine.submit(r) for r in requests]
                while not probe.done.wait(0.05) and not all(f.done() for f in futures):
                    pass
                for future in futures:      # the rest of the run (rows finishing one by one) would compile the
                    future.cancel()         # smaller decode buckets for nothing
                engine.wait_idle()
            wall = time.perf_counter() - start
            # mean context of the timed steps: the last prompts admitted start decoding one step per prefill chunk late
            context = (args.prompt_len + args.warm_steps + args.timed_steps / 2
                       + math.ceil(batch / engine.buckets.prefill_rows[-1]) / 2)
            row = timing_row(args, model, batch, rows, probe.records, context, device_bound=False)
            row.update(run_s=wall, full_batch_decode_calls=probe.calls, traced_steps=probe.traced)
            finish_row(args, row, probe.call_args, (engine.executor._static, engine.executor.backend), trace_dir,
                       raw, batch)
            rows_out.append(row)
            write()
            pack(raw, Path(args.out) / f"{label_of(args)}.tar.gz")


def run_executor_driver(args, model, backend: str, raw: Path, rows_out: list, write):
    """Per batch: the executor alone, ``--context`` tokens already cached per row (synthetic pages), decode steps
    fed their own tokens on the device, dispatched back to back (the device is kept busy)."""
    import jax
    import jax.numpy as jnp

    from jaxopd.sampler import Engine, EngineConfig
    from jaxopd.sampler import executor as executor_module
    from jaxopd.sampler.executor import DecodeBatch
    from jaxopd.sampler.sampling import SamplingArrays

    max_batch = max(args.batches)
    total = args.warm_steps + args.timed_steps + args.steps
    seq = args.context + total + 1
    pages_per_row = math.ceil(seq / 16)
    config = EngineConfig(max_slots=max_batch, page_size=16, num_pages=max_batch * pages_per_row + 1,
                          max_seq_len=16 * pages_per_row, prefill_chunk=16, max_prefill_tokens=64,
                          eos_token_ids=(), attention_backend=backend, scoring=False, mixed_steps=False,
                          scan_layers=args.scan_layers)
    engine = Engine(model, config)          # never started: its executor and buckets only
    executor = engine.executor
    for batch in args.batches:
        rows, pages = engine.buckets.decode_shape(batch, pages_per_row)
        table = np.zeros((rows, pages), np.int32)
        for r in range(batch):
            table[r, :pages_per_row] = 1 + r * pages_per_row + np.arange(pages_per_row)
        active = np.arange(rows) < batch
        sampling = SamplingArrays(np.ones(rows, np.float32), np.ones(rows, np.float32), np.zeros(rows, np.int32),
                                  np.arange(rows, dtype=np.uint32))
        tokens = jnp.zeros(rows, jnp.int32)
        trace_dir = raw / f"trace_b{batch}" if batch in traced_batches(args) else None
        probe = DecodeProbe(executor_module, rows, warm=args.warm_steps, timed=args.timed_steps, steps=args.steps,
                            trace_dir=trace_dir, python_tracer=args.python_tracer)
        started = time.perf_counter()
        timed_wall = None
        with probe:
            for k in range(total):
                if k == args.warm_steps:
                    jax.block_until_ready(tokens)
                    t0 = time.perf_counter()
                positions = np.where(active, args.context + k, 0).astype(np.int32)
                tokens, _ = executor.decode(DecodeBatch(tokens, positions, table, active, sampling))
                if k == args.warm_steps + args.timed_steps - 1:
                    jax.block_until_ready(tokens)
                    timed_wall = time.perf_counter() - t0
            jax.block_until_ready(tokens)
        context = args.context + args.warm_steps + args.timed_steps / 2
        row = timing_row(args, model, batch, rows, probe.records, context, device_bound=True,
                         wall_per_step=timed_wall / args.timed_steps)
        row.update(run_s=time.perf_counter() - started, full_batch_decode_calls=probe.calls, traced_steps=probe.traced,
                   page_window=pages)
        finish_row(args, row, probe.call_args, (executor._static, executor.backend), trace_dir, raw, batch)
        rows_out.append(row)
        write()
        pack(raw, Path(args.out) / f"{label_of(args)}.tar.gz")


def label_of(args) -> str:
    return args.label or default_label(args)


def traced_batches(args) -> set[int]:
    if args.no_trace:
        return set()
    return set(args.batches if args.trace_batches is None else args.trace_batches)


def timing_row(args, model, batch, rows, records, context, *, device_bound: bool, wall_per_step=None) -> dict:
    import jax
    from flax import nnx

    weight_bytes = int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(model))))
    starts = np.asarray([r[0] for r in records])
    dispatch = [b - a for a, b in records]
    period = float(np.median(np.diff(starts))) if len(starts) > 2 else float("nan")
    step = wall_per_step if device_bound else period
    roof = roofline_seconds(model.config, weight_bytes, batch, context, args.bandwidth)
    return {"batch": batch, "rows": rows, "driver": args.driver, "decode_step_ms": 1e3 * step,
            "step_period_ms": 1e3 * period, "dispatch_ms": 1e3 * float(np.median(dispatch)) if dispatch else None,
            "timed_steps": len(records), "mean_context": context, "roofline_ms": 1e3 * roof,
            "step_over_roofline": step / roof, "weight_bytes": weight_bytes}


def finish_row(args, row, call_args, static_args, trace_dir, raw: Path, batch: int) -> None:
    """The trace summary and the HLO of one batch into ``row``."""
    from jaxopd.sampler import executor as executor_module

    if trace_dir is not None and trace_dir.exists():
        try:
            summary = summarize_trace(load_trace_events(trace_dir), top=args.top)
        except (FileNotFoundError, ValueError) as error:
            summary = {"error": str(error)}
        row["trace"] = summary
    if not args.no_hlo and call_args is not None:
        text, cost, seconds = decode_hlo(executor_module, static_args, call_args)
        (raw / "hlo").mkdir(parents=True, exist_ok=True)
        (raw / "hlo" / f"decode_step_b{batch}.txt").write_text(text)
        row["hlo"] = {**hlo_counts(text), "cost_analysis": cost, "seconds": seconds}


def format_row(row: dict) -> str:
    dispatch = "n/a" if row["dispatch_ms"] is None else f"{row['dispatch_ms']:.4g} ms"
    lines = [f"== batch {row['batch']} ({row['rows']} rows, {row['driver']} driver): decode step "
             f"{row['decode_step_ms']:.4g} ms, roofline {row['roofline_ms']:.4g} ms = "
             f"{row['step_over_roofline']:.2f}x; step period {row['step_period_ms']:.4g} ms, dispatch {dispatch}"]
    if "hlo" in row:
        h = row["hlo"]
        cost = h.get("cost_analysis", {})
        lines.append(f"hlo: {h['entry_instructions']} entry instructions, {h['fusions']} fusions, {h['custom_calls']} "
                     f"custom calls, {h['while_loops']} while loops; XLA cost: "
                     f"{cost.get('bytes accessed', float('nan')) / 1e6:.1f} MB accessed, "
                     f"{cost.get('flops', float('nan')) / 1e9:.2f} GFLOP")
    if "trace" in row:
        trace = row["trace"]
        lines.append(trace["error"] if "error" in trace else format_summary(trace))
    return "\n".join(lines)


def compare_table(paths: Iterable[str | os.PathLike]) -> str:
    """One markdown table of the decode steps of this script's result JSONs (files, or folders holding them):
    per label and batch, the step, the roofline and their ratio, the dispatch time, the driver and XLA_FLAGS."""
    files: list[Path] = []
    for path in map(Path, paths):
        files += sorted(path.glob("*.json")) if path.is_dir() else [path]
    lines = ["| label | batch | decode step ms | roofline ms | x roofline | dispatch ms | kernels/step | driver | "
             "XLA_FLAGS |", "|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for file in files:
        try:
            result = json.loads(file.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(result, dict) or "rows" not in result or "label" not in result:
            continue
        for r in result["rows"]:
            kernels = (r.get("trace") or {}).get("kernels_per_step")
            dispatch = r.get("dispatch_ms")
            lines.append(f"| {result['label']} | {r['batch']} | {r['decode_step_ms']:.3f} | {r['roofline_ms']:.3f} | "
                         f"{r['step_over_roofline']:.2f} | {'' if dispatch is None else f'{dispatch:.3f}'} | "
                         f"{'' if kernels is None else f'{kernels:.0f}'} | {r['driver']} | "
                         f"{result.get('xla_flags') or ''} |")
    return "\n".join(lines)


def pack(raw: Path, tar_path: Path, limit_mb: float = TRACE_MB_LIMIT) -> list[str]:
    """``raw`` into ``tar_path`` (gzip); files that would take it over ``limit_mb`` (the ``.xplane.pb`` first, then
    the perfetto copy) are left out; returns what was left out."""
    files = sorted(p for p in raw.rglob("*") if p.is_file())
    optional = sorted((p for p in files if p.name.endswith((".xplane.pb", "perfetto_trace.json.gz"))),
                      key=lambda p: (p.name.endswith("perfetto_trace.json.gz"), -p.stat().st_size))
    left_out: list[str] = []
    while True:
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
            for p in files:
                if str(p.relative_to(raw)) not in left_out:
                    tar.add(p, arcname=str(p.relative_to(raw)))
        if buffer.tell() <= limit_mb * 2 ** 20 or not optional:
            break
        left_out.append(str(optional.pop(0).relative_to(raw)))
    tar_path.write_bytes(buffer.getvalue())
    return left_out


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    check_args(args)
    if args.summarize:
        print(format_summary(summarize_trace(load_trace_events(args.summarize), top=args.top), title=args.summarize))
        return 0
    if args.compare:
        print(compare_table(args.compare))
        return 0
    import jax

    from jaxopd.machine import machine_info

    label = label_of(args)
    out = Path(args.out)
    raw = out / f".raw_{label}"
    shutil.rmtree(raw, ignore_errors=True)
    raw.mkdir(parents=True)
    backend, options = attention_backend(args)
    model = build_model(args)
    rows: list[dict] = []
    result = {"label": label, "command": cli.command_line("python bench/profile_decode.py", argv),
              "model": args.model, "dtype": model.config.dtype, "driver": args.driver, "backend": backend,
              "kernel_options": options, "scan_layers": args.scan_layers,
              "xla_flags": os.environ.get("XLA_FLAGS", ""), "jax": jax.__version__,
              "device": str(jax.devices()[0].device_kind), "platform": jax.default_backend(),
              "machine": machine_info(), "rows": rows}

    def write():
        (out / f"{label}.json").write_text(json.dumps(result, indent=1) + "\n")

    run = run_engine_driver if args.driver == "engine" else run_executor_driver
    run(args, model, backend, raw, rows, write)
    text = "\n\n".join([f"{label}: {args.model} {model.config.dtype}, backend {backend} {options or ''}, scan_layers "
                        f"{args.scan_layers}, XLA_FLAGS={result['xla_flags']!r}, {result['device']}"]
                       + [format_row(r) for r in rows])
    print(text)
    (out / f"{label}.txt").write_text(text + "\n")
    result["left_out_of_tar"] = pack(raw, out / f"{label}.tar.gz")
    write()
    if not args.keep_raw:
        shutil.rmtree(raw, ignore_errors=True)
    print(f"\nwrote {out / (label + '.json')}, {out / (label + '.txt')}, {out / (label + '.tar.gz')}")
    return 0


if __name__ == "__main__":
    sys.exit(cli.run_main(main))
