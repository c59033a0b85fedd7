"""Which layers should a student cut from its pretrained teacher keep? Each candidate's fit to the answers, untrained.

For each ``--keep`` layer set, the base model cut to those layers (``jaxopd.models.weights.cut_layers``) is measured
on ``--states`` demonstration turns of the *training* games (the searching expert's won episodes, the SFT corpus the
student is trained on; no evaluation game is read): the negative log-likelihood of the answers
(``jaxopd.methods.divergence.response_nll``; think-then-act with ``--thinking`` and action-only ``next_action``) and
the exact reverse KL to the uncut base on the same turns. Lower is a better start: the set with the lowest mean NLL
is the one the student keeps.

    python -m experiments.probes.cut_layers --model smollm2-135m-instruct --keep 0-14 --keep 0-13,29 \\
        --keep 0-11,27-29 --keep 0-28:2 --out results/train/cut_layers

Writes ``cut_layers.json`` and ``README.md`` into ``--out``. Bad input is one line and exit code 2.
"""
from __future__ import annotations

import datetime
import json
import os
import sys
import time
from typing import Any, Sequence

from jaxopd import cli


def parse_keep(spec: str) -> tuple[int, ...]:
    """``"0-13,29"`` → (0, ..., 13, 29); ``"0-28:2"`` → every other layer from 0 to 28."""
    layers: list[int] = []
    try:
        for part in spec.split(","):
            span, _, step = part.partition(":")
            first, _, last = span.partition("-")
            layers += range(int(first), int(last or first) + 1, int(step or 1))
    except ValueError:
        raise cli.UsageError(f"--keep {spec!r}: expected layer ranges like 0-13,29 or 0-28:2") from None
    if not layers or layers != sorted(set(layers)) or layers[0] < 0:
        raise cli.UsageError(f"--keep {spec!r}: layers must increase, each once")
    return tuple(layers)


def build_parser() -> cli.Parser:
    p = cli.Parser(prog="python -m experiments.probes.cut_layers", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a fetched model's name or a model folder")
    p.add_argument("--keep", action="append", required=True, metavar="LAYERS",
                   help="a candidate layer set, e.g. 0-14, 0-13,29 or 0-28:2 (repeat)")
    p.add_argument("--states", type=int, default=64, help="demonstration turns measured (a seeded subset)")
    p.add_argument("--thinking", default="plan", help="the think-then-act answers' thinking (SFT's)")
    p.add_argument("--max-prompt-tokens", type=int, default=1024)
    p.add_argument("--max-turns", type=int, default=30, help="the searching expert's turn limit")
    p.add_argument("--kl", action="store_true", help="also the exact reverse KL of each cut to the uncut model "
                   "(a forward of the uncut model per candidate more)")
    p.add_argument("--out", required=True)
    p.add_argument("--no-progress", action="store_true")
    return p


def run(args) -> dict[str, Any]:
    import numpy as np
    from flax import nnx

    from jaxopd.machine import machine_info
    from jaxopd.methods.benchmarks import TRAIN_SPLIT, references_for, resolve_source
    from jaxopd.methods.divergence import exact_reverse_kl, response_nll
    from jaxopd.methods.sft_data import walkthrough_samples
    from jaxopd.models.folders import load_folder
    from jaxopd.models.pretrained import resolve_model_dir
    from jaxopd.models.weights import cut_layers
    from jaxopd.models.folders import load_folder_tokenizer

    candidates = [parse_keep(spec) for spec in args.keep]
    if args.states < 1:
        raise cli.UsageError(f"--states must be at least 1, got {args.states}")
    try:
        folder = resolve_model_dir(args.model)
    except (ValueError, FileNotFoundError) as e:
        raise cli.UsageError(str(e)) from None
    out = cli.check_out_dir("--out", args.out)
    started = time.time()
    base = load_folder(folder)
    for keep in candidates:
        if keep[-1] >= base.config.num_layers:
            raise cli.UsageError(f"--keep names layer {keep[-1]}; {args.model} has {base.config.num_layers} layers")
    tokenizer = load_folder_tokenizer(folder)
    source = resolve_source("alfworld", "auto", progress=not args.no_progress)
    tasks = source.tasks(TRAIN_SPLIT["alfworld"])
    references = references_for(source, tasks, workers=min(4, os.cpu_count() or 1), progress=not args.no_progress,
                                kind="searching_expert", expert_max_turns=args.max_turns)
    rng = np.random.default_rng(0)
    samples = {}
    for mode, thinking in (("full", args.thinking), ("next_action", "none")):
        pool, _ = walkthrough_samples(references, tokenizer, max_prompt_tokens=args.max_prompt_tokens,
                                      thinking=thinking, mode=mode)
        pick = sorted(rng.choice(len(pool), size=min(args.states, len(pool)), replace=False).tolist())
        samples[mode] = [pool[i] for i in pick]
    full = nnx.split(base, nnx.Param)
    rows = [{"keep": "all", "layers": base.config.num_layers,
             "nll": {m: response_nll(full, s) for m, s in samples.items()},
             "reverse_kl_to_base": {m: 0.0 for m in samples} if args.kl else None}]
    for spec, keep in zip(args.keep, candidates):
        cut = nnx.split(cut_layers(base, keep), nnx.Param)
        row = {"keep": spec, "layers": len(keep), "nll": {}, "reverse_kl_to_base": {} if args.kl else None}
        for mode, mode_samples in samples.items():
            row["nll"][mode] = response_nll(cut, mode_samples)
            if args.kl:
                row["reverse_kl_to_base"][mode] = exact_reverse_kl(cut, full, mode_samples)
        rows.append(row)
        if not args.no_progress:
            print(f"keep {spec}: NLL " + ", ".join(f"{m} {v:.3f}" for m, v in row["nll"].items()), flush=True)
    cut_rows = rows[1:]
    best = min(cut_rows, key=lambda r: sum(r["nll"].values()) / len(r["nll"]))
    result = {"model": args.model, "rows": rows, "best": best["keep"],
              "states": {m: len(s) for m, s in samples.items()},
              "thinking": args.thinking, "source": source.describe(),
              "command": cli.command_line("python -m experiments.probes.cut_layers"),
              "date": datetime.date.today().isoformat(), "machine": machine_info(devices=False),
              "elapsed_s": time.time() - started}
    (out / "cut_layers.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"# Which layers a student cut from {args.model} keeps", "", f"`{result['command']}`", "",
             f"- {result['date']}; {result['states']['full']} think-then-act and {result['states']['next_action']} "
             f"action-only demonstration turns of the training games (searching expert; {result['source']}); "
             "no training; NLL in nats per answer token; KL (with --kl): exact reverse KL to the uncut model", "",
             "| keep | layers | NLL think-then-act | NLL action-only | KL think-then-act | KL action-only |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        kl = r["reverse_kl_to_base"]
        kl_cells = f"{kl['full']:.3f} | {kl['next_action']:.3f}" if kl else "— | —"
        lines.append(f"| {r['keep']} | {r['layers']} | {r['nll']['full']:.3f} | {r['nll']['next_action']:.3f} | "
                     f"{kl_cells} |")
    lines += ["", f"Lowest mean NLL of a cut: **{best['keep']}**."]
    (out / "README.md").write_text("\n".join(lines) + "\n")
    return result


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return cli.run_main(lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
