"""Exact reverse KL of students to their teacher on held-out states, and each model's fit to the answers.

The states are the walkthrough turns of a split's games (default ``valid_unseen``: no training game is among them),
rendered as the rollouts render them under ``--max-prompt-tokens``, in each of ``--modes``: ``full`` (think-then-act,
the answer thinking as ``--thinking`` says) and ActFirst-OPD's action-only modes (``next_action``,
``inverse_dynamics``). For each ``--model LABEL=DIR`` and mode: KL(π_model(·|c) || π_teacher(·|c)) summed over the
whole vocabulary at every answer position c, teacher-forced, averaged over positions
(``jaxopd.methods.divergence.exact_reverse_kl``, at ``--temperature``: the rollouts' 1.0), and the model's negative
log-likelihood of the answers (``response_nll``). The teacher's own NLL is reported too.

    python -m experiments.divergence --teacher results/train/models/teacher \\
        --model student=results/train/models/student --model actfirst=results/train/models/actfirst \\
        --out runs/divergence

Writes ``divergence.json`` and ``divergence.md`` into ``--out``. Bad input is one line and exit code 2.
"""
from __future__ import annotations

import datetime
import json
import sys
import time
from typing import Any, Sequence

from jaxopd import cli

MODES = ("full", "next_action", "inverse_dynamics")


def build_parser() -> cli.Parser:
    from jaxopd.methods.benchmarks import GAME_SOURCES
    from jaxopd.methods.config import SFT_THINKING
    from jaxopd.models.logprobs import ROLLOUT_TEMPERATURE

    p = cli.Parser(prog="python -m experiments.divergence", description=__doc__.split("\n\n")[0])
    p.add_argument("--teacher", required=True, metavar="DIR", help="the teacher's model folder (or adapter folder)")
    p.add_argument("--model", action="append", required=True, metavar="LABEL=DIR",
                   help="a model folder measured against the teacher (repeat)")
    p.add_argument("--split", default="valid_unseen", help="ALFWorld split whose walkthrough turns are the states")
    p.add_argument("--games", default="auto", choices=GAME_SOURCES)
    p.add_argument("--tasks", type=int, default=None, metavar="N", help="a seeded subset of N games (default: all)")
    p.add_argument("--modes", nargs="+", default=["full", "next_action"], choices=MODES)
    p.add_argument("--thinking", default="plan", choices=SFT_THINKING, help="the full mode's answers' thinking")
    p.add_argument("--max-prompt-tokens", type=int, default=1024)
    p.add_argument("--temperature", type=float, default=ROLLOUT_TEMPERATURE)
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--no-progress", action="store_true")
    return p


def parse_models(specs: Sequence[str]) -> dict[str, str]:
    models: dict[str, str] = {}
    for spec in specs:
        label, sep, folder = spec.partition("=")
        if not sep or not label or not folder:
            raise cli.UsageError(f"--model {spec!r}: expected LABEL=DIR")
        if label in models:
            raise cli.UsageError(f"--model label {label!r} is given twice")
        cli.check_checkpoint_folder(f"--model {label}=", folder)
        models[label] = folder
    return models


def held_out_samples(source: Any, split: str, tokenizer: Any, *, tasks: int | None, modes: Sequence[str],
                     thinking: str, max_prompt_tokens: int, progress: bool) -> dict[str, list[Any]]:
    """The walkthrough turns of ``split``'s games as samples, one list per mode."""
    import os

    from jaxopd.methods.benchmarks import references_for, subset
    from jaxopd.methods.sft_data import SFT_MODE, walkthrough_samples

    chosen = subset(source.tasks(split), tasks, seed=0)
    references = references_for(source, chosen, workers=min(4, os.cpu_count() or 1), progress=progress)
    out = {}
    for mode in modes:
        samples, _ = walkthrough_samples(references, tokenizer, max_prompt_tokens=max_prompt_tokens,
                                         thinking=thinking if mode == SFT_MODE else "none", mode=mode)
        out[mode] = samples
    return out


def run(args) -> dict[str, Any]:
    from flax import nnx

    from jaxopd.machine import machine_info
    from jaxopd.methods.benchmarks import BenchmarkError, resolve_source
    from jaxopd.methods.divergence import exact_reverse_kl, response_nll
    from jaxopd.models.folders import load_folder
    from jaxopd.models.folders import load_folder_tokenizer

    cli.check_checkpoint_folder("--teacher", args.teacher)
    models = parse_models(args.model)
    if args.tasks is not None and args.tasks < 1:
        raise cli.UsageError(f"--tasks must be at least 1, got {args.tasks}")
    if not args.temperature > 0:
        raise cli.UsageError(f"--temperature must be > 0, got {args.temperature}")
    out = cli.check_out_dir("--out", args.out)
    started = time.time()
    try:
        source = resolve_source("alfworld", args.games, progress=not args.no_progress)
        if not source.tasks(args.split):
            raise cli.UsageError(f"{source.describe()} holds no {args.split} tasks")
    except (BenchmarkError, ValueError) as e:
        raise cli.UsageError(str(e)) from None
    tokenizer = load_folder_tokenizer(args.teacher)
    samples = held_out_samples(source, args.split, tokenizer, tasks=args.tasks, modes=args.modes,
                               thinking=args.thinking, max_prompt_tokens=args.max_prompt_tokens,
                               progress=not args.no_progress)
    teacher_model = load_folder(args.teacher)
    teacher = nnx.split(teacher_model, nnx.Param)
    result: dict[str, Any] = {"teacher": {"folder": args.teacher, "nll": {}}, "models": {}}
    for mode, mode_samples in samples.items():
        result["teacher"]["nll"][mode] = response_nll(teacher, mode_samples)
    for label, folder in models.items():
        model = load_folder(folder)
        if model.config.vocab_size != teacher_model.config.vocab_size:
            raise cli.UsageError(f"--model {label}: its vocabulary differs from the teacher's")
        pair = nnx.split(model, nnx.Param)
        entry = {"folder": folder, "reverse_kl": {}, "nll": {}}
        for mode, mode_samples in samples.items():
            entry["reverse_kl"][mode] = exact_reverse_kl(pair, teacher, mode_samples, temperature=args.temperature)
            entry["nll"][mode] = response_nll(pair, mode_samples)
        result["models"][label] = entry
        if not args.no_progress:
            print(f"{label}: " + ", ".join(f"{m} KL {entry['reverse_kl'][m]:.4f}" for m in samples), flush=True)
    result.update({"split": args.split, "states": {m: len(s) for m, s in samples.items()},
                   "tasks": args.tasks, "thinking": args.thinking, "temperature": args.temperature,
                   "max_prompt_tokens": args.max_prompt_tokens, "source": source.describe(),
                   "command": cli.command_line("python -m experiments.divergence"),
                   "date": datetime.date.today().isoformat(), "machine": machine_info(devices=False),
                   "elapsed_s": time.time() - started})
    (out / "divergence.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "divergence.md").write_text(markdown(result))
    return result


def markdown(result: dict[str, Any]) -> str:
    modes = list(result["states"])
    lines = ["# Exact reverse KL to the teacher on held-out states", "",
             f"`{result['command']}`", "",
             f"- states: the walkthrough turns of {result['split']} ({result['source']}): "
             + ", ".join(f"{m} {n}" for m, n in result["states"].items())
             + f"; temperature {result['temperature']}; date {result['date']}", "",
             "| model | " + " | ".join(f"KL {m}" for m in modes) + " | " + " | ".join(f"NLL {m}" for m in modes)
             + " |", "|---|" + "---:|" * (2 * len(modes))]
    lines.append("| teacher | " + " | ".join("0" for _ in modes) + " | "
                 + " | ".join(f"{result['teacher']['nll'][m]:.4f}" for m in modes) + " |")
    for label, entry in result["models"].items():
        lines.append(f"| {label} | " + " | ".join(f"{entry['reverse_kl'][m]:.4f}" for m in modes) + " | "
                     + " | ".join(f"{entry['nll'][m]:.4f}" for m in modes) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return cli.run_main(lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
