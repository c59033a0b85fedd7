"""Main job: the ActFirst-OPD rollout-speedup experiment on ALFWorld contexts (paper Section 5.4, Fig. 3a,b).

Owns the presets, the command line and the run itself: sample the initial contexts, tokenise both prompts,
build the model and the engine, calibrate single-request latencies, run the b_max scan and the horizon (T)
scan with paired, order-alternated Vanilla / ActFirst timing (``experiments.actfirst_alfworld.protocol``: the
``vanilla`` and ``actfirst`` rollout strategies that training runs, over fixed contexts), add the idealized estimates
(``experiments.actfirst_alfworld.idealized``) and write the report (``experiments.actfirst_alfworld.report``).

    python -m experiments.actfirst_alfworld                    # preset auto: gpu-quick on GPU/TPU, cpu on CPU
    python -m experiments.actfirst_alfworld --preset paper --weights /models/Qwen3-1.7B
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from . import idealized
from .contexts import (ALFWORLD_PROMPT_LIMIT, ContextSet, collect_initial_contexts,
                       load_context_set, save_context_set, tokenize_contexts)
from .protocol import (DRIVER, STRATEGIES, CalibratedLatencies, PointResult,
                       TaskContext, Workload, calibrate_latencies, full_kind,
                       make_batches, run_paired_point)
from jaxopd import cli
from jaxopd.machine import machine_info

SNAPSHOT_PATH = Path(__file__).resolve().parent / "data" / "alfworld_train_contexts_seed42.json"
CONTEXT_SEED = 42                      # App. C.5: contexts sampled with seed 42
POLICY_CHOICES = ("fifo", "fast-first", "both")
CONTEXT_SOURCES = ("auto", "snapshot", "alfworld")


# ----------------------------------------------------------------------------------------------- presets
@dataclasses.dataclass(frozen=True)
class Preset:
    """One workload of the experiment. Only ``paper`` is the protocol of App. C.5; the others say where they
    depart from it (``departures``)."""

    name: str
    model: str                          # ModelConfig preset name (architecture; weights random unless given)
    tasks_per_batch: int                # N
    num_contexts: int                   # contexts sampled (the paper: 1,024)
    num_batches: int                    # batches timed per scan point (the paper: 64)
    repeats: int                        # paired repeats (the paper: 3)
    fast_tokens: int
    full_lengths: tuple[int, ...]
    bmax_scan: tuple[int, ...]
    bmax_scan_T: int
    horizon_scan: tuple[int, ...]
    horizon_scan_bmax: int
    calibration_contexts: int           # contexts whose single-request latencies are measured
    calibration_measurements: int       # measurements per context and kind (the paper: median of 3)
    prefill_chunk: int = 1024
    max_prefill_tokens: int = 16_384    # the paper's "maximum tokens per scheduling step"
    max_prefill_rows: int = 16
    page_size: int = 16
    note: str = ""

    def validate(self) -> None:
        for name in ("tasks_per_batch", "num_contexts", "num_batches", "repeats", "fast_tokens", "bmax_scan_T",
                     "horizon_scan_bmax", "calibration_contexts", "calibration_measurements"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("full_lengths", "bmax_scan", "horizon_scan"):
            values = getattr(self, name)
            if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
                raise ValueError(f"{name} must be a non-empty list of positive integers, got {values!r}")
            if len(set(values)) != len(values):
                raise ValueError(f"{name} has duplicates: {values!r}")
        if self.num_batches * self.tasks_per_batch > self.num_contexts:
            raise ValueError(f"{self.num_batches} batches of {self.tasks_per_batch} tasks need "
                             f"{self.num_batches * self.tasks_per_batch} contexts, only {self.num_contexts} sampled")
        if self.calibration_contexts > self.num_batches * self.tasks_per_batch:
            raise ValueError(f"calibration_contexts ({self.calibration_contexts}) exceeds the "
                             f"{self.num_batches * self.tasks_per_batch} contexts that are timed")

    @property
    def max_bmax(self) -> int:
        return max(max(self.bmax_scan), self.horizon_scan_bmax)

    def scan_points(self) -> list[tuple[int, int, tuple[str, ...]]]:
        """(T, b_max, scans) of every distinct point; the point shared by both scans is run once."""
        points: dict[tuple[int, int], list[str]] = {}
        for b in self.bmax_scan:
            points.setdefault((self.bmax_scan_T, b), []).append("bmax")
        for T in self.horizon_scan:
            points.setdefault((T, self.horizon_scan_bmax), []).append("horizon")
        return [(T, b, tuple(scans)) for (T, b), scans in sorted(points.items(), key=lambda kv: (kv[0][1], kv[0][0]))]


PRESETS: dict[str, Preset] = {
    "paper": Preset(
        name="paper", model="qwen3-1.7b", tasks_per_batch=16, num_contexts=1024, num_batches=64, repeats=3,
        fast_tokens=16, full_lengths=(128, 512), bmax_scan=(16, 32, 64, 128, 256), bmax_scan_T=30,
        horizon_scan=(1, 2, 4, 8, 16, 30), horizon_scan_bmax=256, calibration_contexts=1024,
        calibration_measurements=3, note="the full protocol of App. C.5 (Table 8)"),
    "gpu-quick": Preset(
        name="gpu-quick", model="qwen3-1.7b", tasks_per_batch=16, num_contexts=16, num_batches=1, repeats=1,
        fast_tokens=16, full_lengths=(128, 512), bmax_scan=(16, 32, 64, 128, 256), bmax_scan_T=8,
        horizon_scan=(1, 2, 4, 8), horizon_scan_bmax=256, calibration_contexts=16, calibration_measurements=1,
        prefill_chunk=1024, max_prefill_tokens=8192, max_prefill_rows=4, page_size=64,
        note="Qwen3-1.7B architecture, one batch, one repeat, horizons up to 8 (a Vanilla batch at T = 30 and "
             "512 tokens alone is 15,360 sequential decode steps); 64-token pages and at most 4 prompts per "
             "prefill step keep the warm-up's shape buckets few"),
    "cpu": Preset(
        name="cpu", model="tiny", tasks_per_batch=2, num_contexts=2, num_batches=1, repeats=2,
        fast_tokens=16, full_lengths=(128, 512), bmax_scan=(2, 6), bmax_scan_T=2,
        horizon_scan=(1, 2, 3), horizon_scan_bmax=6, calibration_contexts=2, calibration_measurements=1,
        prefill_chunk=512, max_prefill_tokens=512, max_prefill_rows=1, page_size=64,
        note="the tiny Qwen3 (real 151,936-token vocabulary, small body) scaled to fit 10 minutes on 2 CPU cores "
             "with 2 paired repeats per point (a mean and a spread: one repeat on a shared machine read above its "
             "own idealized bound; 3 repeats took 13 min 6 s), so 4 points: b_max/N 1 and 3 at T = 2, T 1 to 3 at "
             "b_max/N 3; one prompt per prefill step and 64-token pages keep the warm-up at 10 compiled shapes"),
}


def resolve_preset(name: str, backend: str | None = None) -> Preset:
    if name == "auto":
        if backend is None:
            import jax
            backend = jax.default_backend()
        name = "cpu" if backend == "cpu" else "gpu-quick"
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {['auto', *PRESETS]}")
    return PRESETS[name]


def departures_from_paper(preset: Preset, *, model_name: str, paper_architecture: bool, random_weights: bool,
                          policies: Sequence[str], contexts_source: dict[str, Any], backend: str,
                          prefix_sharing: bool = False, mixed_steps: bool = False) -> list[str]:
    """Every way this run differs from App. C.5 / Table 8, in words."""
    paper = PRESETS["paper"]
    out = []
    if not paper_architecture:
        out.append(f"model: `{model_name}` instead of Qwen3-1.7B")
    if random_weights:
        out.append("weights: random (the paper uses the initial Qwen3-1.7B checkpoint); output lengths are "
                   "fixed, so timings do not depend on the weights")
    for field, what in (("tasks_per_batch", "tasks per batch"), ("num_contexts", "contexts sampled"),
                        ("num_batches", "batches per scan point"), ("repeats", "paired repeats"),
                        ("fast_tokens", "fast-action tokens"), ("full_lengths", "full-response lengths"),
                        ("bmax_scan", "b_max scan"), ("bmax_scan_T", "T of the b_max scan"),
                        ("horizon_scan", "T scan"), ("horizon_scan_bmax", "b_max of the T scan"),
                        ("calibration_contexts", "calibrated contexts"),
                        ("calibration_measurements", "calibration measurements per context")):
        mine, theirs = getattr(preset, field), getattr(paper, field)
        if mine != theirs:
            fmt = (lambda v: ", ".join(map(str, v))) if isinstance(mine, tuple) else str
            out.append(f"{what}: {fmt(mine)} (paper: {fmt(theirs)})")
    out.append(f"engine: jaxopd's paged-KV JAX sampler on {backend} (policy {', '.join(policies)}; prefix sharing "
               f"{'on' if prefix_sharing else 'off'}, chunked prefill on, mixed prefill + decode steps "
               f"{'on' if mixed_steps else 'off'}) instead of vLLM on one A100-SXM4-80GB")
    if contexts_source.get("games") == "generated":
        out.append(f"contexts: ALFWorld-format training games generated from the alfworld wheel's floor plans "
                   f"(jaxopd_envs.alfworld_gen; {contexts_source.get('pool_size', '?')} train games, "
                   f"{contexts_source.get('distinct_tasks', '?')} distinct among the sampled), "
                   "not the official ALFWorld train split (3,553 tasks)")
    return out


# --------------------------------------------------------------------------------------------- contexts
def load_contexts(n: int, *, source: str = "auto", contexts_file: str | None = None) -> ContextSet:
    """``n`` initial contexts: from ``contexts_file``, the committed snapshot or the ALFWorld engine.

    ``auto``: the official games when ``$ALFWORLD_DATA`` holds them; else the committed snapshot (sampled
    with seed 42 from the generated training games) when it holds ``n`` contexts; else the generated games
    themselves (``jaxopd_envs.alfworld_gen`` generates them on first use, which takes long on a small machine).
    """
    if source not in CONTEXT_SOURCES:
        raise ValueError(f"contexts source must be one of {CONTEXT_SOURCES}, got {source!r}")
    if contexts_file is not None:
        return _head(load_context_set(contexts_file), n, contexts_file)
    if source == "auto":
        official = os.environ.get("ALFWORLD_DATA")
        if official and (Path(official).expanduser() / "json_2.1.1").is_dir():
            source = "alfworld"
        elif SNAPSHOT_PATH.is_file() and len(load_context_set(SNAPSHOT_PATH)) >= n:
            source = "snapshot"
        else:
            source = "alfworld"
    if source == "snapshot":
        if not SNAPSHOT_PATH.is_file():
            raise ValueError(f"the context snapshot {SNAPSHOT_PATH} is missing; use --contexts-source alfworld")
        return _head(load_context_set(SNAPSHOT_PATH), n, str(SNAPSHOT_PATH))
    return collect_initial_contexts(n, seed=CONTEXT_SEED)


def _head(context_set: ContextSet, n: int, where: str) -> ContextSet:
    if n > len(context_set):
        raise ValueError(f"{where} holds {len(context_set)} contexts, {n} were asked for "
                         "(use --contexts-source alfworld to sample more from the engine)")
    return context_set.head(n)


def describe_contexts(context_set: ContextSet, contexts: Sequence[TaskContext]) -> dict[str, Any]:
    src = context_set.source
    full = [len(c.full_prompt_ids) for c in contexts]
    fast = [len(c.fast_prompt_ids) for c in contexts]
    games = {"official": "the official ALFWorld train split",
             "generated": "ALFWorld-format training games generated from the alfworld wheel (jaxopd_envs.alfworld_gen)"}
    where = f" via snapshot `{Path(src['snapshot']).name}`" if "snapshot" in src else " read from the engine"
    description = (f"{len(contexts)} initial contexts of {games.get(src.get('games'), src.get('games'))}, sampled "
                   f"proportionally across the six task types with seed {src.get('seed')}{where}; prompt tokens "
                   f"full {min(full)}–{max(full)} (median {int(np.median(full))}), fast {min(fast)}–{max(fast)} "
                   f"(median {int(np.median(fast))})")
    return {**src, "description": description,
            "prompt_tokens": {"full": {"min": min(full), "median": float(np.median(full)), "max": max(full)},
                              "fast": {"min": min(fast), "median": float(np.median(fast)), "max": max(fast)}}}


# ------------------------------------------------------------------------------------------- the engine
def engine_config_for(preset: Preset, contexts: Sequence[TaskContext], policy: str, *, prefix_sharing: bool = True,
                      mixed_steps: bool | None = None):
    """Engine limits sized so that b_max requests of the longest prompt and response fit the page pool at
    once: no request is ever preempted, so timings measure scheduling, not recomputation. Events are
    recorded so that every timed batch's schedule is checked (``speedup_protocol.check_schedule``).
    ``prefix_sharing``: a turn's fast and full requests (and repeated contexts) share their prompt's pages.
    ``mixed_steps``: prompt chunks and decode rows in one device step (``None``: the backend's default).
    The job sends no score requests, so the scoring step is not compiled."""
    from jaxopd.sampler import EngineConfig

    longest_prompt = max(max(len(c.full_prompt_ids), len(c.fast_prompt_ids)) for c in contexts)
    longest = longest_prompt + max(max(preset.full_lengths), preset.fast_tokens) + 1
    max_seq_len = math.ceil(longest / preset.page_size) * preset.page_size
    pages_per_seq = max_seq_len // preset.page_size
    return EngineConfig(max_slots=preset.max_bmax, page_size=preset.page_size,
                        num_pages=preset.max_bmax * pages_per_seq + 1, max_seq_len=max_seq_len,
                        prefill_chunk=min(preset.prefill_chunk, max_seq_len),
                        max_prefill_tokens=preset.max_prefill_tokens, max_prefill_rows=preset.max_prefill_rows,
                        policy=policy, record_events=True, prefix_sharing=prefix_sharing, scoring=False,
                        mixed_steps=mixed_steps)


def build_model(model_name: str, weights: str | None):
    """The model of ``weights`` (a Hugging Face folder, Qwen3 or Llama) or a randomly initialised ``model_name``,
    and what results.json records about it."""
    from jaxopd.models.folders import load_or_init
    from jaxopd.models.weights import model_record

    model = load_or_init(weights or None, model_name)
    return model, model_record(model, name=Path(weights).name if weights else model_name, weights=weights or None)


# --------------------------------------------------------------------------------------------- the run
@dataclasses.dataclass(frozen=True)
class RunOptions:
    preset: Preset
    model: str
    weights: str | None
    policies: tuple[str, ...]
    out: Path
    contexts_source: str = "auto"
    contexts_file: str | None = None
    request_seed: int = 0
    progress: bool = True
    command: str = ""
    prefix_sharing: bool = True
    mixed_steps: bool | None = None          # None: the attention backend's default (EngineConfig.mixed_steps)


def idealized_for_point(point: PointResult, *, preset: Preset, calibration: CalibratedLatencies,
                        calibrated_batches: Sequence[Sequence[int]]) -> dict[str, Any]:
    """Calibrated per-batch estimate (App. C.5), Prop. 1 and the App. A.2 bounds (Eq. 26–28) of one point.

    Prop. 1 and the A.2 bounds take one latency per kind: the median over calibrated contexts of the
    per-context medians. Eq. 26 keeps the measured Vanilla batch times.
    """
    N, T, b = preset.tasks_per_batch, point.T, point.b_max
    kind = full_kind(point.full_tokens)
    fast_by_ctx, full_by_ctx = calibration.by_context("fast"), calibration.by_context(kind)
    batches = [([fast_by_ctx[i] for i in batch], [full_by_ctx[i] for i in batch]) for batch in calibrated_batches]
    out: dict[str, Any] = {"calibrated_speedup": idealized.calibrated_speedup(T, batches)}
    l_fast, l_full = calibration.median_of_medians("fast"), calibration.median_of_medians(kind)
    out.update(l_fast=l_fast, l_full=l_full)
    if l_fast <= l_full:
        condition = idealized.speedup_necessary_condition(N, T, l_fast, l_full, b)
        lower = idealized.actfirst_completion_lower_bound(N, T, l_fast, l_full, b)
        eq26 = [r.vanilla_total / (len(r.vanilla) * lower) for r in point.repeats]
        out.update(prop1_speedup=idealized.ideal_speedup(T, l_fast, l_full),
                   eq25_actfirst_lower_bound_s=lower, eq26_bound=float(np.mean(eq26)),
                   eq27_bound=condition.speedup_cap, eq28_min_b_max=condition.min_b_max,
                   eq28_holds=condition.holds)
    else:   # Prop. 1 and A.2 assume l_fast <= l_full; report the calibrated estimate only
        out.update(prop1_speedup=None, eq26_bound=None, eq27_bound=None, eq28_min_b_max=None, eq28_holds=None)
    return out


def point_to_dict(point: PointResult, *, policy: str, scans: Sequence[str], preset: Preset,
                  ideal: dict[str, Any]) -> dict[str, Any]:
    from . import report   # not at import: `python -m ...report` runs it
    repeats = []
    for r in point.repeats:
        repeats.append({
            "index": r.index, "order": list(r.order), "speedup": r.speedup,
            "vanilla_total_s": r.vanilla_total, "actfirst_total_s": r.actfirst_total,
            "vanilla_batch_times_s": [run.completion_time for run in r.vanilla],
            "actfirst_batch_times_s": [run.completion_time for run in r.actfirst],
            "vanilla_batch_wall_s": [run.wall_time for run in r.vanilla],
            "actfirst_batch_wall_s": [run.wall_time for run in r.actfirst],
            "vanilla_peak_concurrency": max(run.peak_concurrency for run in r.vanilla),
            "actfirst_peak_concurrency": max(run.peak_concurrency for run in r.actfirst),
            "preemptions": sum(rec.num_preemptions for run in r.vanilla + r.actfirst for rec in run.records),
            "schedule_verified": all(run.schedule is not None for run in r.vanilla + r.actfirst),
            "actfirst_max_full_in_flight_per_task": max(run.schedule.max_full_in_flight_per_task
                                                        for run in r.actfirst if run.schedule is not None),
        })
    return {"policy": policy, "scans": list(scans), "full_tokens": point.full_tokens, "T": point.T,
            "b_max": point.b_max, "tasks_per_batch": preset.tasks_per_batch, "num_batches": preset.num_batches,
            "speedup_mean": point.speedup_mean,
            "speedup_std": None if math.isnan(point.speedup_std) else point.speedup_std,   # None: one repeat
            **speedup_spread(point.speedups),
            "repeats": repeats,
            "peak_concurrency": point.peak_concurrency, "idealized": ideal,
            "paper_speedup": report.paper_speedup(point.full_tokens, point.T, point.b_max, preset.tasks_per_batch)}


def speedup_spread(speedups: Sequence[float]) -> dict[str, Any]:
    """The spread of a point's paired repeats: ``speedup_min`` / ``speedup_max`` and ``speedup_sem``, the standard
    error of the mean (sample std / sqrt(repeats); None with one repeat). The plots' error bars are ±1 sample std
    (``speedup_std``)."""
    values = [float(v) for v in speedups]
    sem = float(np.std(values, ddof=1) / math.sqrt(len(values))) if len(values) > 1 else None
    return {"speedup_min": min(values), "speedup_max": max(values), "speedup_sem": sem}


def _progress_bar(total: int, desc: str, enabled: bool):
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit="run", disable=not enabled, dynamic_ncols=True, file=sys.stdout)


def run_experiment(options: RunOptions, *, engine_factory: Callable[[Any, Any], Any] | None = None,
                   model_and_info: tuple[Any, dict[str, Any]] | None = None,
                   context_set: ContextSet | None = None, tokenizer: Any = None) -> dict[str, Any]:
    """Run both scans and write the report into ``options.out``; returns the results dictionary.

    The keyword arguments exist for tests: ``engine_factory(model, engine_config)`` replaces
    ``jaxopd.sampler.Engine``, ``model_and_info`` the model construction, ``context_set`` the context
    loading and ``tokenizer`` the model's (``load_folder_tokenizer(options.weights)``: the offline Qwen3 one for
    random weights).
    """
    from . import report   # not at import: `python -m ...report` runs it
    preset = options.preset
    preset.validate()
    log = print if options.progress else (lambda *a, **k: None)
    for policy in options.policies:
        if policy not in ("fifo", "fast-first"):
            raise ValueError(f"policy must be fifo or fast-first, got {policy!r}")
    timing: dict[str, float] = {}
    t_start = time.perf_counter()

    t = time.perf_counter()
    if context_set is None:
        context_set = load_contexts(preset.num_contexts, source=options.contexts_source,
                                    contexts_file=options.contexts_file)
    else:
        context_set = context_set.head(preset.num_contexts)
    timing["contexts"] = time.perf_counter() - t
    log(f"contexts: {len(context_set)} ({context_set.source.get('games', '?')} ALFWorld games"
        f"{', snapshot' if 'snapshot' in context_set.source else ''}) in {timing['contexts']:.1f} s", flush=True)

    t = time.perf_counter()
    if tokenizer is None:
        from jaxopd.models.folders import load_folder_tokenizer
        tokenizer = load_folder_tokenizer(options.weights)
    contexts = tokenize_contexts(context_set, tokenizer, max_prompt_tokens=ALFWORLD_PROMPT_LIMIT)
    timed = contexts[:preset.num_batches * preset.tasks_per_batch]
    batches = make_batches(timed, preset.tasks_per_batch, preset.num_batches)
    timing["tokenize"] = time.perf_counter() - t

    t = time.perf_counter()
    model, model_info = model_and_info if model_and_info is not None else build_model(options.model, options.weights)
    timing["model_init"] = time.perf_counter() - t
    log(f"model: {model_info['name']}, {model_info['num_params'] / 1e6:.1f}M parameters, {model_info['dtype']}, "
        f"{'random weights' if model_info['random_weights'] else 'weights ' + str(model_info['weights'])} "
        f"({timing['model_init']:.1f} s)", flush=True)

    if engine_factory is None:
        from jaxopd.sampler import Engine

        def engine_factory(model, config):
            return Engine(model, config)

    machine = machine_info()
    points_spec = preset.scan_points()
    runs_per_point = preset.repeats * preset.num_batches * len(STRATEGIES)
    total_runs = len(options.policies) * len(preset.full_lengths) * len(points_spec) * runs_per_point
    calibration: CalibratedLatencies | None = None
    calibrated = timed[:preset.calibration_contexts]
    calibrated_batches = [[c.index for c in calibrated[i:i + preset.tasks_per_batch]]
                          for i in range(0, len(calibrated), preset.tasks_per_batch)]
    points_out: list[dict[str, Any]] = []
    timing["engine_warmup"] = timing["calibration"] = timing["scan"] = 0.0
    engine_info: dict[str, Any] = {}
    sharing: dict[str, Any] = {"enabled": options.prefix_sharing, "scan": {}}
    for policy in options.policies:
        config = engine_config_for(preset, timed, policy, prefix_sharing=options.prefix_sharing,
                                   mixed_steps=options.mixed_steps)
        engine_info[policy] = {**dataclasses.asdict(config), "uses_mixed_steps": config.uses_mixed_steps}
        t = time.perf_counter()
        log(f"engine ({policy}): max_slots {config.max_slots}, max_seq_len {config.max_seq_len}, "
            f"{config.num_pages} pages of {config.page_size}; warming up (compiles every shape bucket) ...",
            flush=True)
        engine = engine_factory(model, config)
        engine.start()
        try:
            compiled = engine.warmup()
            timing["engine_warmup"] += time.perf_counter() - t
            log(f"warm-up: {compiled} compiled shapes in {time.perf_counter() - t:.1f} s", flush=True)
            if calibration is None:
                t = time.perf_counter()
                n_cal = len(calibrated) * preset.calibration_measurements * (1 + len(preset.full_lengths))
                with _progress_bar(n_cal, "calibration (single requests)", options.progress) as bar:
                    calibration = calibrate_latencies(
                        engine, calibrated, Workload(fast_tokens=preset.fast_tokens),
                        full_token_lengths=preset.full_lengths, measurements=preset.calibration_measurements,
                        base_seed=options.request_seed, progress=lambda: bar.update(1))
                timing["calibration"] = time.perf_counter() - t
            engine.events.clear()
            stats_before = _sharing_stats(engine)
            t = time.perf_counter()
            with _progress_bar(total_runs // len(options.policies), f"scan ({policy})", options.progress) as bar:
                for L in preset.full_lengths:
                    workload = Workload(fast_tokens=preset.fast_tokens, full_tokens=L)
                    for T, b_max, scans in points_spec:
                        bar.set_postfix_str(f"L={L} T={T} b_max={b_max}")
                        point = run_paired_point(engine, batches, T=T, b_max=b_max, workload=workload,
                                                 repeats=preset.repeats, base_seed=options.request_seed,
                                                 check_events=True, progress=lambda: bar.update(1))
                        ideal = idealized_for_point(point, preset=preset, calibration=calibration,
                                                    calibrated_batches=calibrated_batches)
                        points_out.append(point_to_dict(point, policy=policy, scans=scans, preset=preset,
                                                        ideal=ideal))
            timing["scan"] += time.perf_counter() - t
            stats_after = _sharing_stats(engine)
            sharing["scan"][policy] = {k: stats_after[k] - stats_before[k] for k in stats_after}
        finally:
            engine.stop()
            engine = None      # free this engine's KV pages before the next policy's engine allocates its own
    timing["total"] = time.perf_counter() - t_start

    import jax
    import flax
    results = {
        "experiment": "ActFirst-OPD rollout speedup (paper Section 5.4, Fig. 3a,b; protocol App. C.5)",
        "command": options.command, "preset": preset.name, "preset_note": preset.note, "driver": DRIVER,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "config": {"tasks_per_batch": preset.tasks_per_batch, "num_contexts": preset.num_contexts,
                   "num_batches": preset.num_batches, "repeats": preset.repeats,
                   "fast_tokens": preset.fast_tokens, "full_lengths": list(preset.full_lengths),
                   "bmax_scan": list(preset.bmax_scan), "bmax_scan_T": preset.bmax_scan_T,
                   "horizon_scan": list(preset.horizon_scan), "horizon_scan_bmax": preset.horizon_scan_bmax,
                   "calibration_contexts": preset.calibration_contexts,
                   "calibration_measurements": preset.calibration_measurements,
                   "policies": list(options.policies), "temperature": 1.0, "top_p": 1.0, "top_k": 0,
                   "request_seed": options.request_seed, "context_seed": CONTEXT_SEED},
        "departures": departures_from_paper(preset, model_name=model_info["name"],
                                            paper_architecture=model_info["paper_architecture"],
                                            random_weights=model_info["random_weights"],
                                            policies=options.policies, contexts_source=context_set.source,
                                            backend=machine["backend"],
                                            prefix_sharing=options.prefix_sharing,
                                            mixed_steps=bool(engine_info) and all(
                                                info["uses_mixed_steps"] for info in engine_info.values())),
        "machine": machine,
        "software": {"jax": jax.__version__, "flax": flax.__version__, "numpy": np.__version__},
        "model": model_info, "engine": engine_info,
        "contexts": describe_contexts(context_set, timed),
        "calibration": _calibration_dict(calibration),
        "points": points_out,
        "timing_s": timing,
        "prefix_sharing": sharing,
    }
    report.write_report(results, options.out)
    return results


def _sharing_stats(engine: Any) -> dict[str, int]:
    """The engine's prefix-sharing counters (zeros for an engine without them)."""
    stats = getattr(engine, "stats", None) or {}
    return {k: int(stats.get(k, 0)) for k in ("shared_pages", "prefill_tokens_saved")}


def sharing_summary(results: dict[str, Any]) -> str | None:
    """One line on the pages and prefill tokens prefix sharing saved during the scans (None before it existed)."""
    sharing = results.get("prefix_sharing")
    if sharing is None:
        return None
    if not sharing["enabled"]:
        return "Prefix sharing: off"
    parts = [f"{policy}: {s['shared_pages']:,} pages, {s['prefill_tokens_saved']:,} prefill tokens saved"
             for policy, s in sharing["scan"].items()]
    return "Prefix sharing: on — " + ("; ".join(parts) if parts else "no scan ran")


def _calibration_dict(calibration: CalibratedLatencies) -> dict[str, Any]:
    return {"context_indices": list(calibration.context_indices),
            "measurements": len(next(iter(calibration.measurements.values()))[0]),
            "latencies_s": {k: [list(v) for v in per] for k, per in calibration.measurements.items()},
            "medians": {k: calibration.medians(k).tolist() for k in calibration.measurements},
            "median_of_medians": {k: calibration.median_of_medians(k) for k in calibration.measurements}}


# ------------------------------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    p = cli.Parser(prog="python -m experiments.actfirst_alfworld",
                   description="Reproduce the ActFirst-OPD rollout-speedup curves (Fig. 3a,b) with "
                               "jaxopd's sampler on ALFWorld initial contexts.")
    p.add_argument("--preset", default="auto", choices=["auto", *PRESETS],
                   help="auto: gpu-quick on GPU/TPU, cpu on CPU (default)")
    p.add_argument("--model", default=None, help="architecture preset (default: the preset's)")
    p.add_argument("--weights", default=None, help="Hugging Face model folder (default: random weights)")
    p.add_argument("--policy", default="fifo", choices=POLICY_CHOICES,
                   help="engine admission policy: fifo (the paper's engine), fast-first, or both")
    p.add_argument("--contexts", type=int, default=None, help="number of contexts to sample")
    p.add_argument("--batches", type=int, default=None, help="batches timed per scan point")
    p.add_argument("--repeats", type=int, default=None, help="paired repeats")
    p.add_argument("--out", default=None, help="output folder (default: runs/actfirst_alfworld/<preset>-<time>)")
    p.add_argument("--contexts-source", default="auto", choices=CONTEXT_SOURCES,
                   help="auto: official ALFWorld games under $ALFWORLD_DATA, else the committed snapshot, else "
                        "generated games; snapshot; alfworld: read them from the engine")
    p.add_argument("--contexts-file", default=None, help="a context snapshot JSON to use instead")
    p.add_argument("--write-contexts-snapshot", default=None, metavar="PATH",
                   help="sample --contexts contexts (default 1,024) from the ALFWorld engine, save them, and exit")
    p.add_argument("--seed", type=int, default=0, help="base seed of the requests' sampling seeds")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--prefix-sharing", default="on", choices=["on", "off"],
                   help="share the KV pages of common prompt prefixes between requests (default on)")
    p.add_argument("--mixed-steps", default="auto", choices=["auto", "on", "off"],
                   help="prefill prompt chunks and decode running rows in one device step (auto: on where the "
                        "attention backend decodes in place, i.e. pallas-gpu / pallas-tpu; off for reference)")
    return p


def options_from_args(args: argparse.Namespace, *, backend: str | None = None) -> RunOptions:
    preset = resolve_preset(args.preset, backend)
    changes: dict[str, Any] = {}
    if args.contexts is not None:
        changes["num_contexts"] = args.contexts
        if args.batches is None:
            changes["num_batches"] = max(1, args.contexts // preset.tasks_per_batch)
    if args.batches is not None:
        changes["num_batches"] = args.batches
        if args.contexts is None:
            changes["num_contexts"] = max(preset.num_contexts, args.batches * preset.tasks_per_batch)
    if args.repeats is not None:
        changes["repeats"] = args.repeats
    if changes:
        timed = changes.get("num_batches", preset.num_batches) * preset.tasks_per_batch
        changes["calibration_contexts"] = min(preset.calibration_contexts, timed) if preset.name != "paper" else timed
        preset = dataclasses.replace(preset, **changes)
    preset.validate()
    policies = ("fifo", "fast-first") if args.policy == "both" else (args.policy,)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(args.out) if args.out else Path("runs") / "actfirst_alfworld" / f"{preset.name}-{stamp}"
    return RunOptions(preset=preset, model=args.model or preset.model, weights=args.weights, policies=policies,
                      out=out, contexts_source=args.contexts_source, contexts_file=args.contexts_file,
                      request_seed=args.seed, progress=not args.no_progress,
                      prefix_sharing=args.prefix_sharing == "on",
                      mixed_steps={"auto": None, "on": True, "off": False}[args.mixed_steps],
                      command=cli.command_line("python -m experiments.actfirst_alfworld"))


def prepare_out_dir(out: Path, flag: str = "--out") -> Path:
    """Create ``out`` and prove it writable now, before hours of work, not when the report is written
    (``jaxopd.cli.UsageError`` naming ``flag`` otherwise)."""
    return cli.check_out_dir(flag, out)


def check_model_choice(model: str, weights: str | None) -> None:
    """``--model`` names a preset that runs with random weights (when no weights are given: the offline Qwen3
    tokenizer's ids must fit it) and ``--weights`` is a Hugging Face folder."""
    if weights:
        from jaxopd.models.folders import check_folder_tokenizer

        cli.check_checkpoint_folder("--weights", weights)
        check_folder_tokenizer(weights)                 # a Llama folder (or its base) carries its own tokenizer
        return
    cli.check_random_preset("--model", model)


def preflight(options: RunOptions) -> ContextSet | None:
    """Every check that can fail on the user's input, before the model is built. Returns the contexts when
    they come from a file (cheap to read), so that a count or format problem is found here."""
    check_model_choice(options.model, options.weights)
    context_set = None
    resolved = options.contexts_source
    if options.contexts_file is None and resolved in ("auto", "alfworld"):
        cli.check_alfworld_data()                  # $ALFWORLD_DATA is read for the contexts: it must name a folder
    if options.contexts_file is not None or resolved == "snapshot" or (
            resolved == "auto" and not os.environ.get("ALFWORLD_DATA") and SNAPSHOT_PATH.is_file()):
        context_set = load_contexts(options.preset.num_contexts, source=options.contexts_source,
                                    contexts_file=options.contexts_file)
    prepare_out_dir(options.out)
    return context_set


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return cli.run_main(lambda: _main(args))


def _main(args: argparse.Namespace) -> int:
    from . import report   # not at import: `python -m ...report` runs it
    if args.write_contexts_snapshot:
        n = PRESETS["paper"].num_contexts if args.contexts is None else args.contexts
        if n < 1:
            raise cli.UsageError(f"--contexts must be a positive number of contexts to sample, got {n}")
        cli.check_out_file("--write-contexts-snapshot", args.write_contexts_snapshot)
        cli.check_alfworld_data()
        context_set = collect_initial_contexts(n, seed=CONTEXT_SEED)
        path = save_context_set(args.write_contexts_snapshot, context_set)
        print(f"{n} contexts ({context_set.source['distinct_tasks']} distinct tasks) written to {path}")
        return 0
    with cli.usage_errors(ValueError):
        options = options_from_args(args)
        context_set = preflight(options)
    p = options.preset
    print(f"ActFirst-OPD rollout speedup — preset {p.name}: {p.note}")
    print(f"model {options.model}{' (random weights)' if not options.weights else ' from ' + options.weights}; "
          f"N={p.tasks_per_batch} tasks/batch x {p.num_batches} batch(es), {p.repeats} repeat(s); full "
          f"{'/'.join(map(str, p.full_lengths))} tokens; b_max {list(p.bmax_scan)} at T={p.bmax_scan_T}; "
          f"T {list(p.horizon_scan)} at b_max={p.horizon_scan_bmax}; output {options.out}", flush=True)
    results = run_experiment(options, context_set=context_set)
    print()
    print(report.summary_markdown(results).split("## Calibrated")[0].rstrip())
    print()
    print(f"Wrote {', '.join(report.OUTPUT_FILES)} to {options.out}")
    print("Key numbers:")
    for line in report.key_numbers(results):
        print(f"  {line}")
    line = sharing_summary(results)
    if line:
        print(line)
    return 0
