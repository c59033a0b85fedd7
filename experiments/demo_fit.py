"""The teacher-forced fit of a Qwen3 folder to demonstrations of ALFWorld games: does it copy the goal object and
write the demonstrated action? (``jaxopd.methods.demo_fit``; seconds, where playing episodes takes minutes.)

    python -m experiments.demo_fit --model runs/teacher-think-hf --split valid_unseen --num-tasks 12 \\
        --thinking state --out results/train/demo_fit/teacher-think.json

Demonstrations are the searching expert's won episodes (or ``--demonstrations walkthrough``) of a seeded subset of
the split's generated games, rendered as SFT renders them (``--thinking``, ``--max-prompt-tokens``). Writes JSON and
a markdown table beside it. ``--free-running`` also lets each model write its whole answer in every demonstration
state (greedy, the paged engine, the thinking budget ``--think-tokens``), as in play: the action and thinking it
writes itself, against the demonstration's (``jaxopd.methods.demo_fit.free_running_fit``; the answers go in the JSON).
``--teacher DIR`` adds each model's exact reverse KL to that teacher on the same turns
(``jaxopd.methods.divergence.exact_reverse_kl``, at ``--kl-temperature``): how a distilled student compares with the
one it started from, on states neither trained on.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Sequence

from jaxopd.cli import Parser, UsageError, check_checkpoint_folder, check_out_file, command_line, run_main
from jaxopd.methods.config import SFT_DEMONSTRATIONS, SFT_THINKING
from jaxopd.rollout.tags import ACTION_FORMATS


def main(argv: Sequence[str] | None = None) -> int:
    parser = Parser(prog="python -m experiments.demo_fit", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, action="append", metavar="DIR",
                        help="Hugging Face model folder (repeat to compare several)")
    parser.add_argument("--split", default="valid_unseen", help="split of the generated ALFWorld games")
    parser.add_argument("--num-tasks", type=int, default=12, help="seeded subset of the split's games")
    parser.add_argument("--demonstrations", default="searching-expert", choices=SFT_DEMONSTRATIONS)
    parser.add_argument("--thinking", default="state", choices=SFT_THINKING)
    parser.add_argument("--action-format", default="tight", choices=ACTION_FORMATS,
                        help="how the demonstrations' action tag is written (train's --sft-action-format)")
    parser.add_argument("--max-prompt-tokens", type=int, default=1024)
    parser.add_argument("--max-turns", type=int, default=30, help="the searching expert's turn limit")
    parser.add_argument("--free-running", action="store_true",
                        help="also score greedy answers the model writes itself in each demonstration state")
    parser.add_argument("--think-tokens", type=int, nargs=2, default=[48, 64], metavar=("FIRST", "TOTAL"),
                        help="thinking budget of a free-running answer: first-stage and total tokens (default: the "
                             "cpu preset's 48 64)")
    parser.add_argument("--teacher", metavar="DIR",
                        help="Hugging Face model folder: also report each model's exact reverse KL to it on the turns")
    parser.add_argument("--kl-temperature", type=float, default=1.0,
                        help="temperature of both models in the reverse KL (default 1.0, the OPD rollouts')")
    parser.add_argument("--top-k", type=int, nargs="+", default=None, metavar="K",
                        help="with --teacher: also report how much of the exact reverse KL the opd-exact loss's top-K "
                             "form keeps on the turns, and the cosine of its gradient (w.r.t. the student's logits) "
                             "with the exact one's")
    parser.add_argument("--out", required=True, help="JSON file (a markdown table is written beside it)")
    args = parser.parse_args(argv)
    return run_main(lambda: run(args, argv))


def run(args, argv) -> int:
    from jaxopd_envs.alfworld_state import parse_goal
    from jaxopd.methods.benchmarks import GeneratedCounts, references_for, resolve_source, subset
    from jaxopd.methods.demo_fit import demonstration_fit
    from jaxopd.methods.sft_data import walkthrough_samples
    from jaxopd.models.weights import load_model
    from jaxopd.tokenizer import load_tokenizer

    if args.num_tasks < 1:
        raise UsageError(f"--num-tasks must be >= 1, got {args.num_tasks}")
    first, total = args.think_tokens
    if not 0 < first <= total:
        raise UsageError(f"--think-tokens needs 0 < FIRST <= TOTAL, got {first} {total}")
    for folder in args.model:
        check_model_folder("--model", folder)
    if args.teacher is not None:
        check_model_folder("--teacher", args.teacher)
    if args.top_k is not None and args.teacher is None:
        raise UsageError("--top-k compares against the teacher's distribution; pass --teacher DIR")
    if args.top_k is not None and min(args.top_k) < 1:
        raise UsageError(f"--top-k values must be >= 1, got {args.top_k}")
    if not args.kl_temperature > 0:
        raise UsageError(f"--kl-temperature must be > 0, got {args.kl_temperature}")
    out = check_out_file("--out", args.out)
    source = resolve_source("alfworld", "generated", counts=GeneratedCounts(), progress=False)
    tasks = subset(source.tasks(args.split), args.num_tasks, seed=0)
    kind = SFT_DEMONSTRATIONS[args.demonstrations]
    references = references_for(source, tasks, workers=min(4, os.cpu_count() or 1), progress=False, kind=kind,
                                expert_max_turns=args.max_turns if kind == "searching_expert" else None)
    if not references:
        raise UsageError(f"no {args.demonstrations} demonstration of the {len(tasks)} {args.split} games succeeded")
    tokenizer = load_tokenizer(args.model[0])
    samples, goals = [], []
    for reference in references.values():
        goal = parse_goal(reference.instruction)
        ref_samples, _ = walkthrough_samples([reference], tokenizer, max_prompt_tokens=args.max_prompt_tokens,
                                             thinking=args.thinking, action_format=args.action_format)
        samples += ref_samples
        goals += [goal.obj if goal else None] * len(ref_samples)
    rows, free, answers = {}, {}, {}
    from flax import nnx

    from jaxopd.methods.divergence import exact_reverse_kl, top_k_agreement
    teacher = None if args.teacher is None else nnx.split(load_model(args.teacher), nnx.Param)
    for folder in args.model:
        model = load_model(folder)
        rows[folder] = demonstration_fit(model, samples, tokenizer, goal_objects=goals)
        if teacher is not None:
            rows[folder]["exact_reverse_kl"] = exact_reverse_kl(nnx.split(model, nnx.Param), teacher, samples,
                                                                temperature=args.kl_temperature)
            if args.top_k:
                vocab = model.config.vocab_size
                if max(args.top_k) >= vocab:
                    raise UsageError(f"--top-k {max(args.top_k)} is not below the models' {vocab} ids")
                rows[folder]["top_k"] = {str(k): v for k, v in top_k_agreement(
                    nnx.split(model, nnx.Param), teacher, samples, args.top_k,
                    temperature=args.kl_temperature).items()}
        print(f"{folder}: {json.dumps(rows[folder])}", flush=True)
        if args.free_running:
            free[folder], answers[folder] = _free_running(model, samples, tokenizer, goals, args)
            print(f"{folder} free-running: {json.dumps(free[folder])}", flush=True)
    command = command_line("python -m experiments.demo_fit", argv)
    result = {"command": command, "split": args.split, "games": len(references), "turns": len(samples),
              "demonstrations": args.demonstrations, "thinking": args.thinking,
              "action_format": args.action_format, "models": rows}
    if teacher is not None:
        result.update(teacher=args.teacher, kl_temperature=args.kl_temperature)
    if args.free_running:
        result.update(think_tokens=[first, total], free_running=free, free_running_answers=answers)
    kl_head = f" exact reverse KL to `{args.teacher}` (T {args.kl_temperature:g}) |" if teacher is not None else ""
    head = ("| model | response NLL | action exact (greedy) | goal object: p(first token) | goal object exact |"
            " tool verb: p / exact |" + kl_head)
    lines = [head, "|---|---|---|---|---|---|" + ("---|" if teacher is not None else "")]

    def cell(value):
        return "—" if value is None else f"{value:.3f}"

    for folder, row in rows.items():
        lines.append(f"| `{folder}` | {row['response_nll']:.3f} | {cell(row['action_exact'])} "
                     f"({row['action_turns']} turns) | {cell(row['goal_object_prob'])} | "
                     f"{cell(row['goal_object_exact'])} ({row['goal_mentions']} mentions) | "
                     f"{cell(row['tool_verb_prob'])} / {cell(row['tool_verb_exact'])} ({row['tool_mentions']} turns) |"
                     + (f" {row['exact_reverse_kl']:.4f} |" if teacher is not None else ""))
    table = "\n".join(lines) + (f"\n\n{len(samples)} teacher-forced turns of {len(references)} `{args.split}` games "
                                f"({args.demonstrations}, thinking {args.thinking}).\n")
    table += "\nAction exact by the demonstrated action's verb (exact / turns):\n\n"
    for folder, row in rows.items():
        table += f"- `{folder}`: " + ", ".join(f"{verb} {c['exact']}/{c['turns']}"
                                              for verb, c in row["action_exact_by_verb"].items()) + "\n"
    if args.top_k:
        table += ("\nThe opd-exact loss's top-K form (`--exact-top-k K`: the teacher's K most probable ids and the "
                  "rest) on these turns: the share of the exact reverse KL it keeps / the cosine of its gradient "
                  "with the exact one's (w.r.t. the student's logits):\n\n| model | " + " | ".join(
                      f"K = {k}" for k in args.top_k) + " |\n|---|" + "---|" * len(args.top_k) + "\n")
        for folder, row in rows.items():
            table += f"| `{folder}` | " + " | ".join(
                f"{cell(row['top_k'][str(k)]['kl_fraction'])} / {cell(row['top_k'][str(k)]['gradient_cosine'])}"
                for k in args.top_k) + " |\n"
    if args.free_running:
        table += (f"\nFree-running (greedy answers the model writes itself in the same states, thinking budget "
                  f"{first} / {total}):\n\n| model | action exact | no action | thinking exact "
                  "| thinking names the goal | goal in view: said | goal not in view: claimed | listing copied |\n"
                  "|---|---|---|---|---|---|---|---|\n")
        for folder, row in free.items():
            table += (f"| `{folder}` | {row['action_exact']:.3f} | {row['no_action']:.3f} | "
                      f"{cell(row['thinking_exact'])} | {cell(row.get('thinking_names_goal'))} | "
                      f"{cell(row.get('goal_in_view_said'))} ({row.get('goal_in_view_turns', 0)} turns) | "
                      f"{cell(row.get('goal_in_view_claimed'))} | {cell(row['listing_copied'])} "
                      f"({row['listing_turns']} turns) |\n")
        table += "\nFree-running action exact by the demonstrated verb:\n\n"
        for folder, row in free.items():
            table += f"- `{folder}`: " + ", ".join(f"{verb} {c['exact']}/{c['turns']}"
                                                  for verb, c in row["action_exact_by_verb"].items()) + "\n"
    print(table)
    out.write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(table)
    print(f"wrote {out} and {out.with_suffix('.md')}")
    return 0


def check_model_folder(flag: str, folder: str) -> None:
    """``folder`` is a model checkpoint that loads: ``config.json`` of a Qwen3 or Llama model and its safetensors
    (headers read, no tensor), and a tokenizer for it; checked before any game is generated (a run folder, whose
    ``config.json`` is a training config, is refused here)."""
    from jaxopd.models.weights import CheckpointError, check_checkpoint_files
    from jaxopd.tokenizer import load_tokenizer

    check_checkpoint_folder(flag, folder)
    try:
        check_checkpoint_files(folder)
        load_tokenizer(folder)
    except (CheckpointError, OSError, ValueError) as error:
        hint = ""
        if (Path(folder).expanduser() / "checkpoints").is_dir():
            hint = " (a training run's folder: pass the model it exported with --export)"
        raise UsageError(f"{flag} {folder!r} is not a model checkpoint: {error}{hint}") from None


def _free_running(model, samples, tokenizer, goals, args):
    from .evaluate import sized_engine_config
    from jaxopd.methods.demo_fit import free_running_fit
    from jaxopd.rollout.thinking import ThinkingBudget
    from jaxopd.sampler import Engine

    first, total = args.think_tokens
    config = sized_engine_config(8, max(len(s.tokens) for s in samples), total)
    with Engine(model, config, tokenizer=tokenizer) as engine:
        return free_running_fit(engine, samples, tokenizer, goal_objects=goals,
                                budget=ThinkingBudget(first_stage_tokens=first, total_tokens=total))


if __name__ == "__main__":
    raise SystemExit(main())
