"""One SFT step of a pretrained model: the whole model against LoRA adapters on every layer and on the upper ones.

The model is a fetched one (``--model``, default SmolLM2-135M-Instruct; ``python -m experiments.fetch_model``) in
float32. The batch is fixed: ``--rows`` rows of ``--length`` random tokens, the last ``--supervised`` tokens before
8 padding ones supervised (``sft`` loss, ``--max-supervised-tokens 64``). Each arm builds its ``Learner``, compiles
with one step (reported apart), then takes ``--steps`` timed steps; arms run one after the other, so the machine
should be quiet. Adapters on the upper layers only spare the backward pass below them (nothing there is
differentiated).

    python -m bench.lora_step --out results/bench/lora_step.json
"""
from __future__ import annotations

import statistics
import sys
import tempfile
import time

from jaxopd import cli


def parse_args(argv=None):
    p = cli.Parser(prog="python -m bench.lora_step", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="a fetched model's name or a model folder")
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--length", type=int, default=768)
    p.add_argument("--supervised", type=int, default=60)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--upper", type=int, default=10, help="the upper-layers arm's adapted layers")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", default="results/bench/lora_step.json")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import numpy as np

    from bench.common import write_result
    from jaxopd.machine import machine_info
    from jaxopd.models.folders import load_folder
    from jaxopd.models.lora import LoraConfig
    from jaxopd.models.pretrained import resolve_model_dir
    from jaxopd.train.buffer import Sample
    from jaxopd.train.learner import Learner
    from jaxopd.train.state import OptimizerConfig
    from jaxopd.train.step import LossConfig

    try:
        folder = resolve_model_dir(args.model)
    except (ValueError, FileNotFoundError) as e:
        return cli.report(e)
    model = load_folder(folder, dtype="float32")
    layers = model.config.num_layers
    if not 0 < args.upper <= layers:
        return cli.report(f"--upper must lie in 1..{layers}, got {args.upper}")
    rng = np.random.default_rng(0)
    samples = []
    for _ in range(args.rows):
        tokens = rng.integers(0, model.config.vocab_size, args.length)
        mask = np.zeros(args.length, bool)
        mask[args.length - args.supervised - 8:args.length - 8] = True
        samples.append(Sample(tokens, mask, np.zeros(args.length), 0))
    arms = {"whole model": None, f"LoRA r{args.rank}, all {layers} layers": LoraConfig(args.rank, 2.0 * args.rank),
            f"LoRA r{args.rank}, upper {args.upper} layers": LoraConfig(
                args.rank, 2.0 * args.rank, layers=tuple(range(layers - args.upper, layers)))}
    rows = []
    for name, lora in arms.items():
        learner = Learner(model, LossConfig(kind="sft", temperature=1.0, max_supervised_tokens=64),
                          OptimizerConfig(learning_rate=1e-4), tempfile.mkdtemp(), batch_size=args.rows,
                          max_train_tokens=args.length, lora=lora, log=lambda m: None)
        learner.restore_or_init()
        batch = learner.place(learner.collate(samples))
        t = time.perf_counter()
        learner.step(batch)
        first = time.perf_counter() - t
        times = []
        for _ in range(args.steps):
            t = time.perf_counter()
            learner.step(batch)
            times.append(time.perf_counter() - t)
        rows.append({"arm": name, "compile_and_first_s": first, "step_s": statistics.median(times), "steps_s": times})
        print(f"{name}: {statistics.median(times):.1f} s a step", flush=True)
    whole = rows[0]["step_s"]
    table = "\n".join([
        f"SFT step of {args.model} (float32), {args.rows} x {args.length} tokens, {args.supervised} supervised a row; "
        f"median of {args.steps}", "", "| arm | step s | / whole model | compile + first step s |",
        "|---|---:|---:|---:|",
        *[f"| {r['arm']} | {r['step_s']:.1f} | {r['step_s'] / whole:.2f} | {r['compile_and_first_s']:.0f} |"
          for r in rows]]) + "\n"
    write_result({"command": cli.command_line("python -m bench.lora_step", argv), "machine": machine_info(),
                  "model": args.model, "rows": args.rows, "length": args.length, "results": rows}, table, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
