"""The SFT train step on CPU with glibc's default allocator settings and with ``jaxopd.host_malloc.tune_malloc``'s,
side by side: seconds per step, user and kernel CPU seconds, minor page faults.

    python -m bench.host_malloc --out results/bench/host_malloc.json

Each measurement is a fresh process (allocator settings hold for a whole process) running the real sharded train
step of ``jaxopd.methods.sft`` (``sft`` loss, AdamW, the ``tiny`` preset, the context language-model term) on a
batch of the SFT run's shape: ``--batch`` rows of ``--length`` tokens, the last ``--supervised`` of each supervised.
The two settings alternate over ``--rounds`` rounds, so machine noise falls on both.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Sequence

from jaxopd.cli import Parser, UsageError, check_out_file, command_line, run_main
from jaxopd.machine import machine_info

SETTINGS = {"glibc defaults": "0", "tune_malloc": "1"}


def child(args) -> dict:
    """Run the step ``args.steps`` times after two untimed ones (the compile, the heap's growth); the figures of the
    timed steps."""
    import jax
    import numpy as np
    from flax import nnx

    from jaxopd.host_malloc import tune_malloc
    from jaxopd.models.decoder import CausalLM, ModelConfig
    from bench.common import sft_train_step
    from jaxopd.train.buffer import Sample, collate_samples
    from jaxopd.train.state import place_batch
    from jaxopd.train.step import LossConfig

    tuned = tune_malloc()
    model = CausalLM(ModelConfig.preset("tiny"), rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    vocab = tuple(range(1000, 1300))
    samples = []
    for _ in range(args.batch):
        tokens = rng.choice(vocab, size=args.length)
        mask = np.arange(args.length) >= args.length - args.supervised
        samples.append(Sample(tokens=tokens, loss_mask=mask, behavior_logp=np.zeros(args.length, np.float32),
                              policy_version=0))
    loss = LossConfig(kind="sft", temperature=1.0, max_supervised_tokens=args.supervised, context_lm_weight=1.0,
                      context_vocab=vocab)
    step, state, rows = sft_train_step(model, loss)
    batch = place_batch(collate_samples(samples, batch_size=args.batch, length=args.length), rows)
    for _ in range(2):        # the compile, then the step that grows the tuned heap to its peak
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
    times, user, system, faults = [], [], [], []
    for _ in range(args.steps):
        cpu0, faults0, t0 = os.times(), _minor_faults(), time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t0)
        cpu1 = os.times()
        user.append(cpu1.user - cpu0.user)
        system.append(cpu1.system - cpu0.system)
        faults.append(_minor_faults() - faults0)
    return {"tuned": tuned, "step_s": times, "user_s": user, "system_s": system, "minor_faults": faults,
            "loss": float(metrics["loss"])}


def _minor_faults() -> int:
    with open("/proc/self/stat") as handle:
        return int(handle.read().rsplit(")", 1)[1].split()[7])


def main(argv: Sequence[str] | None = None) -> int:
    parser = Parser(prog="python -m bench.host_malloc", description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=1152)
    parser.add_argument("--supervised", type=int, default=96)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per process (after two untimed)")
    parser.add_argument("--rounds", type=int, default=2, help="processes per setting, alternating")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="results/bench/host_malloc.json")
    args = parser.parse_args(argv)
    return run_main(lambda: run(args, argv))


def run(args, argv) -> int:
    for name in ("batch", "length", "supervised", "steps", "rounds"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.supervised >= args.length:
        raise UsageError(f"--supervised {args.supervised} must be below --length {args.length}")
    if args.child:
        print(json.dumps(child(args)))
        return 0
    if not sys.platform.startswith("linux"):
        raise UsageError("this benchmark reads /proc and tunes glibc: Linux only")
    out = check_out_file("--out", args.out)
    command = [sys.executable, "-m", "bench.host_malloc", "--child", "--batch", str(args.batch), "--length",
               str(args.length), "--supervised", str(args.supervised), "--steps", str(args.steps)]
    runs: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    for round_index in range(args.rounds):
        for name, flag in SETTINGS.items():
            env = {**os.environ, "JAXOPD_MALLOC_TUNING": flag}
            done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"{name} child failed ({done.returncode}): {done.stderr[-2000:]}")
            result = json.loads(done.stdout.strip().splitlines()[-1])
            runs[name].append(result)
            print(f"round {round_index + 1} {name}: median step {statistics.median(result['step_s']):.2f} s, "
                  f"system {statistics.median(result['system_s']):.2f} s", flush=True)
    summary = {}
    for name, results in runs.items():
        def pooled(key, results=results):
            return statistics.median([value for r in results for value in r[key]])
        summary[name] = {"step_s": pooled("step_s"), "user_s": pooled("user_s"), "system_s": pooled("system_s"),
                         "minor_faults": pooled("minor_faults"), "tuned": results[0]["tuned"],
                         "loss": results[0]["loss"]}
    base, tuned = summary["glibc defaults"], summary["tune_malloc"]
    lines = ["| allocator | step (s) | user CPU (s) | kernel CPU (s) | minor faults / step |", "|---|---|---|---|---|"]
    for name, row in summary.items():
        lines.append(f"| {name} | {row['step_s']:.2f} | {row['user_s']:.2f} | {row['system_s']:.2f} | "
                     f"{row['minor_faults']:,.0f} |")
    table = "\n".join(lines) + (
        f"\n\nSpeedup of the step: {base['step_s'] / tuned['step_s']:.2f}x (medians of {args.rounds} processes x "
        f"{args.steps} steps per setting, alternating). SFT step of the tiny preset, batch {args.batch} x "
        f"{args.length} tokens, {args.supervised} supervised; same loss in both: {base['loss']:.6f} / "
        f"{tuned['loss']:.6f}.\n")
    from bench.common import write_result
    write_result({"command": command_line("python -m bench.host_malloc", argv), "cpu_count": os.cpu_count(),
                  "machine": machine_info(devices=False),
                  "summary": summary, "runs": runs, "speedup": base["step_s"] / tuned["step_s"]}, table, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
