"""What an agent did in its ALFWorld episodes, counted from their transcripts: how far it got and how it thought.

Owns :func:`transcript_counts`, read from the episode records ``experiments.evaluate`` writes (task id, the
executed actions, the engine's answers, the model's raw answers, won): the *progress funnel* (episodes that ever
held a goal object, that cleaned / heated / cooled it where the task asks, that put one in the goal receptacle,
that won), the share of moves the engine refused (``Nothing happens.``) and of actions repeating the previous one,
of the rounds right after a refused command those that give it again (``refusal_repeated``), the episodes
*stuck* on one refused command (a run of at least ``STUCK_RUN`` identical actions in a row, each refused)
and the rounds spent in such runs,
and the *thinking fidelity*: the share of rounds whose thinking is exactly what the SFT demonstrations would have
thought in that state (``jaxopd.methods.sft_data.THINKING_RULES`` for the state the agent's own
history shows), the share that names the goal object (beyond a restated instruction), and whether the action does
what the thinking said: of the rounds whose thinking names an object in view, those whose action takes it; of those
ending on a command ("I can ..."), those whose action is it; of those saying a change ("I must cool it with a
fridge."), those whose verb and tool are the task's. And whether the thinking read the observation it answered:
of the rounds whose thinking names an object in view, those where that observation names it
(``named_true``); of the rounds answering an arrival or an opening whose rule's thinking copies the listed classes
(``sft_data.listing_sentence``, the ``task-list-*`` and ``task-tool-*`` rules), those whose thinking's first
listing is that very sentence (``listing_right``, read by ``sft_data.listing_said`` as ``demo_fit`` reads it).
Everything is read from text the agent was shown; the goal comes from the record's instruction, or from the task id
(``jaxopd_envs.alfworld_state.goal_of_task_id``) in records written before they kept it (``task-plan-here`` fidelity
needs the instruction).
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from jaxopd_envs.alfworld_state import (Goal, goal_of_task_id, objects_in_view, parse_goal, task_state,
                                        without_restated_instruction)
from jaxopd_envs.alfworld import REFUSED_FEEDBACK
from jaxopd.methods.sft_data import (THINKING_RULES, change_said, command_said, listing_said, listing_sentence,
                                     named_in_view)
from jaxopd.rollout.tags import THINK_END, THINK_START

__all__ = ["REFUSED", "STUCK_RUN", "thinking_of", "refused_runs", "episode_progress", "transcript_counts"]

REFUSED = REFUSED_FEEDBACK
"""The engine's answer to a command it does not execute (``jaxopd_envs.alfworld.REFUSED_FEEDBACK``)."""

STUCK_RUN = 5
"""An episode is *stuck* when it gives one refused command this many times in a row (2026-11: the one-sft
teacher's 61 such runs at step 2,400 were all ``go to`` a receptacle, 59 of them one the room does not have)."""


def thinking_of(answer: str) -> str | None:
    """The stripped text of an answer's thinking block, or None when the answer has none."""
    start = answer.find(THINK_START)
    if start < 0:
        return None
    end = answer.find(THINK_END, start + len(THINK_START))
    if end < 0:
        return None
    return answer[start + len(THINK_START):end].strip()


def refused_runs(actions: Sequence[str], feedback: Sequence[str]) -> list[int]:
    """Lengths of the maximal runs of one action given again and again, every time refused, in order (a lone
    refusal is a run of 1; an action that is carried out ends the run)."""
    runs: list[int] = []
    previous = None                      # the last round's action while it was refused, else None
    for action, answer in zip(actions, feedback):
        if answer.strip() != REFUSED:
            previous = None
        elif action == previous:
            runs[-1] += 1
        else:
            runs.append(1)
            previous = action
    return runs


def _goal(episode: Mapping[str, Any]) -> Goal:
    """The episode's goal from its instruction (newer records keep it), else from its task id."""
    goal = parse_goal(episode["instruction"]) if episode.get("instruction") else None
    return goal or goal_of_task_id(episode["task_id"])


def _states(episode: Mapping[str, Any]):
    goal = _goal(episode)
    actions, feedback = list(episode["actions"]), list(episode["feedback"])
    if len(actions) != len(feedback):
        raise ValueError(f"episode {episode['task_id']}: {len(actions)} actions but {len(feedback)} answers")
    # the state each round's answer was written in (after actions[:t]), then the state after the last action
    return goal, [task_state(goal, actions[:t], feedback[:t], feedback[t - 1] if t else "")
                  for t in range(len(actions) + 1)]


def episode_progress(episode: Mapping[str, Any]) -> dict[str, bool]:
    """How far one episode got: ``held`` (a goal object in hand at some turn), ``changed`` (held it cleaned,
    heated or cooled; None for tasks that change nothing), ``placed`` (put one in the goal receptacle; None for
    look tasks) and ``won``."""
    goal, states = _states(episode)
    return {"held": any(state.held for state in states),
            "changed": any(state.changed for state in states) if goal.change else None,
            "placed": any(state.placed for state in states) if goal.recep else None,
            "won": bool(episode["won"])}


def _share(count: int, total: int) -> float | None:
    return count / total if total else None


def transcript_counts(episodes: Sequence[Mapping[str, Any]], *, thinking: str = "plan") -> dict[str, Any]:
    """Counts over ``episodes`` (``evaluation.json``'s records). ``thinking`` (``state``, ``plan`` or
    ``plan-here``) is the demonstrations' rule the rounds' thinking is compared with. Shares are of the rounds,
    or of the episodes where the stage applies (``changed``: the clean / heat / cool tasks; ``placed``: all but
    look tasks)."""
    if thinking not in THINKING_RULES:
        raise ValueError(f"thinking fidelity compares with one of {tuple(THINKING_RULES)} thinking, not {thinking!r}")
    if not episodes:
        raise ValueError("no episodes to count")
    rule = THINKING_RULES[thinking]
    rounds = refused = repeated = faithful = names_goal = no_thinking = stuck = stuck_rounds = 0
    agreements = {name: [0, 0] for name in ("named_taken", "command_followed", "change_right", "refusal_repeated",
                                            "named_true", "listing_right")}
    stages = {stage: [0, 0] for stage in ("held", "changed", "placed", "won")}
    for episode in episodes:
        goal, states = _states(episode)
        actions, feedback, answers = episode["actions"], episode["feedback"], episode["answers"]
        long_runs = [run for run in refused_runs(actions, feedback) if run >= STUCK_RUN]
        stuck += bool(long_runs)
        stuck_rounds += sum(long_runs)
        for t, answer in enumerate(answers[:len(actions)]):
            rounds += 1
            refused += feedback[t].strip() == REFUSED
            repeated += t > 0 and actions[t] == actions[t - 1]
            if t > 0 and feedback[t - 1].strip() == REFUSED:
                agreements["refusal_repeated"][0] += actions[t] == actions[t - 1]
                agreements["refusal_repeated"][1] += 1
            thought = thinking_of(answer)
            if thought is None:
                no_thinking += 1
                continue
            ruled = rule(states[t])
            faithful += thought == ruled
            names_goal += goal.obj in without_restated_instruction(thought)
            action, named, command = actions[t].strip(), named_in_view(thought), command_said(thought)
            change = change_said(thought) if goal.tool else None
            for name, said, agrees in (("named_taken", named, named and action.startswith(f"take {named} from ")),
                                       ("command_followed", command, action == command),
                                       ("change_right", change, change == goal.tool)):
                if said is not None:
                    agreements[name][0] += bool(agrees)
                    agreements[name][1] += 1
            observation = feedback[t - 1] if t else ""      # what this round answered (the first: not recorded)
            if named is not None:
                agreements["named_true"][0] += named in objects_in_view(observation, named.split()[0])
                agreements["named_true"][1] += 1
            listing = listing_sentence(states[t].listed) if states[t].listed is not None else None
            if listing is not None and listing in ruled:
                agreements["listing_right"][0] += listing_said(thought) == listing
                agreements["listing_right"][1] += 1
        for stage, reached in episode_progress(episode).items():
            if reached is not None:
                stages[stage][0] += reached
                stages[stage][1] += 1
    return {"episodes": len(episodes), "rounds": rounds, "thinking": thinking,
            "refused": _share(refused, rounds), "repeated": _share(repeated, rounds),
            "thinking_faithful": _share(faithful, rounds), "thinking_names_goal": _share(names_goal, rounds),
            "no_thinking": _share(no_thinking, rounds),
            "stuck": {"episodes": stuck, "of": len(episodes), "rounds": stuck_rounds, "run": STUCK_RUN},
            **{name: {"rounds": agreed, "of": total, "share": _share(agreed, total)}
               for name, (agreed, total) in agreements.items()},
            "funnel": {stage: {"episodes": reached, "of": total, "share": _share(reached, total)}
                       for stage, (reached, total) in stages.items()}}
