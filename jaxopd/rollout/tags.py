"""The tags of the agent's answer format, defined once: the ``<action>…</action>`` pair of the ActFirst-OPD
prompts (App. B.1) and Qwen3's reasoning delimiters, which the tokenizer owns (they are special tokens)."""
from __future__ import annotations

from jaxopd.tokenizer import THINK_END, THINK_START

ACTION_START = "<action>"
ACTION_END = "</action>"
ACTION_STOP_STRING = ACTION_END
ACTION_FORMATS = {"tight": "", "spaced": " "}
"""What a demonstration writes between ``<action>`` and its command (SFT's ``RunConfig.sft_action_format``).
``tight`` (``<action>take cd 4 ...``, the paper's example): Qwen's tokenizer then spells the verb without a leading
space, as the admissible-action lines of the prompt do, while a thinking's "I can take cd 4 ..." spells it with one
(`` take``), so the command's first token matches the list's lines and not the thinking's last sentence.
``spaced`` (``<action> take cd 4 ...``): the command is spelled token for token as the thinking's last sentence
writes it (results/train stop 41). ``jaxopd.rollout.actions.extract_action`` strips the space."""
"""Action-only requests stop generating at this string (App. C.5: "stop at </action> or 512 tokens")."""

__all__ = ["THINK_START", "THINK_END", "ACTION_START", "ACTION_END", "ACTION_STOP_STRING", "ACTION_FORMATS"]
