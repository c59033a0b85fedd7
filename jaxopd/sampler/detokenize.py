"""Incremental detokenization and the stop-string rule of the sampler.

Owns ``IncrementalText``: a response's text built token by token with a text offset (vLLM's
``detokenize_incrementally``: decode only the last few tokens, hold text back while it ends in an
incomplete UTF-8 character), and ``completes_stop_string``, the rule "a stop string ends inside the newly
decoded text". Works with any tokenizer that has ``decode(ids) -> str``. Plain Python.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

REPLACEMENT_CHARACTER = "\ufffd"


@dataclasses.dataclass
class IncrementalText:
    """The decoded text of a growing token list, extended by ``update`` after each new token.

    ``prefix_offset``/``read_offset`` index the token list: ``text`` holds the text of ``ids[:read_offset]``;
    ``ids[prefix_offset:read_offset]`` is re-decoded as left context each step so that a character split
    across tokens (an emoji is 3-4 byte-level tokens) is emitted whole, once complete. Each update decodes
    only the tokens since ``prefix_offset``, so a response costs O(length) decoding, not O(length²).
    """

    text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0

    def update(self, tokenizer: Any, ids: Sequence[int]) -> int:
        """Extend ``text`` with what ``ids`` (the whole token list so far) adds; return the previous length of
        ``text`` (the new text is ``text[returned:]``, possibly empty while a character is incomplete)."""
        before = len(self.text)
        prefix = tokenizer.decode(ids[self.prefix_offset:self.read_offset])
        full = tokenizer.decode(ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith(REPLACEMENT_CHARACTER):
            self.text += full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(ids)
        return before


def completes_stop_string(text: str, new_from: int, stop_strings: Sequence[str]) -> bool:
    """Whether some stop string occurs in ``text`` ending after index ``new_from`` (inside the new text)."""
    if new_from >= len(text):
        return False
    return any(stop in text[max(0, new_from - len(stop) + 1):] for stop in stop_strings)


__all__ = ["IncrementalText", "completes_stop_string"]
