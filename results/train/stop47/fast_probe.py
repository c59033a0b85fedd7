"""Can a model serve ActFirst-OPD's fast action requests? (stop 47)

For every turn of the reference (the game's solution, the reference ActFirst's rollouts are guided by) of the 48
generated ``valid_unseen`` games, the state the reference reaches there is rendered as a next-action prompt and as
an inverse-dynamics prompt (which also shows o_{t+1}^ref), exactly as ``ActFirstStrategy`` renders them; each model
answers with the strategy's action-only request (stops at ``</action>``, at most 24 new tokens) at the given
temperatures, one sample per prompt and temperature. Counted per model, mode and temperature: answers with a
parseable action, valid actions (App. B.5: admissible), and actions equal to the reference's (normalised). A
guided ActFirst rollout keeps its guidance only while the inverse-dynamics proposal reproduces the reference's
next observation, so "= reference" of the inverse-dynamics rows bounds how long guidance lasts.

    python results/train/stop47/fast_probe.py --model LABEL=HF_DIR [--model ...] --out results/train/stop47/fast_probe
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

MODES = ("next_action", "inverse_dynamics")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", required=True, metavar="LABEL=DIR")
    parser.add_argument("--split", default="valid_unseen")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--max-prompt-tokens", type=int, default=1024)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--examples", type=int, default=0, help="keep the first N misses per row (JSON)")
    parser.add_argument("--tasks", type=int, default=None, help="the first N tasks only (a smoke run)")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from envs.checks import is_alfworld_action_valid
    from envs.text import normalize_text
    from experiments.actfirst_alfworld import build_model
    from experiments.evaluate import sized_engine_config
    from jaxopd.methods.benchmarks import references_for, resolve_source
    from jaxopd.methods.sft_data import walkthrough_turns
    from jaxopd.rollout.prompts import PromptOverBudget, render_prompt
    from jaxopd.rollout.strategies.base import RolloutStrategy
    from jaxopd.rollout.tags import ACTION_STOP_STRING
    from jaxopd.rollout.trajectory import Response
    from jaxopd.sampler import Engine
    from jaxopd.sampler.types import Request, SamplingParams
    from jaxopd.tokenizer import load_tokenizer

    source = resolve_source("alfworld", "auto", progress=False)
    tasks = sorted(source.tasks(args.split), key=lambda t: t.task_id)[:args.tasks]
    references = references_for(source, tasks, progress=False)
    rows, table = [], []
    for spec in args.model:
        label, folder = spec.split("=", 1)
        tokenizer = load_tokenizer(folder)
        model, _ = build_model("student", folder)
        prompts = []                                   # (mode, prompt ids, reference action, admissible)
        for reference in references.values():
            for turn in walkthrough_turns(reference, benchmark="alfworld"):
                for mode in MODES:
                    inputs = turn.inputs
                    if mode == "inverse_dynamics":
                        following = reference.next_observation(turn.turn)
                        if following is None:
                            continue
                        inputs = dataclasses.replace(inputs, reference_next_observation=following)
                    try:
                        ids = render_prompt(tokenizer, mode, inputs, args.max_prompt_tokens).token_ids
                    except PromptOverBudget:
                        continue
                    prompts.append((mode, list(ids), turn.action, inputs.admissible_actions))
        engine = Engine(model, sized_engine_config(args.slots, args.max_prompt_tokens, args.max_new_tokens),
                        tokenizer=tokenizer).start()
        try:
            for temperature in args.temperatures:
                t0 = time.perf_counter()
                futures = [engine.submit(Request(ids, SamplingParams(
                    max_new_tokens=args.max_new_tokens, temperature=temperature, top_p=1.0, top_k=0,
                    stop_strings=(ACTION_STOP_STRING,), seed=args.seed + i), kind=RolloutStrategy.FAST_KIND))
                    for i, (_, ids, _, _) in enumerate(prompts)]
                counts = {mode: {"prompts": 0, "parsed": 0, "valid": 0, "reference": 0} for mode in MODES}
                misses = {mode: [] for mode in MODES}
                for (mode, ids, action, admissible), future in zip(prompts, futures):
                    response = Response.from_result(future.result(), mode=mode, policy_version=0,
                                                    tokenizer=tokenizer)
                    c = counts[mode]
                    c["prompts"] += 1
                    c["parsed"] += response.action is not None
                    c["valid"] += is_alfworld_action_valid(response.action, admissible)
                    same = (response.action is not None
                            and normalize_text(response.action, what="action") == normalize_text(action, what="action"))
                    c["reference"] += same
                    if not same and len(misses[mode]) < args.examples:
                        misses[mode].append({"reference": action, "answer": response.text,
                                             "prompt_tail": tokenizer.decode(ids[-120:])})
                seconds = time.perf_counter() - t0
                for mode, c in counts.items():
                    row = {"model": label, "folder": folder, "mode": mode, "temperature": temperature, **c,
                           "seconds": round(seconds, 1), "misses": misses[mode]}
                    rows.append(row)
                    n = c["prompts"]
                    table.append(f"| {label} | {mode.replace('_', ' ')} | {temperature:g} | {n} | "
                                 f"{100 * c['parsed'] / n:.1f} % | {100 * c['valid'] / n:.1f} % | "
                                 f"{100 * c['reference'] / n:.1f} % |")
                    print(table[-1], flush=True)
        finally:
            engine.stop()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fast_probe.json").write_text(json.dumps({"split": args.split, "references": len(references),
                                                     "rows": rows}, indent=1) + "\n")
    header = ("| model | request | temperature | prompts | action parsed | valid | = reference action |\n"
              "|---|---|---|---|---|---|---|\n")
    (out / "fast_probe.md").write_text(header + "\n".join(table) + "\n")
    print(f"wrote {out}/fast_probe.json and fast_probe.md")


if __name__ == "__main__":
    main()
