"""Tests of jaxopd.rollout.prompts: templates, budgeted history truncation at its boundaries, action parsing."""
from __future__ import annotations

import dataclasses

import pytest

from jaxopd.rollout.actions import extract_action
from jaxopd.rollout.prompts import (
    GENERATION_MODES,
    PromptInputs,
    prompt_messages,
    render_prompt,
)
from jaxopd.rollout.thinking import early_stop_text
from jaxopd.tokenizer import Qwen3Tokenizer


@pytest.fixture(scope="module")
def tok() -> Qwen3Tokenizer:
    return Qwen3Tokenizer()


def alfworld_inputs(num_pairs: int = 5) -> PromptInputs:
    history = [
        (f"You arrive at cabinet {i}. The cabinet {i} is closed. (obs-marker-{i})", f"open cabinet {i}")
        for i in range(1, num_pairs + 1)
    ]
    return PromptInputs(
        benchmark="alfworld",
        instruction="put some spraybottle on toilet.",
        history=history,
        observation="You open the cabinet 6. The cabinet 6 is open. In it, you see a spraybottle 2.",
        admissible_actions=("close cabinet 6", "go to toilet 1", "take spraybottle 2 from cabinet 6", "look"),
        reference_next_observation="You pick up the spraybottle 2 from the cabinet 6.",
    )


def scienceworld_inputs(num_pairs: int = 4) -> PromptInputs:
    history = [
        (f"You move to the kitchen. In the kitchen you see a stove and a sink. (obs-marker-{i})", f"look at stove {i}")
        for i in range(1, num_pairs + 1)
    ]
    return PromptInputs(
        benchmark="scienceworld",
        instruction="Your task is to boil water. First, focus on the substance.",
        history=history,
        observation="This room is called the kitchen. In it, you see: a stove, which is turned off. a sink.",
        action_templates=("activate OBJ", "move OBJ to OBJ", "focus on OBJ", "teleport to LOC", "look around"),
        objects=("stove", "sink", "water", "kitchen", "pot"),
        reference_next_observation="The stove is now activated.",
    )


def prompt_size(tok, mode, inputs, kept_pairs) -> int:
    return len(tok.apply_chat_template(
        prompt_messages(mode, inputs, kept_pairs), add_generation_prompt=True,
        enable_thinking=(mode == "full"), tokenize=True,
    ))


# ---------------------------------------------------------------------------------------------------------
# Exact templates
# ---------------------------------------------------------------------------------------------------------
ALFWORLD_SYSTEM = (
    "<|im_start|>system\nYou are an expert agent operating in the ALFRED embodied household environment. You "
    "complete a household task by issuing one text action per turn; after each action the environment describes "
    "what happened.<|im_end|>\n"
)


def test_alfworld_inverse_dynamics_prompt_exact(tok):
    inputs = alfworld_inputs(2)
    rendered = render_prompt(tok, "inverse_dynamics", inputs, max_prompt_tokens=4096)
    assert rendered.history_pairs_kept == 2
    expected = (
        ALFWORLD_SYSTEM
        + "<|im_start|>user\n"
        "Task: put some spraybottle on toilet.\n\n"
        "Prior to this step, you have taken 2 step(s). Below are the most recent 2 observation(s) and the action "
        "you took after each:\n"
        "[Step 1 observation]\nYou arrive at cabinet 1. The cabinet 1 is closed. (obs-marker-1)\n"
        "[Step 1 action] open cabinet 1\n"
        "[Step 2 observation]\nYou arrive at cabinet 2. The cabinet 2 is closed. (obs-marker-2)\n"
        "[Step 2 action] open cabinet 2\n\n"
        "You are now at step 3. Current observation:\n"
        "You open the cabinet 6. The cabinet 6 is open. In it, you see a spraybottle 2.\n\n"
        "Admissible actions in the current situation:\n"
        "close cabinet 6\ngo to toilet 1\ntake spraybottle 2 from cabinet 6\nlook\n\n"
        "Target next observation (what the environment showed after the next action in a successful "
        "demonstration of this task):\nYou pick up the spraybottle 2 from the cabinet 6.\n\n"
        "Now it is your turn to act. Choose the action that makes the environment go from the current observation "
        "to the target next observation, as exactly one action from the admissible actions listed above. Respond "
        "with only that action within <action> </action> tags, for example <action>your chosen action</action>, "
        "and nothing else.<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert rendered.text == expected
    assert rendered.token_ids == tok.encode(expected)


def test_scienceworld_full_prompt_without_history_exact(tok):
    inputs = scienceworld_inputs(0)
    rendered = render_prompt(tok, "full", inputs, max_prompt_tokens=4096)
    expected = (
        "<|im_start|>system\nYou are an expert agent operating in ScienceWorld, an interactive text environment "
        "for elementary science experiments. You complete a task by issuing one text action per turn; after each "
        "action the environment describes what happened.<|im_end|>\n"
        "<|im_start|>user\n"
        "Task: Your task is to boil water. First, focus on the substance.\n\n"
        "You are now at step 1. Current observation:\n"
        "This room is called the kitchen. In it, you see: a stove, which is turned off. a sink.\n\n"
        "Action templates (replace each placeholder such as OBJ or LOC with one of the objects below):\n"
        "activate OBJ\nmove OBJ to OBJ\nfocus on OBJ\nteleport to LOC\nlook around\n\n"
        "Objects you can refer to:\nstove\nsink\nwater\nkitchen\npot\n\n"
        "Now it is your turn to act. First reason step by step about the task, what you have done so far and the "
        "current observation. Then choose exactly one action built from the action templates and objects listed "
        "above and present it within <action> </action> tags, for example <action>your chosen action</action>."
        "<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert rendered.text == expected
    assert rendered.history_pairs_kept == 0


@pytest.mark.parametrize("make_inputs", [alfworld_inputs, scienceworld_inputs])
def test_mode_specific_content(tok, make_inputs):
    inputs = make_inputs()
    texts = {mode: render_prompt(tok, mode, inputs, 8192).text for mode in GENERATION_MODES}
    # Thinking only for full responses; action-only modes get Qwen3's empty think block.
    assert texts["full"].endswith("<|im_start|>assistant\n")
    assert texts["next_action"].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert texts["inverse_dynamics"].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # The reference next observation only in inverse-dynamics requests.
    assert inputs.reference_next_observation in texts["inverse_dynamics"]
    assert inputs.reference_next_observation not in texts["full"]
    assert inputs.reference_next_observation not in texts["next_action"]
    assert "reason step by step" in texts["full"] and "reason step by step" not in texts["next_action"]


def test_no_history_variant_of_a_later_turn(tok):
    inputs = alfworld_inputs(3)
    text = tok.apply_chat_template(prompt_messages("next_action", inputs, 0), enable_thinking=False)
    assert "Prior to this step, you have taken 3 step(s); they are not shown.\n\nYou are now at step 4." in text
    assert "obs-marker" not in text
    first_turn = tok.apply_chat_template(prompt_messages("next_action", alfworld_inputs(0), 0), enable_thinking=False)
    assert "Prior to this step" not in first_turn and "You are now at step 1." in first_turn


# ---------------------------------------------------------------------------------------------------------
# Budgeted truncation (App. B.2)
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("make_inputs", [alfworld_inputs, scienceworld_inputs])
@pytest.mark.parametrize("mode", GENERATION_MODES)
def test_truncation_boundaries(tok, make_inputs, mode):
    inputs = make_inputs()
    num_pairs = len(inputs.history)
    sizes = [prompt_size(tok, mode, inputs, k) for k in range(num_pairs + 1)]
    assert all(a < b for a, b in zip(sizes, sizes[1:]))
    for k in range(num_pairs + 1):
        exact = render_prompt(tok, mode, inputs, sizes[k])
        assert exact.history_pairs_kept == k and exact.num_tokens == sizes[k]
        if k > 0:
            under = render_prompt(tok, mode, inputs, sizes[k] - 1)
            assert under.history_pairs_kept == k - 1 and under.num_tokens == sizes[k - 1]
        for rendered in [exact] + ([under] if k > 0 else []):
            kept = rendered.history_pairs_kept
            # The newest pairs are kept, the oldest dropped; the rest of the prompt is whole.
            for i in range(1, num_pairs + 1):
                assert (f"(obs-marker-{i})" in rendered.text) == (i > num_pairs - kept)
            assert inputs.observation in rendered.text
            for line in inputs.admissible_actions + inputs.action_templates + inputs.objects:
                assert f"\n{line}\n" in rendered.text
            if mode == "inverse_dynamics":
                assert inputs.reference_next_observation in rendered.text
            assert rendered.token_ids == tok.encode(rendered.text)
    assert len(inputs.history) == num_pairs   # the stored history is untouched


@pytest.mark.parametrize("mode", GENERATION_MODES)
def test_nothing_fits_raises(tok, mode):
    inputs = alfworld_inputs(3)
    no_history = prompt_size(tok, mode, inputs, 0)
    assert render_prompt(tok, mode, inputs, no_history).history_pairs_kept == 0
    with pytest.raises(ValueError, match=f"needs {no_history} tokens without any history, over the budget of "
                                         f"{no_history - 1} tokens"):
        render_prompt(tok, mode, inputs, no_history - 1)


def test_templates_keep_different_suffixes(tok):
    # The inverse-dynamics prompt is longer, so under one budget it can keep fewer pairs than next-action.
    inputs = alfworld_inputs(5)
    budget = prompt_size(tok, "next_action", inputs, 4)
    assert render_prompt(tok, "next_action", inputs, budget).history_pairs_kept == 4
    assert render_prompt(tok, "inverse_dynamics", inputs, budget).history_pairs_kept < 4


def test_long_observation_is_never_cut(tok):
    long_observation = " ".join(f"item{i}" for i in range(800)) + " END-OF-OBSERVATION"
    inputs = dataclasses.replace(alfworld_inputs(5), observation=long_observation)
    budget = prompt_size(tok, "full", inputs, 1)
    rendered = render_prompt(tok, "full", inputs, budget)
    assert rendered.history_pairs_kept == 1 and long_observation in rendered.text


# ---------------------------------------------------------------------------------------------------------
# Input errors
# ---------------------------------------------------------------------------------------------------------
def test_input_errors(tok):
    with pytest.raises(ValueError, match="unknown benchmark 'webshop'"):
        PromptInputs("webshop", "buy", (), "page")
    with pytest.raises(ValueError, match="admissible_actions is empty"):
        PromptInputs("alfworld", "task", (), "obs")
    with pytest.raises(ValueError, match="got 1 templates, 0 objects"):
        PromptInputs("scienceworld", "task", (), "obs", action_templates=("look around",))
    with pytest.raises(ValueError, match=r"history\[0\] must be an \(observation, action\) pair"):
        PromptInputs("alfworld", "task", [("obs only",)], "obs", admissible_actions=("look",))
    with pytest.raises(ValueError, match="sequence of str, not one str"):
        PromptInputs("alfworld", "task", (), "obs", admissible_actions="look")
    no_reference = dataclasses.replace(alfworld_inputs(1), reference_next_observation=None)
    with pytest.raises(ValueError, match="need reference_next_observation"):
        render_prompt(tok, "inverse_dynamics", no_reference, 4096)
    with pytest.raises(ValueError, match="unknown generation mode 'think'"):
        render_prompt(tok, "think", alfworld_inputs(1), 4096)
    with pytest.raises(ValueError, match="max_prompt_tokens must be a positive int"):
        render_prompt(tok, "full", alfworld_inputs(1), 0)


# ---------------------------------------------------------------------------------------------------------
# Action extraction
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, expected",
    [
        ("<action>go to cabinet 1</action>", "go to cabinet 1"),
        ("<action>  take mug 1 from table 1 \n</action>", "take mug 1 from table 1"),       # whitespace stripped
        ("I will open it.\n<action>open drawer 2</action>\nThat should work.", "open drawer 2"),  # text after
        ("<action>look</action> then <action>inventory</action>", "inventory"),            # the last one wins
        ("<action>look</action> and <action>unterminated", "look"),                         # last *complete*
        ("<action><action>open fridge 1</action>", "open fridge 1"),                       # nested opener
        ("<action>take egg</action>take egg</action>", "take egg"),                        # stray closer
        ("<action>look</action>x</action> <action>take egg</action>y</action>", "take egg"),
        ("go to cabinet 1", None),                                                          # missing tag
        ("<action>go to cabinet 1", None),                                                  # unterminated
        ("go to cabinet 1</action>", None),                                                 # no opening tag
        ("<action>   </action>", None),                                                     # empty
        ("", None),
        ("<think>\nThe mug is here. <action>look</action>\n</think>\n\n<action>take mug 1</action>", "take mug 1"),
        ("<think>\nMaybe <action>look</action> would help.\n</think>\n\nI am not sure.", None),  # only in reasoning
        ("<think>\nstill thinking <action>look</action>", None),                            # reasoning never closed
    ],
)
def test_extract_action(text, expected):
    assert extract_action(text) == expected


def test_early_stop_text():
    assert early_stop_text(reasoning_ended=False).endswith("\n</think>\n\n")
    assert "</think>" not in early_stop_text(reasoning_ended=True)
    # Reasoning cut by the budget, then the inserted text, then an action: the action is found.
    response = "<think>\nlong reasoning" + early_stop_text(False) + "<action>look</action>"
    assert extract_action(response) == "look"
