"""Host overhead of the sampling engine per decode step: host time, device time and the device-idle share.

A negligible model (hidden 32, one layer, vocabulary 256 by default) makes the device work per step tiny, so
what is left is the engine's own host work: scheduling, per-row bookkeeping, stop checks, building the
arrays of the step and dispatch. For each batch size, ``batch`` requests with short prompts and a fixed output
length (min = max new tokens) decode together; only decode steps with all ``batch`` rows active count.

Per decode step the bench records three timestamps (``time.perf_counter``): the call into the jitted
``decode_step`` (dispatch start), its return (dispatch end) and the moment its outputs are ready (a watcher
thread blocks on them, so the engine thread is never held up by the measurement). From them:

- ``wall``: time between consecutive dispatches (the engine's step period);
- ``device``: ``ready[k] - max(dispatch_end[k], ready[k-1])``, the time the device works on step k;
- ``device-idle share``: ``1 - sum(device) / (ready[last] - dispatch_start[first])``;
- ``host``: CPU time of the engine thread per step (``/proc/self/task/<tid>/schedstat``, nanoseconds), i.e.
  all host work of the engine loop, whether or not it overlaps the device.

    python bench/engine_overhead.py --out results/bench/engine_overhead.json
"""
from __future__ import annotations

import json
import queue
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

from jaxopd import cli
from jaxopd.machine import machine_info

BATCHES = (1, 8, 32, 64, 128, 256)


def parse_args(argv=None):
    p = cli.Parser(prog="python -m bench.engine_overhead", description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    p.add_argument("--new-tokens", type=int, default=96, help="tokens generated per request")
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3, help="runs per batch size (the median step is reported)")
    p.add_argument("--model", default="negligible",
                   help="'negligible' (hidden 32, 1 layer, vocab 256) or a jaxopd model preset name")
    p.add_argument("--dtype", default=None, help="model dtype (default: the backend's)")
    p.add_argument("--label", default=None, help="a name for this run in the JSON (e.g. before / after)")
    p.add_argument("--out", default="results/bench/engine_overhead.json")
    return p.parse_args(argv)


def make_model(name: str, dtype: str | None):
    from flax import nnx

    from jaxopd.models.decoder import CausalLM, ModelConfig

    if name == "negligible":
        cfg = ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                          intermediate_size=64, vocab_size=256, max_position_embeddings=4096)
        if dtype:
            cfg = cfg.with_dtypes(dtype)
    else:
        cfg = ModelConfig.preset(name, dtype=dtype)
    return CausalLM(cfg, rngs=nnx.Rngs(0))


class StepClock:
    """Wraps the executor module's jitted ``decode_step`` to timestamp dispatch and readiness of each call."""

    def __init__(self, executor_module):
        import jax

        self._module = executor_module
        self._original = executor_module.decode_step
        self._jax = jax
        self.records: list[list[float]] = []    # [dispatch_start, dispatch_end, ready, rows]
        self._pending: queue.SimpleQueue = queue.SimpleQueue()
        self._watcher = threading.Thread(target=self._watch, daemon=True, name="step-clock")
        self._watcher.start()

    def __enter__(self):
        original = self._original

        def timed(*args, **kwargs):
            start = time.perf_counter()
            out = original(*args, **kwargs)
            end = time.perf_counter()
            record = [start, end, float("nan"), float(np.shape(out[1])[0])]
            self.records.append(record)
            self._pending.put((record, out[1:]))     # never the donated KV: only the sampled outputs
            return out

        timed._cache_size = original._cache_size        # compiled_count() keeps working
        self._module.decode_step = timed
        return self

    def __exit__(self, *exc):
        self._module.decode_step = self._original
        self._pending.put(None)
        self._watcher.join()

    def _watch(self):
        while True:
            item = self._pending.get()
            if item is None:
                return
            record, outputs = item
            self._jax.block_until_ready(outputs)
            record[2] = time.perf_counter()

    def wait(self):
        """Until every recorded step's outputs are ready."""
        while any(np.isnan(r[2]) for r in self.records):
            time.sleep(0.001)

    def reset(self):
        self.wait()
        self.records = []


def thread_cpu_seconds(native_id: int) -> float:
    """CPU time of one thread of this process, from the scheduler's nanosecond counter."""
    with open(f"/proc/self/task/{native_id}/schedstat") as f:
        return int(f.read().split()[0]) / 1e9


def engine_thread_id(engine) -> int:
    for name in ("_thread", "thread"):
        thread = getattr(engine, name, None)
        if isinstance(thread, threading.Thread):
            return thread.native_id
    raise RuntimeError("cannot find the engine's thread")


def run_once(engine, clock: StepClock, batch: int, args, seed: int) -> dict:
    from jaxopd.sampler import Request, SamplingParams

    rng = np.random.default_rng(seed)
    vocab = engine.vocab_size
    requests = [Request([int(t) for t in rng.integers(1, vocab - 1, args.prompt_len)],
                        SamplingParams(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                       temperature=1.0, seed=seed * 10_000 + i))
                for i in range(batch)]
    clock.reset()
    tid = engine_thread_id(engine)
    cpu0, t0 = thread_cpu_seconds(tid), time.perf_counter()
    results = engine.generate(requests)
    cpu1, t1 = thread_cpu_seconds(tid), time.perf_counter()
    assert all(len(r.token_ids) == args.new_tokens for r in results)
    clock.wait()
    return {"records": [list(r) for r in clock.records], "cpu": cpu1 - cpu0, "wall": t1 - t0}


def summarise(records: list[list[float]], batch: int, cpu_seconds: float, total_steps: int) -> dict:
    full = [r for r in records if r[3] >= batch]
    rows = np.asarray(full)
    # steady state: decode steps of the full batch, in dispatch order
    start, end, ready = rows[:, 0], rows[:, 1], rows[:, 2]
    period = np.diff(start)
    prev_ready = np.concatenate([[end[0]], ready[:-1]])
    device = ready - np.maximum(end, prev_ready)
    span = ready[-1] - start[0]
    return {"steps": int(len(full)), "wall_ms": 1e3 * float(np.median(period)),
            "device_ms": 1e3 * float(np.median(device)), "dispatch_ms": 1e3 * float(np.median(end - start)),
            "idle_share": float(1.0 - device[1:].sum() / (ready[-1] - ready[0])) if len(full) > 2 else float(
                1.0 - device.sum() / span),
            "host_ms": 1e3 * cpu_seconds / max(total_steps, 1)}


def check_args(args) -> None:
    """The input checks, before any model is built (``jaxopd.cli.UsageError``)."""
    if args.model != "negligible":
        try:
            cli.check_model_preset("--model", args.model)
        except cli.UsageError as error:
            raise cli.UsageError(f"{error}, or 'negligible'") from None
    cli.check_out_file("--out", args.out)


def main(argv=None) -> int:
    args = parse_args(argv)
    check_args(args)

    from jaxopd.sampler import Engine, EngineConfig
    from jaxopd.sampler import executor as executor_module

    model = make_model(args.model, args.dtype)
    max_slots = max(args.batches)
    max_seq_len = 16 * -(-(args.prompt_len + args.new_tokens + 1) // 16)
    config = EngineConfig(max_slots=max_slots, page_size=16, num_pages=max_slots * (max_seq_len // 16) + 1,
                          max_seq_len=max_seq_len, prefill_chunk=16, max_prefill_tokens=16 * 64,
                          max_prefill_rows=64, eos_token_ids=())
    rows = []
    with StepClock(executor_module) as clock, Engine(model, config) as engine:
        t = time.perf_counter()
        engine.warmup()
        compile_s = time.perf_counter() - t
        compiled = engine.compiled_count()
        for batch in args.batches:
            runs = []
            for r in range(args.repeats + 1):          # the first run of each size is a warm-up
                out = run_once(engine, clock, batch, args, seed=r)
                s = summarise(out["records"], batch, out["cpu"], len(out["records"]))
                s["tokens_per_s"] = batch * args.new_tokens / out["wall"]
                if r:
                    runs.append(s)
            med = {k: statistics.median(run[k] for run in runs) for k in runs[0]}
            med["batch"] = batch
            rows.append(med)
            print(f"batch {batch:4d}: host {med['host_ms']:.3f} ms/step, device {med['device_ms']:.3f} ms, "
                  f"wall {med['wall_ms']:.3f} ms, idle {100 * med['idle_share']:.1f}%", flush=True)
        recompiled = engine.compiled_count() - compiled
    print()
    print("| batch | host ms/step | device ms/step | wall ms/step | device idle | tokens/s |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['batch']} | {r['host_ms']:.3f} | {r['device_ms']:.3f} | {r['wall_ms']:.3f} | "
              f"{100 * r['idle_share']:.1f}% | {r['tokens_per_s']:.0f} |")
    result = {"label": args.label, "command": "python bench/engine_overhead.py " + " ".join(sys.argv[1:]),
              "machine": machine_info(),
              "model": args.model, "new_tokens": args.new_tokens, "prompt_len": args.prompt_len,
              "repeats": args.repeats, "compile_s": compile_s, "recompiles_after_warmup": recompiled, "rows": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(cli.run_main(main))
