"""ALFWorld's searching expert: demonstrations that find things the way an agent on an unseen game must.

A walkthrough (the planner's shortest solution) goes straight to where the object lies: it knows the hidden
state. Imitating it teaches a policy to guess, and a guess that misses has no demonstrated way on. ALFWorld
ships a hand-coded expert (``alfworld.agents.expert.handcoded_expert_tw``, the expert of its DAgger training)
that instead searches: it reads the receptacles from the room's description, visits first those where the
object class is usually found (ALFRED's receptacle priors), opens closed ones, remembers what it has seen, then
carries out the task's steps (take, clean / heat / cool, use the lamp, put). It reads the true state only for
what the observations already say (what it holds, whether the object is now hot, clean or cool).

Owns ``play_searching_expert``: one episode of that expert on a game file (its own engine, with the state's
facts) under a turn limit, with a seeded random source for the expert's few random choices, and two fixes to
the shipped expert for the engine of alfworld 0.4 (whose put command is ``move X to Y``): its bookkeeping
learns that a ``move`` put the object down (without this, a two-object task never finishes), and a repeated
action is replaced by a seeded choice of the admissible commands as the shipped ``HandCodedTWAgent`` does.
``ExpertEpisode`` is what it returns. Turning an episode into a reference trajectory (validated by replay on
``AlfWorldEnv``) is ``envs.references``'s job.

``python -m envs.alfworld_expert --split valid_unseen --max-turns 30`` plays the expert on every game of a split
and prints its success rate and length per task type (JSON with ``--out``): the ceiling of a policy that imitates it.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import random
import sys
import threading
import time
from pathlib import Path
from typing import Sequence

from envs.alfworld_engine import TRAJ_FILE, AlfredEngine
from envs.base import EnvError, require_int

__all__ = ["ExpertEpisode", "play_searching_expert", "DEFAULT_EXPERT_MAX_TURNS"]

DEFAULT_EXPERT_MAX_TURNS = 30      # ActFirst-OPD's ALFWorld episode limit (App. C)

# The shipped expert draws from the module-level ``random``; a play swaps in a seeded generator for its
# duration, so plays in several threads take turns.
_RANDOM_LOCK = threading.Lock()


@dataclasses.dataclass(frozen=True)
class ExpertEpisode:
    """The expert's actions in order, whether the game was won, and why it stopped when it was not."""

    actions: tuple[str, ...]
    won: bool
    reason: str = ""


def _task_params(game_file: Path) -> dict:
    import alfworld.gen.constants as constants

    traj_path = game_file.parent / TRAJ_FILE
    try:
        traj = json.loads(traj_path.read_text())
        params = {**traj["pddl_params"], "task_type": traj["task_type"]}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise EnvError(f"no task parameters for {str(game_file)!r}: {traj_path.name} is unreadable ({exc})") from exc
    return {k: v.lower() if v in constants.OBJECTS else v for k, v in params.items()}


def _bookkeeping_action(action: str) -> str:
    """The shipped expert tracks a put by the word ``put``; alfworld 0.4's engine says ``move X to Y``."""
    return "put " + action[len("move "):] if action.startswith("move ") else action


def play_searching_expert(game_file: str | os.PathLike, *, max_turns: int = DEFAULT_EXPERT_MAX_TURNS,
                          seed: int = 0) -> ExpertEpisode:
    """Play the searching expert on ``game_file`` for at most ``max_turns`` actions.

    The same game and seed give the same actions. A game the expert does not win in time comes back with
    ``won=False`` and the reason (turn limit, the expert gave up, or an exception inside the shipped expert's
    code); an engine failure raises ``EnvError``.
    """
    max_turns = require_int(max_turns, "max_turns", minimum=1)
    seed = require_int(seed, "seed")
    game_file = Path(game_file)
    if not game_file.is_file():
        raise ValueError(f"game file {str(game_file)!r} does not exist")
    from alfworld.agents.expert import handcoded_expert as shipped
    from alfworld.agents.expert.handcoded_expert_tw import HandCodedTWAgent

    params = _task_params(game_file)
    agent = HandCodedTWAgent(max_steps=max_turns + 1)
    try:
        policy_class = agent.get_task_policy(params)
    except Exception as exc:  # the shipped code raises a bare Exception for an unknown task type
        raise EnvError(f"the searching expert has no policy for task type {params.get('task_type')!r}") from exc
    policy = policy_class(params, max_steps=max_turns + 1)
    engine = AlfredEngine(facts=True)
    rng = random.Random(seed)
    actions: list[str] = []
    try:
        engine.load(game_file)
        state = engine.reset()
        with _RANDOM_LOCK:
            saved, shipped.random = shipped.random, rng
            try:
                policy.observe(state["feedback"])
                last = ""
                while len(actions) < max_turns:
                    try:
                        action = policy.act(state, _bookkeeping_action(last))
                    except (shipped.HandCodedAgentFailed, shipped.HandCodedAgentTimeout) as exc:
                        return ExpertEpisode(tuple(actions), False, f"the expert gave up ({type(exc).__name__})")
                    except Exception as exc:  # noqa: BLE001 - the shipped expert's own faults (e.g. an empty
                        # random.choice when the object it saw was taken): that episode is lost, not the caller
                        return ExpertEpisode(tuple(actions), False,
                                             f"the expert failed: {type(exc).__name__}: {exc}")
                    admissible = list(state["admissible_commands"])
                    if action == last or (last == "look" and action not in admissible):
                        action = rng.choice(admissible)
                    state, _, _ = engine.step(action)
                    policy.observe(state["feedback"])
                    actions.append(action)
                    last = action
                    if state["won"]:
                        return ExpertEpisode(tuple(actions), True)
            finally:
                shipped.random = saved
    finally:
        engine.close()
    return ExpertEpisode(tuple(actions), False, f"not won within {max_turns} turns")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m envs.alfworld_expert", description=__doc__.split("\n\n")[0])
    parser.add_argument("--games-root", default=None, help="an ALFWorld tree (default: as AlfWorldEnv chooses)")
    parser.add_argument("--split", default="valid_unseen")
    parser.add_argument("--max-turns", type=int, default=DEFAULT_EXPERT_MAX_TURNS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write the per-game results and the table as JSON here")
    args = parser.parse_args(argv)
    if args.max_turns < 1:
        parser.error(f"--max-turns must be at least 1, got {args.max_turns}")
    from envs.alfworld import AlfWorldEnv

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
        command = "python -m envs.alfworld_expert " + " ".join(sys.argv[1:] if argv is None else argv)
        out.write_text(json.dumps({"command": command, "split": args.split, "max_turns": args.max_turns,
                                   "seed": args.seed, "source": source, "rows": rows, "games": games}, indent=2)
                       + "\n")
        out.with_suffix(".md").write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
