"""Agent prompts of the ActFirst-OPD generation modes for ALFWorld and ScienceWorld.

Owns the per-benchmark templates of the three modes (full think-then-act, next-action prediction,
reference-conditioned inverse dynamics; paper Section 4 and App. B.1) and their rendering through the model's
chat template under a prompt-token budget with oldest-pair-first history truncation (App. B.2). The answer's
tags are in :mod:`jaxopd.rollout.tags`, its parsing in :mod:`jaxopd.rollout.actions`, budgeted thinking
(App. B.3) in :mod:`jaxopd.rollout.thinking`.
"""
from __future__ import annotations

import dataclasses
from typing import Literal, Sequence

from jaxopd.rollout.tags import ACTION_END, ACTION_START
from jaxopd.tokenizer import Tokenizer

GenerationMode = Literal["full", "next_action", "inverse_dynamics"]
GENERATION_MODES: tuple[str, ...] = ("full", "next_action", "inverse_dynamics")
BENCHMARKS: tuple[str, ...] = ("alfworld", "scienceworld")

_SYSTEM_PROMPTS = {
    "alfworld": (
        "You are an expert agent operating in the ALFRED embodied household environment. You complete a "
        "household task by issuing one text action per turn; after each action the environment describes "
        "what happened."
    ),
    "scienceworld": (
        "You are an expert agent operating in ScienceWorld, an interactive text environment for elementary "
        "science experiments. You complete a task by issuing one text action per turn; after each action the "
        "environment describes what happened."
    ),
}

_CHOICE_PHRASES = {
    "alfworld": "exactly one action from the admissible actions listed above",
    "scienceworld": "exactly one action built from the action templates and objects listed above",
}


@dataclasses.dataclass(frozen=True)
class PromptInputs:
    """Everything a prompt is made from at turn t, as plain text (no environment objects).

    ``history`` is the full stored record h_t of (observation o_i, executed action a_i) pairs, oldest first;
    rendering drops pairs from its own copy, never from this one. ALFWorld needs ``admissible_actions``;
    ScienceWorld needs ``action_templates`` and ``objects``. ``reference_next_observation`` (o_{t+1}^ref) is
    shown by the inverse-dynamics mode only and ignored by the others, so one ``PromptInputs`` serves all
    three requests of a turn.
    """

    benchmark: str
    instruction: str
    history: Sequence[tuple[str, str]]
    observation: str
    admissible_actions: Sequence[str] = ()
    action_templates: Sequence[str] = ()
    objects: Sequence[str] = ()
    reference_next_observation: str | None = None

    def __post_init__(self) -> None:
        if self.benchmark not in BENCHMARKS:
            raise ValueError(f"unknown benchmark {self.benchmark!r}; expected one of {BENCHMARKS}")
        for name in ("instruction", "observation"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a str, got {type(getattr(self, name)).__name__}")
        history = tuple(tuple(pair) for pair in self.history)
        for index, pair in enumerate(history):
            if len(pair) != 2 or not all(isinstance(part, str) for part in pair):
                raise ValueError(f"history[{index}] must be an (observation, action) pair of str, got {pair!r}")
        object.__setattr__(self, "history", history)
        for name in ("admissible_actions", "action_templates", "objects"):
            values = getattr(self, name)
            if isinstance(values, str):
                raise ValueError(f"{name} must be a sequence of str, not one str")
            values = tuple(values)
            if not all(isinstance(v, str) for v in values):
                raise ValueError(f"{name} must hold only str")
            object.__setattr__(self, name, values)
        if self.benchmark == "alfworld" and not self.admissible_actions:
            raise ValueError("ALFWorld prompts need the current admissible actions (admissible_actions is empty)")
        if self.benchmark == "scienceworld" and not (self.action_templates and self.objects):
            raise ValueError(
                "ScienceWorld prompts need action_templates and objects "
                f"(got {len(self.action_templates)} templates, {len(self.objects)} objects)"
            )
        if self.reference_next_observation is not None and not isinstance(self.reference_next_observation, str):
            raise ValueError("reference_next_observation must be a str or None")

    @property
    def step(self) -> int:
        """The current turn t (1-based): one more than the number of executed actions."""
        return len(self.history) + 1


def executed_actions_and_answers(history: Sequence[tuple[str, str]], observation: str
                                 ) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The executed actions of a stored history h_t of (o_i, a_i) pairs and the environment's answer to each:
    the answer to a_i is o_{i+1}, the next pair's observation, or ``observation`` (the current one) for the last."""
    actions = tuple(action for _, action in history)
    answers = tuple(seen for seen, _ in history[1:]) + ((observation,) if history else ())
    return actions, answers


@dataclasses.dataclass(frozen=True)
class RenderedPrompt:
    """A chat-formatted prompt ready for the sampler, and how much history survived the budget."""

    token_ids: list[int]
    text: str
    history_pairs_kept: int

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


# ----------------------------------------------------------------------------------------------------------
# Templates
# ----------------------------------------------------------------------------------------------------------
def _history_section(inputs: PromptInputs, kept_pairs: int) -> str:
    previous_steps = len(inputs.history)
    if previous_steps == 0:
        return ""
    if kept_pairs == 0:   # the no-history variant of a later turn
        return f"Prior to this step, you have taken {previous_steps} step(s); they are not shown.\n\n"
    lines = [
        f"Prior to this step, you have taken {previous_steps} step(s). Below are the most recent "
        f"{kept_pairs} observation(s) and the action you took after each:"
    ]
    first_step = previous_steps - kept_pairs + 1
    for offset, (observation, action) in enumerate(inputs.history[previous_steps - kept_pairs:]):
        step = first_step + offset
        lines.append(f"[Step {step} observation]\n{observation}\n[Step {step} action] {action}")
    return "\n".join(lines) + "\n\n"


def _admissible_section(inputs: PromptInputs) -> str:
    if inputs.benchmark == "alfworld":
        return "Admissible actions in the current situation:\n" + "\n".join(inputs.admissible_actions) + "\n\n"
    return (
        "Action templates (replace each placeholder such as OBJ or LOC with one of the objects below):\n"
        + "\n".join(inputs.action_templates)
        + "\n\nObjects you can refer to:\n"
        + "\n".join(inputs.objects)
        + "\n\n"
    )


def _instruction_section(mode: str, inputs: PromptInputs) -> str:
    choice = _CHOICE_PHRASES[inputs.benchmark]
    if mode == "full":
        return (
            "Now it is your turn to act. First reason step by step about the task, what you have done so far "
            f"and the current observation. Then choose {choice} and present it within {ACTION_START} "
            f"{ACTION_END} tags, for example {ACTION_START}your chosen action{ACTION_END}."
        )
    if mode == "next_action":
        return (
            f"Now it is your turn to act. Choose {choice} as your next action. Respond with only that action "
            f"within {ACTION_START} {ACTION_END} tags, for example {ACTION_START}your chosen action"
            f"{ACTION_END}, and nothing else."
        )
    return (
        "Now it is your turn to act. Choose the action that makes the environment go from the current "
        f"observation to the target next observation, as {choice}. Respond with only that action within "
        f"{ACTION_START} {ACTION_END} tags, for example {ACTION_START}your chosen action{ACTION_END}, "
        "and nothing else."
    )


def prompt_messages(mode: GenerationMode, inputs: PromptInputs, kept_pairs: int) -> list[dict[str, str]]:
    """The system and user messages of ``mode`` keeping the newest ``kept_pairs`` history pairs.

    ``kept_pairs == 0`` gives the no-history variant. The user message holds, in order: the task
    instruction, the retained observation–action history, the current observation, the benchmark's
    admissible-action information, the reference next observation (inverse dynamics only) and the
    mode's answer-format instruction.
    """
    _check_mode(mode)
    if not 0 <= kept_pairs <= len(inputs.history):
        raise ValueError(f"kept_pairs={kept_pairs} outside [0, {len(inputs.history)}] (history length)")
    if mode == "inverse_dynamics" and inputs.reference_next_observation is None:
        raise ValueError("inverse_dynamics prompts need reference_next_observation (o_{t+1}^ref); it is None")
    parts = [
        f"Task: {inputs.instruction}\n\n",
        _history_section(inputs, kept_pairs),
        f"You are now at step {inputs.step}. Current observation:\n{inputs.observation}\n\n",
        _admissible_section(inputs),
    ]
    if mode == "inverse_dynamics":
        parts.append(
            "Target next observation (what the environment showed after the next action in a successful "
            f"demonstration of this task):\n{inputs.reference_next_observation}\n\n"
        )
    parts.append(_instruction_section(mode, inputs))
    return [
        {"role": "system", "content": _SYSTEM_PROMPTS[inputs.benchmark]},
        {"role": "user", "content": "".join(parts)},
    ]


def _check_mode(mode: str) -> None:
    if mode not in GENERATION_MODES:
        raise ValueError(f"unknown generation mode {mode!r}; expected one of {GENERATION_MODES}")


def uses_thinking(mode: GenerationMode) -> bool:
    """Full responses reason; action-only modes do not. With a template that has a thinking switch (Qwen3's:
    ``Tokenizer.thinking_switch``) this is its ``enable_thinking``, and action-only prompts end in the empty think
    block it writes; other templates (a Llama's ChatML) have no such switch, and every prompt ends at the open
    assistant turn (the instruction asks action-only answers for the action tag alone)."""
    _check_mode(mode)
    return mode == "full"


# ----------------------------------------------------------------------------------------------------------
# Rendering under a budget (App. B.2)
class PromptOverBudget(ValueError):
    """Even the no-history prompt exceeds the prompt budget (App. B.2: nothing protected is cut)."""


def render_prompt(
    tokenizer: Tokenizer, mode: GenerationMode, inputs: PromptInputs, max_prompt_tokens: int
) -> RenderedPrompt:
    """Render ``mode``'s prompt in the chat format with as much recent history as fits ``max_prompt_tokens``.

    Tokens are counted after the chat template (generation prompt included; for action-only modes, the empty
    think block too where the template writes one: ``uses_thinking``). Starting from the whole history, the oldest
    complete observation–action pair is dropped and the prompt re-rendered until it fits or no history remains;
    the instruction, current observation, admissible-action information and reference observation are never cut.
    ValueError when even the no-history prompt is over budget. Cost: one render + encode per dropped pair.
    """
    _check_mode(mode)
    if isinstance(max_prompt_tokens, bool) or not isinstance(max_prompt_tokens, int) or max_prompt_tokens <= 0:
        raise ValueError(f"max_prompt_tokens must be a positive int, got {max_prompt_tokens!r}")
    enable_thinking = uses_thinking(mode)
    for kept_pairs in range(len(inputs.history), -1, -1):
        text = tokenizer.apply_chat_template(
            prompt_messages(mode, inputs, kept_pairs),
            add_generation_prompt=True,
            enable_thinking=enable_thinking,
            tokenize=False,
        )
        token_ids = tokenizer.encode(text)
        if len(token_ids) <= max_prompt_tokens:
            return RenderedPrompt(token_ids=token_ids, text=text, history_pairs_kept=kept_pairs)
    raise PromptOverBudget(
        f"the {mode} prompt for {inputs.benchmark} needs {len(token_ids)} tokens without any history, over the "
        f"budget of {max_prompt_tokens} tokens (the current observation, admissible-action information"
        f"{' and reference observation' if mode == 'inverse_dynamics' else ''} are never cut)"
    )
