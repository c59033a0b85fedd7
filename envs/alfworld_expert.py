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
``AlfWorldEnv``) is ``jaxopd_envs.references``'s job.

Its report over a split (success and length per task type) is ``jaxopd_envs.alfworld_expert_report``.
"""
from __future__ import annotations

import dataclasses
import json
import os
import random
import threading
from pathlib import Path

from jaxopd_envs.alfworld_engine import TRAJ_FILE, AlfredEngine
from jaxopd_envs.base import EnvError, require_int
from jaxopd_envs.alfworld_import import import_alfworld

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
    import_alfworld()
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
    import_alfworld()
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

