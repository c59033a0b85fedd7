"""The tags of the agent's answer format, defined once: the ``<action>…</action>`` pair of the ActFirst-OPD
prompts (App. B.1) and Qwen3's reasoning delimiters, which the tokenizer owns (they are special tokens)."""
from __future__ import annotations

from jaxopd.tokenizer import THINK_END, THINK_START

ACTION_START = "<action>"
ACTION_END = "</action>"
ACTION_STOP_STRING = ACTION_END
"""Action-only requests stop generating at this string (App. C.5: "stop at </action> or 512 tokens")."""

__all__ = ["THINK_START", "THINK_END", "ACTION_START", "ACTION_END", "ACTION_STOP_STRING"]
