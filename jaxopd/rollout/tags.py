"""The tags of the agent's answer format, defined once: the ``<action>…</action>`` pair of the ActFirst-OPD
prompts (App. B.1) and the reasoning delimiters ``<think>``/``</think>``, which the tokenizer owns (Qwen3's added
tokens; plain text for a tokenizer without them, such as a Llama's)."""
from __future__ import annotations

from jaxopd.tokenizer import THINK_END, THINK_START

ACTION_START = "<action>"
ACTION_END = "</action>"
ACTION_STOP_STRING = ACTION_END

__all__ = ["THINK_START", "THINK_END", "ACTION_START", "ACTION_END", "ACTION_STOP_STRING"]
