"""The cost of one update and one weight sync of the training loop at 1, 2 and 4 processes on this machine.

Each count runs as that many processes of one JAX cluster (``jaxopd.launch.launch_local``; one CPU device each).
Every process builds the same ``--model`` preset (random weights, seed 0), the trainer mesh over all processes
(``build_process_meshes``) and its own rows of a fixed global batch of ``--rows`` rows of ``--length`` tokens; then
times ``--steps`` updates (``Learner.place`` + ``Learner.step``: each process's teacher, another random model of the
preset, scores its own rows; the loss is ``opd``) and ``--steps`` weight syncs (``Learner.push``: the all-gather of
the trainer's shards and the copy onto the process's own rollout mesh, into a stub engine), after one untimed warm-up
of each. Process 0 reports the
medians; the table gives them as ratios to one process. The machine's cores are shared by all processes, so the
absolute figures mean little here; how they grow with the count does.

    python -m bench.multiprocess --out results/bench/multiprocess.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from jaxopd import cli


def parse_args(argv=None):
    p = cli.Parser(prog="python -m bench.multiprocess", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", help="jaxopd model preset (random weights)")
    p.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--rows", type=int, default=8, help="global batch rows (divisible by every process count)")
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--out", default="results/bench/multiprocess.json")
    p.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)      # a worker process's result file
    return p.parse_args(argv)


class _Engine:
    """Stands in for the rollout engine: holds the pushed weights (what a sync delivers)."""

    def update_weights(self, state, version=None):
        import jax
        jax.block_until_ready(state)


def worker(args) -> None:
    from jaxopd.train import distributed
    distributed.initialize(distributed.DistributedConfig.from_env())

    import jax
    import numpy as np
    from flax import nnx

    from jaxopd.models.decoder import CausalLM, ModelConfig
    from jaxopd.train.buffer import Sample
    from jaxopd.train.learner import Learner
    from jaxopd.train.state import OptimizerConfig
    from jaxopd.train.step import LossConfig

    config = ModelConfig.preset(args.model, dtype="float32")
    model = CausalLM(config, rngs=nnx.Rngs(0))
    learner = Learner(model, LossConfig(kind="opd"), OptimizerConfig(learning_rate=1e-5),
                      tempfile.mkdtemp(prefix=f"mp{jax.process_index()}_"), batch_size=args.rows,
                      max_train_tokens=args.length, teacher=CausalLM(config, rngs=nnx.Rngs(1)), log=lambda m: None)
    learner.restore_or_init()
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    samples = []
    for _ in range(args.rows):
        tokens = rng.integers(0, vocab, args.length)
        mask = np.arange(args.length) >= args.length // 2
        logp = np.where(mask, -np.log(vocab), 0.0)
        samples.append(Sample(tokens, mask, logp, 0))
    host = learner.collate(samples)
    engine = _Engine()
    step_s, sync_s = [], []
    for i in range(args.steps + 1):
        t = time.perf_counter()
        learner.step(learner.place(host))
        step = time.perf_counter() - t
        t = time.perf_counter()
        learner.push(engine)
        sync = time.perf_counter() - t
        if i:       # the first of each compiles
            step_s.append(step)
            sync_s.append(sync)
    if distributed.is_primary():
        Path(args.worker_out).write_text(json.dumps({
            "processes": jax.process_count(), "update_s": statistics.median(step_s),
            "sync_s": statistics.median(sync_s), "update_all_s": step_s, "sync_all_s": sync_s}))


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker_out:
        worker(args)
        return 0
    from jaxopd.launch import launch_local
    from jaxopd.machine import machine_info

    from bench.common import write_result

    for count in args.processes:
        if count < 1 or args.rows % count:
            return cli.report(f"--rows {args.rows} must split evenly over {count} processes")
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for count in args.processes:
            out = Path(folder) / f"{count}.json"
            argv_worker = [sys.executable, "-m", "bench.multiprocess", "--model", args.model, "--rows", str(args.rows),
                           "--length", str(args.length), "--steps", str(args.steps), "--worker-out", str(out)]
            env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
            code = launch_local(argv_worker, count, env=env)
            if code != 0:
                return cli.report(f"the {count}-process run failed (exit code {code})")
            rows.append(json.loads(out.read_text()))
            print(f"{count} processes: update {rows[-1]['update_s']:.3f} s, sync {rows[-1]['sync_s']:.3f} s",
                  flush=True)
    base = rows[0]
    for row in rows:
        row["update_ratio"] = row["update_s"] / base["update_s"]
        row["sync_ratio"] = row["sync_s"] / base["sync_s"]
    table = "\n".join([
        f"Training loop across processes: model {args.model} (random), global batch {args.rows} x {args.length} "
        f"tokens, median of {args.steps} (one CPU device per process, all on this machine's cores)", "",
        "| processes | update s | sync s | update / 1 process | sync / 1 process |", "|---:|---:|---:|---:|---:|",
        *[f"| {r['processes']} | {r['update_s']:.3f} | {r['sync_s']:.3f} | {r['update_ratio']:.2f} | "
          f"{r['sync_ratio']:.2f} |" for r in rows]]) + "\n"
    write_result({"command": cli.command_line("python -m bench.multiprocess", argv), "machine": machine_info(),
                  "model": args.model, "rows": args.rows, "length": args.length, "steps": args.steps,
                  "results": rows}, table, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
