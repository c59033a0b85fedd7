"""How well ALFWorld's searching expert plays a split: its success rate and length per task type.

``python -m jaxopd_envs.alfworld_expert_report --split valid_unseen --max-turns 30`` plays the expert
(``jaxopd_envs.alfworld_expert``) on every game of the split and prints a markdown table (JSON and the table with
``--out``): the ceiling of a policy that imitates it. A module of its own because it needs ``jaxopd_envs.alfworld``
(the games of a split), which itself uses the expert.
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path
from typing import Sequence

from jaxopd_envs.alfworld_expert import DEFAULT_EXPERT_MAX_TURNS

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxopd_envs.alfworld_expert_report",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--games-root", default=None, help="an ALFWorld tree (default: as AlfWorldEnv chooses)")
    parser.add_argument("--split", default="valid_unseen")
    parser.add_argument("--max-turns", type=int, default=DEFAULT_EXPERT_MAX_TURNS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write the per-game results and the table as JSON here")
    args = parser.parse_args(argv)
    if args.max_turns < 1:
        parser.error(f"--max-turns must be at least 1, got {args.max_turns}")
    from jaxopd_envs.alfworld import AlfWorldEnv

    start = time.perf_counter()
    with AlfWorldEnv(args.games_root) as env:
        try:
            tasks = env.tasks(args.split)
        except ValueError as exc:
            parser.error(str(exc))
        games = []
        for task in tasks:
            episode = env.searching_expert_actions(task, max_turns=args.max_turns, seed=args.seed)
            games.append({"task_id": task.task_id, "task_type": task.task_type, "won": episode.won,
                          "turns": len(episode.actions), "walkthrough_turns": len(env.walkthrough(task)),
                          "reason": episode.reason})
        source = f"{env.source} games under {env.game_root}"
    by_type = collections.defaultdict(list)
    for game in games:
        by_type[game["task_type"]].append(game)
    rows = []
    for task_type, group in sorted(by_type.items()) + [("all", games)]:
        won = [g for g in group if g["won"]]
        rows.append({"task_type": task_type, "games": len(group), "won": len(won),
                     "success_rate": len(won) / len(group),
                     "mean_turns_won": sum(g["turns"] for g in won) / len(won) if won else None,
                     "mean_walkthrough_turns": sum(g["walkthrough_turns"] for g in group) / len(group)})
    table = (f"Searching expert on {args.split} ({source}), at most {args.max_turns} turns, seed {args.seed}\n\n"
             "| task type | games | won | success | turns (won games) | walkthrough turns |\n"
             "|---|---:|---:|---:|---:|---:|\n")
    for row in rows:
        turns = "—" if row["mean_turns_won"] is None else f"{row['mean_turns_won']:.1f}"
        table += (f"| {row['task_type']} | {row['games']} | {row['won']} | {100 * row['success_rate']:.1f} % "
                  f"| {turns} | {row['mean_walkthrough_turns']:.1f} |\n")
    print(table)
    print(f"{len(games)} games in {time.perf_counter() - start:.0f} s")
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        command = "python -m jaxopd_envs.alfworld_expert_report " + " ".join(sys.argv[1:] if argv is None else argv)
        out.write_text(json.dumps({"command": command, "split": args.split, "max_turns": args.max_turns,
                                   "seed": args.seed, "source": source, "rows": rows, "games": games}, indent=2)
                       + "\n")
        out.with_suffix(".md").write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
