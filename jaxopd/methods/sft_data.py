"""Supervised fine-tuning data: demonstrations as turn-level training samples for a teacher.

A demonstration is a validated ``jaxopd_envs.references.ReferenceTrajectory``: the planner's walkthrough, or ALFWorld's
searching expert's won episode (``config.SFT_DEMONSTRATIONS`` maps ``RunConfig.sft_demonstrations`` to the kind).
The functions below say "walkthrough" for either.

Owns the teacher's target answer for one turn (:func:`response_text`: a thinking block, empty or holding
:func:`state_thinking`'s reasoning over what the prompt shows, :func:`plan_text`'s, which adds the step it
calls for, or :func:`plan_here_text`'s, which adds where the agent is, chosen by :func:`thinking_text`; and
the ``<action>`` tag, what the rollout's full think-then-act mode parses), the per-turn prompt inputs of a
reference trajectory built exactly as a live rollout builds them (:func:`walkthrough_turns`, mirroring
``RolloutStrategy.prompt_inputs``, so an SFT prompt is byte-identical to the prompt the agent sees at that
state), their tokenisation into ``train.buffer.Sample`` records under the rollout's prompt budget
(:func:`walkthrough_samples`, with its counts in :class:`WalkthroughStats`), and :class:`SFTDataset`, a
seeded per-epoch shuffle into fixed-size lists of samples that a run can resume at (epoch, batch index).

The samples train with ``LossConfig(kind="sft", temperature=1.0)`` (``jaxopd.losses.sft_loss``): the loss
mask covers the response tokens and its closing end-of-turn token, never the prompt; behaviour log-probs
are zeros (nothing was sampled) and the policy version is 0. With an action weight (``RunConfig.sft_action_weight``)
a sample's ``loss_weight`` weighs its action tag (:func:`action_token_start` on) against its thinking.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np

from jaxopd_envs.alfworld import REFUSED_FEEDBACK
from jaxopd_envs.alfworld_state import TaskState, parse_goal, task_state
from jaxopd_envs.references import ReferenceTrajectory
from jaxopd.methods.config import SFT_THINKING
from jaxopd.rollout.prompts import PromptInputs, PromptOverBudget, executed_actions_and_answers, render_prompt
from jaxopd.rollout.tags import ACTION_END, ACTION_FORMATS, ACTION_START, THINK_END, THINK_START
from jaxopd.sample import Sample

__all__ = ["SFT_MODE", "FAST_MODES", "fast_action_text",
           "response_text", "state_thinking", "state_text", "plan_text", "plan_here_text",
           "task_plan_here_text", "task_list_plan_here_text", "listing_sentence", "task_list_act_here_text",
           "tool_sentence", "tool_said", "task_tool_act_here_text",
           "refused_sentence", "task_tool_refused_act_here_text", "refused_turn", "missing_receptacle",
           "missing_turn", "REWRITTEN_TURNS", "THINKING_RULES",
           "thinking_text", "WalkthroughTurn",
           "walkthrough_turns", "WalkthroughStats", "action_token_start", "walkthrough_samples", "SFTDataset"]

SFT_MODE = "full"
"""The generation mode whose prompts SFT trains on: the full think-then-act mode of the rollouts, whose
prompt ends at the open assistant turn (thinking on), so the response starts with ``<think>``."""

FAST_MODES = ("next_action", "inverse_dynamics")
"""The action-only generation modes of ActFirst-OPD's fast requests (``rollout.prompts.GENERATION_MODES``), which
``RunConfig.sft_fast_copies`` demonstrates too: a student fine-tuned on full answers alone never learned them
(measured 2026-11 on the tiny CPU teacher)."""


def response_text(action: str, thinking: str = "", action_format: str = "tight") -> str:
    """The teacher's answer for one turn: a thinking block followed by the action tag.

    Without ``thinking``: ``<think>\\n\\n</think>\\n\\n<action>{action}</action>``, what Qwen3's chat template
    writes for an assistant turn without reasoning (the project's answer format for every model family: a Llama
    tokenizer spells the tags as plain text); with it, ``<think>\\n{thinking}\\n</think>\\n\\n<action>…``.
    ``jaxopd.rollout.actions.extract_action`` parses either back to ``action``. The end-of-turn token
    (the tokenizer's ``eos_token_id``: ``<|im_end|>`` in ChatML) follows it in a sample's ids. ``action_format``
    (``tags.ACTION_FORMATS``): ``spaced`` writes ``<action> {action}</action>``; ``said`` does so when the thinking
    ends on saying ``action`` (:func:`command_said`), else writes it ``tight``.
    """
    if action_format not in ACTION_FORMATS:
        raise ValueError(f"unknown action format {action_format!r}; expected one of {ACTION_FORMATS}")
    _check_action(action, "response_text")
    if not isinstance(thinking, str) or thinking != thinking.strip():
        raise ValueError(f"thinking must be a str without surrounding whitespace, got {thinking!r}")
    for tag in (THINK_START, THINK_END, ACTION_START, ACTION_END):
        if tag in thinking:
            raise ValueError(f"the thinking {thinking!r} contains the tag {tag!r}")
    thought = f"\n{thinking}\n" if thinking else "\n\n"
    spaced = action_format == "spaced" or (action_format == "said" and command_said(thinking) == action)
    return f"{THINK_START}{thought}{THINK_END}\n\n{ACTION_START}{' ' if spaced else ''}{action}{ACTION_END}"


def fast_action_text(action: str) -> str:
    """The answer to a fast action request: the action tag alone, ``<action>{action}</action>`` (the fast modes'
    prompt example; a chat template with a thinking switch, Qwen3's, has already closed the empty think block, and
    one without it, a Llama's, writes none). The end-of-turn token follows it in a sample's ids."""
    _check_action(action, "fast_action_text")
    return f"{ACTION_START}{action}{ACTION_END}"


def _check_action(action: str, caller: str) -> None:
    """ValueError unless ``action`` is a non-empty str without surrounding whitespace and without any tag."""
    if not isinstance(action, str):
        raise ValueError(f"{caller} expects a str action, got {type(action).__name__}")
    if not action.strip() or action != action.strip():
        raise ValueError(f"the action must be non-empty and carry no surrounding whitespace, got {action!r}")
    for tag in (THINK_START, THINK_END, ACTION_START, ACTION_END):
        if tag in action:
            raise ValueError(f"the action {action!r} contains the tag {tag!r}")


def state_thinking(inputs: PromptInputs) -> str:
    """A short reasoning over what the prompt shows, for ALFWorld demonstrations (``--sft-thinking state``).

    Read by ``jaxopd_envs.alfworld_state`` from the instruction, the executed actions with the engine's answers (the
    full history h_t) and the current observation: the goal object held (and whether it is already clean, hot or
    cool), or the object still needed and the first one in view; for two-object tasks how many are in place; for
    look tasks the lamp in view once the object is held. E.g. ``"I need a apple. I see apple 4 here."``. It is
    written by this rule, not by a model; it gives the demonstration a state to reason from and ActFirst-OPD
    thinking to skip. ``ValueError`` for an instruction of none of the six task types.
    """
    return thinking_text(inputs, "state")


def state_text(state: TaskState) -> str:
    """:func:`state_thinking`'s words for a ``TaskState`` (``jaxopd_envs.alfworld_state.task_state``)."""
    goal = state.goal
    parts = []
    if goal.count > 1 and state.placed:
        parts.append(f"{state.placed} of {goal.count} placed.")
    if state.held:
        parts.append(f"I hold {state.held}" + (f", now {goal.change}." if state.changed else "."))
        if state.lamps_in_view:
            parts.append(in_view_sentence(state.lamps_in_view[0]))
    else:
        parts.append(f"I need a {goal.obj}.")
        if state.in_view:
            parts.append(in_view_sentence(state.in_view[0]))
    return " ".join(parts)


def in_view_sentence(name: str) -> str:
    """The thinking rules' sentence for an object in view: ``"I see apple 4 here."``."""
    return f"I see {name} here."


def says_in_view(thinking: str | None, object_class: str | None) -> bool:
    """Whether ``thinking`` says (:func:`in_view_sentence`) that an object of ``object_class`` is in view."""
    return bool(thinking and object_class
                and re.search(rf"\bI see {re.escape(object_class)} \d+ here\.", thinking))


def named_in_view(thinking: str | None) -> str | None:
    """The object a thinking says is in view (:func:`in_view_sentence`, the first such sentence), or None."""
    found = re.search(r"\bI see ([a-z]+ \d+) here\.", thinking or "")
    return found.group(1) if found else None


def change_said(thinking: str | None) -> tuple[str, str] | None:
    """The (verb, tool class) of a thinking's change sentence (:func:`plan_text`: "I must cool it with a fridge."),
    or None."""
    found = re.search(r"\bI must ([a-z]+) it with a ([a-z]+)\.", thinking or "")
    return (found.group(1), found.group(2)) if found else None


def command_said(thinking: str | None) -> str | None:
    """The command a thinking ends on (``task-list-act-here``: "... I can take cup 2 from countertop 1."), or None
    (also for ``task-plan-here``'s "I can cool it here.", which names no command)."""
    found = re.search(r"\bI can (?![a-z]+ it here\.)([^.]+)\.\s*$", thinking or "")
    return found.group(1).strip() if found else None


def plan_text(state: TaskState) -> str:
    """:func:`state_text`'s state with the step it calls for next (``--sft-thinking plan``).

    What the task still asks of that state, in the instruction's and the commands' words: holding an object that
    must be cleaned, heated or cooled, the command and receptacle class that do it (``"I hold apple 4. I must cool
    it with a fridge."``, ``jaxopd_envs.alfworld_state.CHANGE_TOOLS``); once it is changed (or when the task changes
    nothing), the receptacle class it goes in (``"I hold apple 4, now cool. It goes in garbagecan."``); in a look
    task, the lamp to find (``"I hold cd 1. I need a desklamp."``). A two-object task counts its placed objects
    from the first turn (``"0 of 2 placed."``), so a count never appears in a one-object task's thinking. The
    object still needed and the first in view are said as in :func:`state_text`.
    """
    goal = state.goal
    parts = [f"{state.placed} of {goal.count} placed."] if goal.count > 1 else []
    if state.held is None:
        parts.append(f"I need a {goal.obj}.")
        if state.in_view:
            parts.append(in_view_sentence(state.in_view[0]))
    elif goal.toggle is not None:
        parts.append(f"I hold {state.held}. I need a {goal.toggle}.")
        if state.lamps_in_view:
            parts.append(in_view_sentence(state.lamps_in_view[0]))
    elif goal.tool is not None and not state.changed:
        verb, tool = goal.tool
        parts.append(f"I hold {state.held}. I must {verb} it with a {tool}.")
    else:
        parts.append(f"I hold {state.held}" + (f", now {goal.change}." if state.changed else ".")
                     + f" It goes in {goal.recep}.")
    return " ".join(parts)


def plan_here_text(state: TaskState) -> str:
    """:func:`plan_text` and where the agent is (``--sft-thinking plan-here``).

    After the plan, the receptacle the agent last arrived at, and whether the engine said it is closed (``"I hold
    mug 2. I must cool it with a fridge. I am at fridge 1."``, ``"I need a mug. I am at drawer 1. It is closed."``;
    nothing before the first arrival). The plan says what the step needs, the location whether it can be done
    here: side by side, the two pick the command's verb (``cool`` here, ``go`` elsewhere; ``open`` a closed one;
    ``take`` an object in view) and hold both names the command copies.
    """
    text = plan_text(state)
    if state.location is not None:
        text += f" I am at {state.location}." + (" It is closed." if state.location_closed else "")
    return text


def _state_of(inputs: PromptInputs, kind: str) -> TaskState:
    if inputs.benchmark != "alfworld":
        raise ValueError(f"{kind} thinking reads ALFWorld prompts, not {inputs.benchmark}")
    goal = parse_goal(inputs.instruction)
    if goal is None:
        raise ValueError(f"no ALFWorld task type matches the instruction {inputs.instruction!r}")
    actions, answers = executed_actions_and_answers(inputs.history, inputs.observation)
    return task_state(goal, actions, answers, inputs.observation)


def task_plan_here_text(state: TaskState) -> str:
    """The instruction word for word, then :func:`plan_here_text`, then the tool's command when the agent holds the
    unchanged object at a receptacle of the tool's class (``--sft-thinking task-plan-here``):
    ``"Your task is to: cool some apple and put it in garbagecan. I hold apple 1. I must cool it with a fridge. I am at
    fridge 1. It is closed. I can cool it here."``

    Why each part. Free-running, an SFT'd tiny preset's thinking named an object of the current observation, or
    copied the prompt's own instructions, instead of the goal: its copy head takes the nearest matching context.
    The instruction, restated first, is a copy with a unique anchor (``Your task is to:`` occurs once in the
    prompt), and it puts the goal's words nearest to every later copy of them. The last sentence separates the two
    commands a closed tool receptacle allows: ``open fridge 1`` (what "It is closed." asks everywhere else) and ``cool
    apple 1 with fridge 1`` (what the expert does; the engine cools through a closed door). ``ValueError`` for a goal
    without its instruction (one read from a task id)."""
    return _task_text(state, listing=False)


def listing_sentence(classes: Sequence[str]) -> str:
    """The thinking's copy of what an arrival or an opening lists: ``"Here: apple, cup."``, ``"Here: nothing."``."""
    return f"Here: {', '.join(classes) if classes else 'nothing'}."


def listing_said(text: str | None) -> str | None:
    """The first :func:`listing_sentence` ``text`` says (``"Here: apple, cup."``), or None."""
    found = re.search(r"\bHere: [a-z]+(?:, [a-z]+)*\.", text or "")
    return found.group(0) if found else None


def task_list_plan_here_text(state: TaskState) -> str:
    """:func:`task_plan_here_text` with, after the restated instruction, the object classes the engine just listed
    at an arrival or an opening (:func:`listing_sentence`; nothing in other states), ``--sft-thinking
    task-list-plan-here``: ``"Your task is to: put a clean cup in cabinet. Here: apple, cup, knife. I need a cup. I see
    cup 2 here. I am at countertop 1."``

    Why. Trained on ``task-plan-here``, teachers did not read whether the goal class is among the objects listed
    (2026-11, the tiny CPU teacher: said "I see <goal> N here." in 2 of 10 states where it is; with more take turns,
    in every one of them but also in 17 % of those where it is not): the match ran from the thinking's goal word
    to a list that sits among hundreds of prompt tokens, and a prior answered instead. Copying the list first (a
    copy from the end of the prompt, the pattern the copy warm-up trains) puts the listed classes a few tokens
    before "I need a cup.", so whether "I see" follows is a match between neighbouring words. Classes only, each
    once, to keep the thinking short; the object's number is copied from the observation as before."""
    return _task_text(state, listing=True)


def _task_text(state: TaskState, *, listing: bool, tool_sentence: bool = True) -> str:
    goal = state.goal
    if not goal.instruction:
        raise ValueError("task-plan-here thinking restates the instruction, and this goal has none "
                         "(read it with jaxopd_envs.alfworld_state.parse_goal, not goal_of_task_id)")
    text = goal.instruction
    if listing and state.listed is not None:
        text += " " + listing_sentence(state.listed)
    text += f" {plan_here_text(state)}"
    if (tool_sentence and state.held is not None and goal.tool is not None and not state.changed
            and state.location is not None and state.location.split()[0] == goal.tool[1]):
        text += f" I can {goal.tool[0]} it here."
    return text


def command_here(state: TaskState) -> str | None:
    """The command the task calls for at the agent's location, read from ``state`` alone, or None where the next
    step is elsewhere (a ``go to``) or an ``open``: ``take apple 4 from countertop 1`` (the goal object still needed
    and one in view: ``state.in_view[0]``, which :func:`expert_pick_first` makes the one the expert takes), ``use
    desklamp 1`` (a look task's object held and a lamp in view), ``cool apple 4 with fridge 1`` (the unchanged
    object held at a receptacle of its tool's class), ``move apple 4 to garbagecan 1`` (the object held, changed
    where the task asks it, at a receptacle of the goal's class). A closed receptacle takes no ``take`` nor
    ``move`` (it is opened first); the engine changes through a closed tool's door (``task_plan_here_text``)."""
    goal, location = state.goal, state.location
    if location is None:
        return None
    here = location.split()[0]
    if state.held is None:
        if state.in_view and not state.location_closed:
            return f"take {state.in_view[0]} from {location}"
        return None
    if goal.toggle is not None:
        return f"use {state.lamps_in_view[0]}" if state.lamps_in_view else None
    if goal.tool is not None and not state.changed:
        verb, tool = goal.tool
        return f"{verb} {state.held} with {location}" if here == tool else None
    if here == goal.recep and not state.location_closed:
        return f"move {state.held} to {location}"
    return None


def expert_pick_first(state: TaskState) -> TaskState:
    """``state`` with the goal objects and lamps in view listed last first: the one the searching expert takes of
    several of a class is the last the engine listed ("a pen 3, and a pen 1": ``take pen 1``; 229 of its 236 takes
    on the generated training games, against 182 for the first listed), so a thinking that names ``in_view[0]``
    names the object the demonstration acts on."""
    return dataclasses.replace(state, in_view=state.in_view[::-1], lamps_in_view=state.lamps_in_view[::-1])


def task_list_act_here_text(state: TaskState) -> str:
    """:func:`task_list_plan_here_text` ending on the command to give here, when there is one (:func:`command_here`;
    ``--sft-thinking task-list-act-here``): ``"Your task is to: put a clean cup in cabinet. Here: apple, cup, knife.
    I need a cup. I see cup 2 here. I am at countertop 1. I can take cup 2 from countertop 1."``; ``"... I hold
    apple 1. I must cool it with a fridge. I am at fridge 1. It is closed. I can cool apple 1 with fridge 1."``
    (the tool sentence of ``task-plan-here`` gives way to the command).

    Why. A ``task-list-plan-here`` teacher (tiny CPU model, 2026-11) said "I see cd 4 here." where the goal object
    lay, then took another object of the admissible list (41 of 44 such rounds in play): the action's object had to
    be found two sentences back, among the many ``take X N from R`` of the prompt. Ending the thinking on the
    command itself makes the action a copy of the span just written, and the command in the thinking copies its
    object from the sentence before it and its receptacle from the one just before (``I am at countertop 1.``). The
    object named is the one the demonstration takes (:func:`expert_pick_first`): earlier variants named the first
    listed of a class, and 54 of the expert's 236 takes on the training games took another one."""
    state = expert_pick_first(state)
    text = _task_text(state, listing=True, tool_sentence=False)
    command = command_here(state)
    return f"{text} I can {command}." if command else text


def tool_sentence(goal) -> str | None:
    """The sentence that names a change task's command verb and tool class
    (``jaxopd_envs.alfworld_state.CHANGE_TOOLS``): ``"Tool: heat it with a microwave."``; None for a task that changes
    nothing."""
    if goal.tool is None:
        return None
    verb, tool = goal.tool
    return f"Tool: {verb} it with a {tool}."


def tool_said(text: str | None) -> re.Match | None:
    """Where ``text`` says :func:`tool_sentence` (the first one): a match whose groups 1 and 2 are the verb and the
    tool class, or None."""
    return re.search(r"\bTool: ([a-z]+) it with a ([a-z]+)\.", text or "")


def task_tool_act_here_text(state: TaskState) -> str:
    """:func:`task_list_act_here_text` with :func:`tool_sentence` right after the restated instruction, in every
    turn of a task that cleans, heats or cools (``--sft-thinking task-tool-act-here``): ``"Your task is to: put a
    clean bowl in microwave. Tool: clean it with a sinkbasin. I need a bowl. I am at cabinet 3."``

    Why. A ``task-list-act-here`` teacher (tiny CPU model, 2026-11) said the wrong verb or tool in 77 of its 102
    play rounds that hold the object still to change ("put a clean bowl in microwave" → "I must heat it with a
    microwave."; after a pickup at a tool receptacle, it named that receptacle in 23 of 32 episodes). The only
    demonstrations of the instruction-to-tool map were those rounds, 194 of the 2,329 expert turns, and the tool
    word was written after several receptacle names. Here the map is written in every turn of a change task (about
    half of the corpus), three tokens after the instruction's adjective and before any receptacle of the room is
    named; the later "I must clean it with a sinkbasin." and the change command copy the verb and tool from it."""
    text = task_list_act_here_text(state)
    sentence = tool_sentence(state.goal)
    if sentence is None:
        return text
    instruction = state.goal.instruction
    return f"{instruction} {sentence}{text[len(instruction):]}"


def refused_sentence(command: str) -> str:
    """The thinking's copy of the last command when the engine refused it: ``"Refused: go to drawer 4."``."""
    return f"Refused: {command}."


def task_tool_refused_act_here_text(state: TaskState) -> str:
    """:func:`task_tool_act_here_text` with :func:`refused_sentence` after the restated instruction and the tool
    sentence, in the turn after a command the engine refused (``--sft-thinking task-tool-refused-act-here``):
    ``"Your task is to: examine the cd with the desklamp. Refused: go to drawer 4. I hold cd 1. I need a desklamp.
    I am at drawer 3. It is closed."``; the same words as ``task-tool-act-here`` in every other turn.

    Why. A 44 % teacher (tiny CPU model, 2026-11) lost 20 of its 36 episodes, and 207 of their 600 moves were
    refused, 96 of them the very command refused the turn before (``go to drawer 4`` ten times running). After a
    refusal the state is what it was, so its thinking was word for word the thinking before, and so was its command.
    Saying the refused command makes the turn after a refusal a context of its own, copied from the end of the
    prompt, whose demonstrations (the refused and missing copies, ``refused_turn`` / ``missing_turn``) never give
    that command again."""
    text = task_tool_act_here_text(state)
    if state.refused is None:
        return text
    sentence = tool_sentence(state.goal)
    head = state.goal.instruction + (f" {sentence}" if sentence else "")
    return f"{head} {refused_sentence(state.refused)}{text[len(head):]}"


THINKING_RULES = {"state": state_text, "plan": plan_text, "plan-here": plan_here_text,
                  "task-plan-here": task_plan_here_text, "task-list-plan-here": task_list_plan_here_text,
                  "task-list-act-here": task_list_act_here_text, "task-tool-act-here": task_tool_act_here_text,
                  "task-tool-refused-act-here": task_tool_refused_act_here_text}
"""The words of each ``SFT_THINKING`` value but ``none`` for a ``TaskState``: the one table SFT writes from and
``jaxopd.methods.transcripts`` compares an agent's thinking with."""


def thinking_text(inputs: PromptInputs, thinking: str) -> str:
    """What a demonstration thinks in the state of ``inputs`` under ``thinking`` (``config.SFT_THINKING``; ``none``
    thinks nothing). ``ValueError`` for another benchmark than ALFWorld or an instruction of none of the six task
    types."""
    if thinking not in SFT_THINKING:
        raise ValueError(f"unknown SFT thinking {thinking!r}; expected one of {SFT_THINKING}")
    return "" if thinking == "none" else THINKING_RULES[thinking](_state_of(inputs, thinking))


# ----------------------------------------------------------------------------------------------------------
# Turns of a reference
# ----------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class WalkthroughTurn:
    """Turn ``turn`` (1-based) of a reference: the prompt inputs the agent has in that state and the action
    the walkthrough took there."""

    task_id: str
    turn: int
    inputs: PromptInputs
    action: str


def _benchmark_of(reference: ReferenceTrajectory, benchmark: str | None) -> str:
    stored = reference.benchmark or None
    if benchmark is not None and stored is not None and stored != benchmark:
        raise ValueError(f"reference {reference.task_id} is a {stored} reference, not {benchmark}")
    resolved = stored or benchmark or "alfworld"
    if resolved != "alfworld":
        # ScienceWorld references keep no admissible actions nor objects (jaxopd_envs.references._STORE_ADMISSIBLE),
        # so the prompt of the live state cannot be rebuilt from them.
        raise ValueError(f"walkthrough prompts need the stored admissible actions of each state, which only "
                         f"ALFWorld references keep; reference {reference.task_id} is {resolved}")
    return resolved


def walkthrough_turns(reference: ReferenceTrajectory, *, benchmark: str | None = None) -> list[WalkthroughTurn]:
    """One record per turn t = 1..T of ``reference``: its ``PromptInputs`` and the walkthrough action a_t.

    Built as ``RolloutStrategy.prompt_inputs`` builds a live turn's inputs after the agent executed
    a_1..a_{t-1}: the episode's instruction, the history of (o_i, a_i) pairs for i < t (observation texts, the
    executed action strings), the current observation o_t and its admissible actions (no reference next
    observation: the full mode does not show one). ``benchmark`` defaults to the reference's own (only
    ALFWorld references store the admissible actions a prompt needs).
    """
    if not isinstance(reference, ReferenceTrajectory):
        raise ValueError(f"walkthrough_turns takes a ReferenceTrajectory, got {type(reference).__name__}")
    benchmark = _benchmark_of(reference, benchmark)
    if not reference.records:
        raise ValueError(f"reference {reference.task_id} was stored without observation records "
                         "(the admissible actions of each state)")
    if not reference.instruction:
        raise ValueError(f"reference {reference.task_id} has no instruction")
    turns = []
    for index, action in enumerate(reference.actions):
        record = reference.records[index]
        if record.done:
            raise ValueError(f"reference {reference.task_id}: the episode is over before its turn {index + 1}")
        inputs = PromptInputs(benchmark=benchmark, instruction=reference.instruction,
                              history=tuple(zip(reference.observations[:index], reference.actions[:index])),
                              observation=record.text, admissible_actions=record.admissible_actions,
                              action_templates=record.action_templates)
        turns.append(WalkthroughTurn(task_id=reference.task_id, turn=index + 1, inputs=inputs, action=action))
    return turns


def is_take_turn(turn: WalkthroughTurn) -> bool:
    """The demonstrated action takes an object: the goal object is in view (the thinking says "I see X here")."""
    return turn.action.startswith("take ")


def is_arrival_turn(turn: WalkthroughTurn) -> bool:
    """The previous action went to or opened a receptacle: the observation has just listed what lies there, and the
    answer decides whether the goal object is among it ("I see X here." and ``take``, or on to the next place)."""
    return bool(turn.inputs.history) and turn.inputs.history[-1][1].startswith(("go to ", "open "))


def is_change_turn(turn: WalkthroughTurn) -> bool:
    """The agent holds the goal object and the task still asks to clean, heat or cool it: the turns whose answer
    must turn the instruction's word into the tool's verb and class (``go to fridge 1``, ``cool apple 1 with fridge
    1``), which a tiny CPU teacher confused in play ("put a clean bowl in microwave": "I must heat it with a
    microwave.")."""
    if turn.inputs.benchmark != "alfworld":
        return False
    state = _state_of(turn.inputs, "change-turn")
    return state.held is not None and state.goal.tool is not None and not state.changed


FOCUS_TURNS = {"take": is_take_turn, "arrival": is_arrival_turn, "change": is_change_turn}


def refused_turn(turn: WalkthroughTurn) -> WalkthroughTurn | None:
    """``turn`` after one more command the engine refused: a ``go to`` the receptacle the agent stands at,
    answered "Nothing happens." (what free-running teachers did most: the tiny CPU teachers of 2026-11 refused
    58 % of their moves, and repeated the refused one in 60 % of the turns after). The history gains the pair
    (o_t, ``go to <here>``), the observation is the refusal, and the demonstrated action stays a_t: a refusal
    changes nothing, so the step the state calls for is the same. None before the first arrival (no "here"), and
    where the state read from the new inputs calls for another command at the location (:func:`command_here`): a
    ``take`` or ``use`` needs the object listed in the current observation, which the refusal replaces."""
    return _after_refused_go_to(turn, lambda inputs, here: here)


def missing_receptacle(inputs: PromptInputs, location: str) -> str:
    """The receptacle one past the last of ``location``'s class that the room has (``drawer 3`` in a room with
    drawers 1 and 2): the room's receptacles are the targets of the admissible ``go to`` commands, and the agent's
    own location."""
    recep_class = location.split()[0]
    numbers = [int(name.rsplit(" ", 1)[1]) for name in
               [location] + [a[len("go to "):] for a in inputs.admissible_actions if a.startswith("go to ")]
               if name.split()[0] == recep_class and name.rsplit(" ", 1)[1].isdigit()]
    return f"{recep_class} {max(numbers) + 1}"


def missing_turn(turn: WalkthroughTurn) -> WalkthroughTurn | None:
    """``turn`` after a ``go to`` a receptacle the room does not have, refused ("Nothing happens."): one past the
    last of the class the agent stands at (:func:`missing_receptacle`). A tiny CPU teacher (2026-11) counted on past
    the room's receptacles (``go to drawer 3`` with two drawers, ``go to garbagecan 2`` with one) and repeated the
    refused command for many turns (one episode: 22 of its 30). As :func:`refused_turn`, the demonstrated action
    stays a_t, and None before the first arrival and where the refusal hides what the next command needs."""
    return _after_refused_go_to(turn, missing_receptacle)


def _after_refused_go_to(turn: WalkthroughTurn, target: Callable[[PromptInputs, str], str]
                         ) -> WalkthroughTurn | None:
    """``turn`` after a ``go to target(inputs, location)`` answered by the refusal (None: see :func:`refused_turn`)."""
    inputs = turn.inputs
    if inputs.benchmark != "alfworld":
        return None
    before = _state_of(inputs, "refused-turn")
    if before.location is None:
        return None
    command = f"go to {target(inputs, before.location)}"
    refused = dataclasses.replace(inputs, history=(*inputs.history, (inputs.observation, command)),
                                  observation=REFUSED_FEEDBACK)
    if command_here(expert_pick_first(_state_of(refused, "refused-turn"))) != command_here(expert_pick_first(before)):
        return None
    return dataclasses.replace(turn, inputs=refused)


REWRITTEN_TURNS = {"refused": refused_turn, "missing": missing_turn}
"""The turn rewrites SFT can add copies of (``RunConfig.sft_refused_copies`` / ``sft_missing_copies``)."""
"""The turn selections SFT can oversample (``RunConfig.sft_take_copies`` / ``sft_arrival_copies`` /
``sft_change_copies``)."""


# ----------------------------------------------------------------------------------------------------------
# Samples
# ----------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class WalkthroughStats:
    """Counts of one :func:`walkthrough_samples` call.

    ``turns``: walkthrough turns seen; ``samples``: samples made; ``skipped``: turns whose prompt exceeded the
    budget even without history (``PromptOverBudget``); ``history_truncated``: samples whose prompt dropped
    some of the history; ``prompt_tokens`` / ``response_tokens``: totals over the samples (a response counts
    its end-of-turn token); ``max_prompt_tokens`` / ``max_response_tokens``: the longest of each.
    """

    references: int = 0
    turns: int = 0
    samples: int = 0
    skipped: int = 0
    history_truncated: int = 0
    prompt_tokens: int = 0
    response_tokens: int = 0
    max_prompt_tokens: int = 0
    max_response_tokens: int = 0

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.response_tokens

    def merged(self, other: "WalkthroughStats") -> "WalkthroughStats":
        """The counts of both calls together (sums; the longest of each)."""
        longest = ("max_prompt_tokens", "max_response_tokens")
        return WalkthroughStats(**{f.name: (max if f.name in longest else int.__add__)(getattr(self, f.name),
                                                                                       getattr(other, f.name))
                                   for f in dataclasses.fields(self)})

    @property
    def mean_prompt_tokens(self) -> float:
        return self.prompt_tokens / self.samples if self.samples else 0.0

    @property
    def mean_response_tokens(self) -> float:
        return self.response_tokens / self.samples if self.samples else 0.0

    def as_dict(self) -> dict[str, float]:
        return {**dataclasses.asdict(self), "tokens": self.tokens, "mean_prompt_tokens": self.mean_prompt_tokens,
                "mean_response_tokens": self.mean_response_tokens}


def _reference_list(references: Mapping[str, ReferenceTrajectory] | Iterable[ReferenceTrajectory]
                    ) -> list[ReferenceTrajectory]:
    if isinstance(references, ReferenceTrajectory):
        return [references]
    if isinstance(references, Mapping):
        return list(references.values())
    return list(references)


def action_token_start(tokenizer, answer: str, response_ids: Sequence[int]) -> int:
    """The index in ``response_ids`` (the ids of ``answer``, a :func:`response_text`, maybe followed by the
    end-of-turn token) of the first token of the action tag: the ids of the text before ``<action>`` are a prefix of
    ``response_ids`` (the tag follows the blank line after ``</think>``, a pre-tokenisation boundary).
    ``ValueError`` when ``answer`` has no action tag or its tokenisation does not split there."""
    at = answer.find(ACTION_START)
    if at < 0:
        raise ValueError(f"answer has no {ACTION_START} tag: {answer[:80]!r}")
    head = list(tokenizer.encode(answer[:at]))
    if list(response_ids[:len(head)]) != head:
        raise ValueError(f"the tokenisation of {answer[:80]!r}... does not split at its {ACTION_START} tag")
    return len(head)


def walkthrough_samples(references: Mapping[str, ReferenceTrajectory] | Iterable[ReferenceTrajectory], tokenizer,
                        *, max_prompt_tokens: int, benchmark: str = "alfworld", thinking: str = "none",
                        keep: Callable[[WalkthroughTurn], bool] | None = None,
                        rewrite: Callable[[WalkthroughTurn], WalkthroughTurn | None] | None = None,
                        action_weight: float = 1.0, action_format: str = "tight", mode: str = SFT_MODE
                        ) -> tuple[list[Sample], WalkthroughStats]:
    """Every walkthrough turn of ``references`` as an SFT sample, and the counts.

    A sample's ids are the full-mode prompt, rendered by ``render_prompt`` under ``max_prompt_tokens`` exactly
    as a rollout renders it (oldest history pairs dropped first), followed by the ids of
    :func:`response_text` of the turn's action (thinking: ``SFT_THINKING``; ``state``, ``plan`` and ``plan-here``
    write the turn's :func:`thinking_text` into the thinking block) and the
    tokenizer's end-of-turn token (``eos_token_id``).
    ``loss_mask`` is True exactly on those response ids; ``behavior_logp`` is zeros and ``policy_version`` 0.
    A turn whose prompt does not fit even without history is skipped and counted in ``stats.skipped``.

    ``references``: a sequence of ``ReferenceTrajectory`` or a mapping of them (``load_references``); samples
    come in that order, turns in order within a reference. ``keep``: only the turns it accepts (``FOCUS_TURNS``);
    the others are not counted. ``rewrite``: each kept turn replaced by what it returns (:func:`refused_turn`), the
    turns it returns None for left out and not counted. ``action_weight`` w != 1: each sample's ``loss_weight`` is w on
    the action tag and the end-of-turn token (:func:`action_token_start` on), 1 on the thinking block
    (``RunConfig.sft_action_weight``). ``action_format``: how the action tag is written (:func:`response_text`,
    ``RunConfig.sft_action_format``).

    ``mode`` (``FAST_MODES``): the turns as ActFirst-OPD's fast action requests instead, prompts of that mode
    (Qwen3's template closes them with its empty think block) answered by the action tag alone,
    ``<action>{action}</action>``, and the end-of-turn token; ``inverse_dynamics`` prompts also show the reference's
    next observation o_{t+1}, here the demonstration's own (``ReferenceTrajectory.next_observation``). ``thinking``
    and ``action_format`` do not apply to them (``RunConfig.sft_fast_copies``).
    """
    if mode != SFT_MODE and mode not in FAST_MODES:
        raise ValueError(f"unknown SFT sample mode {mode!r}; expected {SFT_MODE!r} or one of {FAST_MODES}")
    if action_format not in ACTION_FORMATS:
        raise ValueError(f"unknown action format {action_format!r}; expected one of {ACTION_FORMATS}")
    if not (isinstance(action_weight, (int, float)) and not isinstance(action_weight, bool)
            and np.isfinite(action_weight) and action_weight > 0):
        raise ValueError(f"action_weight must be a finite number > 0, got {action_weight!r}")
    if thinking not in SFT_THINKING:
        raise ValueError(f"unknown SFT thinking {thinking!r}; expected one of {SFT_THINKING}")
    stats = WalkthroughStats()
    samples: list[Sample] = []
    end_of_turn = int(tokenizer.eos_token_id)
    for reference in _reference_list(references):
        stats.references += 1
        for turn in walkthrough_turns(reference, benchmark=benchmark):
            if keep is not None and not keep(turn):
                continue
            if rewrite is not None:
                turn = rewrite(turn)
                if turn is None:
                    continue
            stats.turns += 1
            inputs = turn.inputs
            if mode == "inverse_dynamics":
                following = reference.next_observation(turn.turn)
                if following is None:            # a reference without the outcome of its last action
                    stats.skipped += 1
                    continue
                inputs = dataclasses.replace(inputs, reference_next_observation=following)
            try:
                prompt = render_prompt(tokenizer, mode, inputs, max_prompt_tokens)
            except PromptOverBudget:
                stats.skipped += 1
                continue
            if mode == SFT_MODE:
                answer = response_text(turn.action, thinking_text(turn.inputs, thinking), action_format)
            else:
                answer = fast_action_text(turn.action)
            response = list(tokenizer.encode(answer)) + [end_of_turn]
            prompt_ids = list(prompt.token_ids)
            length = len(prompt_ids) + len(response)
            loss_mask = np.zeros(length, bool)
            loss_mask[len(prompt_ids):] = True
            loss_weight = None
            if action_weight != 1.0:
                loss_weight = loss_mask.astype(np.float32)
                loss_weight[len(prompt_ids) + action_token_start(tokenizer, answer, response):] = action_weight
            samples.append(Sample(tokens=np.asarray(prompt_ids + response, np.int32), loss_mask=loss_mask,
                                  behavior_logp=np.zeros(length, np.float32), policy_version=0,
                                  loss_weight=loss_weight))
            stats.samples += 1
            stats.history_truncated += prompt.history_pairs_kept < len(turn.inputs.history)
            stats.prompt_tokens += len(prompt_ids)
            stats.response_tokens += len(response)
            stats.max_prompt_tokens = max(stats.max_prompt_tokens, len(prompt_ids))
            stats.max_response_tokens = max(stats.max_response_tokens, len(response))
    return samples, stats


# ----------------------------------------------------------------------------------------------------------
# Epochs and batches
# ----------------------------------------------------------------------------------------------------------
class SFTDataset:
    """Samples shuffled once per epoch with a seed and cut into lists of ``batch_size`` samples.

    The order of epoch ``e`` is a permutation drawn from ``(seed, e)`` only, so ``batches(e, start=i)``
    resumes a run at batch ``i`` of epoch ``e`` with the same batches it would have seen. Each epoch covers
    every sample exactly once; its last batch holds the remainder (fewer than ``batch_size`` samples; pad it
    with ``collate_samples(batch_size=...)``: empty rows do not change the loss) unless ``drop_last``, which
    drops it (those samples then miss that epoch).

    ``group_by_length`` W > 0 serves batches of samples of similar length (HF Trainer's ``group_by_length``): the
    epoch's permutation is cut into windows of W batches, each window sorted by sample length (longest first) and cut
    into batches, and those batches are shuffled within their window (seeded by ``(seed, epoch)`` too). A batch is
    padded to its longest sample, so it pads less: on the 2,329 expert turns of the generated training games a quarter
    fewer padded tokens at W = 32 (``bench/sft_step.py``). The remainder batch is still the epoch's last.
    """

    def __init__(self, samples: Sequence[Sample], batch_size: int, *, seed: int = 0, drop_last: bool = False,
                 group_by_length: int = 0):
        samples = list(samples)
        if not samples:
            raise ValueError("SFTDataset needs at least one sample")
        if not all(isinstance(s, Sample) for s in samples):
            raise ValueError("SFTDataset holds train.buffer.Sample records only")
        if isinstance(batch_size, bool) or int(batch_size) != batch_size or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        if drop_last and batch_size > len(samples):
            raise ValueError(f"drop_last with batch_size {batch_size} > {len(samples)} samples leaves no batch")
        self.samples = samples
        self.batch_size = int(batch_size)
        if isinstance(group_by_length, bool) or int(group_by_length) != group_by_length or group_by_length < 0:
            raise ValueError(f"group_by_length must be a non-negative integer (batches per window), "
                             f"got {group_by_length!r}")
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.group_by_length = int(group_by_length)
        self._lengths = np.array([len(s) for s in samples], np.int64)

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def batches_per_epoch(self) -> int:
        full, rest = divmod(len(self.samples), self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def order(self, epoch: int) -> np.ndarray:
        """The sample indices of epoch ``epoch`` in the order they are served."""
        if isinstance(epoch, bool) or int(epoch) != epoch or epoch < 0:
            raise ValueError(f"epoch must be a non-negative integer, got {epoch!r}")
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, int(epoch)]))
        order = rng.permutation(len(self.samples))
        if not self.group_by_length:
            return order
        size = self.batch_size
        window = self.group_by_length * size
        full = len(order) // size * size              # the samples of full batches; the rest is the remainder
        grouped = []
        for start in range(0, len(order), window):
            chunk = order[start:start + window]
            chunk = chunk[np.argsort(-self._lengths[chunk], kind="stable")]
            batches = [chunk[i:i + size] for i in range(0, len(chunk), size)]
            rest = [] if start + len(chunk) <= full else [batches.pop()]   # a partial batch stays last
            grouped += [batches[i] for i in rng.permutation(len(batches))] + rest
        return np.concatenate(grouped)

    def position(self, step: int) -> tuple[int, int]:
        """(epoch, batch index) of the ``step``-th batch (0-based) of a run that started at epoch 0, batch 0."""
        if isinstance(step, bool) or int(step) != step or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        return divmod(int(step), self.batches_per_epoch)

    def batches(self, epoch: int, start: int = 0) -> Iterator[list[Sample]]:
        """The batches of epoch ``epoch`` from batch index ``start`` on."""
        order = self.order(epoch)
        if isinstance(start, bool) or int(start) != start or not 0 <= start <= self.batches_per_epoch:
            raise ValueError(f"start must lie in [0, {self.batches_per_epoch}], got {start!r}")
        for index in range(int(start), self.batches_per_epoch):
            chosen = order[index * self.batch_size:(index + 1) * self.batch_size]
            yield [self.samples[i] for i in chosen]
