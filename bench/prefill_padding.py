"""An agent evaluation with the sampler's two prefill paddings side by side: powers of two against
``EngineConfig.prefill_length_step`` (``fine_length_step``: an eighth of the chunk), the same episodes token for token.

    JAXOPD_MALLOC_TUNING=1 python -m bench.prefill_padding --model results/train/models/teacher \\
        --out results/bench/prefill_padding.json

Each round runs ``experiments.evaluate`` in this process on ``--tasks`` valid_unseen games x ``--max-turns`` turns
(seed 42, the chain's 48/64-token thinking budget and 1,024-token prompts) once per padding, alternating, so machine
noise falls on both. Every shape a padding can use is compiled before its timing starts (``Engine.warmup``), so the
seconds are the evaluation's own. Reported per padding: evaluation seconds (median over rounds), the share of real
tokens among the prefilled ones (``Engine.stats``), and the tokens generated (equal: the paddings change the
arithmetic's shapes, not its results).
"""
from __future__ import annotations

import dataclasses
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from jaxopd.cli import Parser, check_checkpoint_folder, check_out_file, command_line, run_main
from jaxopd.machine import machine_info

PADDINGS = ("powers of two", "length step")


def build_parser() -> Parser:
    p = Parser(prog="python -m bench.prefill_padding", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, metavar="DIR", help="the model folder the agent plays")
    p.add_argument("--tasks", type=int, default=4, help="valid_unseen games (one episode each)")
    p.add_argument("--max-turns", type=int, default=6)
    p.add_argument("--slots", type=int, default=4, help="concurrent episodes")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--out", default="results/bench/prefill_padding.json")
    return p


def evaluate_once(args, padding: str, out: Path) -> dict[str, Any]:
    from experiments import evaluate
    from jaxopd.sampler import Engine

    options = evaluate.options_from_args(evaluate.build_parser().parse_args([
        "--student", args.model, "--split", "valid_unseen", "--seeds", "42", "--num-tasks", str(args.tasks),
        "--max-turns", str(args.max_turns), "--max-prompt-tokens", "1024", "--think-tokens", "48", "64",
        "--slots", str(args.slots), "--no-progress", "--out", str(out)]))
    source = evaluate.preflight(options)
    warmup_s = []

    def engine_factory(model, config, tokenizer):
        if padding == "powers of two":
            config = dataclasses.replace(config, prefill_length_step=None)
        engine = Engine(model, config, tokenizer=tokenizer)
        started = time.perf_counter()
        engine.warmup()
        warmup_s.append(time.perf_counter() - started)
        return engine

    result = evaluate.run_evaluation(options, source, engine_factory=engine_factory)
    meta = result["meta"]
    stats = meta["engine_stats"]
    return {"padding": padding, "evaluation_s": meta["timing_s"]["evaluation_s"], "warmup_s": warmup_s[0],
            "prefill_tokens": stats["prefill_tokens"], "prefill_padded_tokens": stats["prefill_padded_tokens"],
            "real_share": stats["prefill_tokens"] / stats["prefill_padded_tokens"],
            "generated_tokens": stats["generated_tokens"], "prefill_length_step": meta["engine_config"][
                "prefill_length_step"] if padding != "powers of two" else None}


def run(args) -> dict[str, Any]:
    check_checkpoint_folder("--model", args.model)
    check_out_file("--out", args.out)
    runs = []
    with tempfile.TemporaryDirectory() as scratch:
        for round_ in range(args.rounds):
            for padding in (PADDINGS if round_ % 2 == 0 else PADDINGS[::-1]):
                row = evaluate_once(args, padding, Path(scratch) / f"{round_}-{padding.replace(' ', '-')}")
                print(f"round {round_ + 1} {padding}: {row['evaluation_s']:.1f} s, real prefill share "
                      f"{row['real_share']:.0%}, {row['generated_tokens']} tokens generated", flush=True)
                runs.append({"round": round_, **row})
    summary = {}
    for padding in PADDINGS:
        rows = [r for r in runs if r["padding"] == padding]
        summary[padding] = {"evaluation_s": statistics.median(r["evaluation_s"] for r in rows),
                            "real_share": rows[0]["real_share"], "generated_tokens": rows[0]["generated_tokens"]}
    summary["speedup"] = summary["powers of two"]["evaluation_s"] / summary["length step"]["evaluation_s"]
    result = {"command": command_line("python -m bench.prefill_padding"), "machine": machine_info(),
              "date": time.strftime("%Y-%m-%d"), "settings": vars(args), "runs": runs, "summary": summary}
    from bench.common import write_result
    write_result(result, table(result), args.out)
    return result


def table(result: dict[str, Any]) -> str:
    s = result["summary"]
    lines = ["| padding | evaluation s (median) | real share of prefilled tokens | tokens generated |",
             "|---|---:|---:|---:|"]
    for padding in PADDINGS:
        row = s[padding]
        lines.append(f"| {padding} | {row['evaluation_s']:.1f} | {row['real_share']:.0%} | {row['generated_tokens']} |")
    lines.append(f"\nSpeed-up of the length step: {s['speedup']:.2f}x")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_main(lambda: run(args))


if __name__ == "__main__":
    raise SystemExit(main())
