"""The tags of the agent's answer format, defined once: the ``<action>…</action>`` pair of the ActFirst-OPD
prompts (App. B.1) and the reasoning delimiters ``<think>``/``</think>``, which the tokenizer owns (Qwen3's added
tokens; plain text for a tokenizer without them, such as a Llama's)."""
from __future__ import annotations

from jaxopd.tokenizer import THINK_END, THINK_START

ACTION_START = "<action>"
ACTION_END = "</action>"
ACTION_STOP_STRING = ACTION_END
ACTION_FORMATS = ("tight", "spaced", "said")
"""How a demonstration writes its command after ``<action>`` (SFT's ``RunConfig.sft_action_format``).
``tight`` (``<action>take cd 4 ...``, the paper's example): Qwen's tokenizer then spells the verb without a leading
space, as the admissible-action lines of the prompt do, while a thinking's "I can take cd 4 ..." spells it with one
(`` take``), so the command's first token matches the list's lines and not the thinking's last sentence.
``spaced`` (``<action> take cd 4 ...``): the command is spelled token for token as the thinking's last sentence
writes it, and as the prompt's history lines (``[Step 2 action] go to shelf 1``) do.
``said``: spaced when the thinking ends on saying that very command ("I can take cd 4 from desk 1."), tight
otherwise (a search's ``go to``, which the thinking does not name, keeps the list's spelling) (measured
2026-11 on the tiny CPU teacher). ``jaxopd.rollout.actions.extract_action`` strips the space."""


__all__ = ["THINK_START", "THINK_END", "ACTION_START", "ACTION_END", "ACTION_STOP_STRING", "ACTION_FORMATS"]
