"""The one text normaliser of the project: Unicode NFKC, case folding and whitespace collapse.

Owns the normalisation that ActFirst-OPD applies to actions and observations (App. B.5 transition checks,
App. C.5 rollout metrics) and that ActionOPD's action matcher uses; environments, checks and
``jaxopd.rollout`` all import it from here (``envs/`` imports nothing of ``jaxopd/``, so it lives here).
"""
from __future__ import annotations

import unicodedata

__all__ = ["normalize_text", "normalize_lines"]


def _folded(text: str, what: str) -> str:
    if not isinstance(text, str):
        raise ValueError(f"{what} must be a str, got {type(text).__name__}")
    return unicodedata.normalize("NFKC", text).casefold()


def normalize_text(text: str, *, what: str = "text") -> str:
    """One line of canonical text: NFKC, case folding, every whitespace run (line ends included) as one
    space, no leading or trailing space. ``what`` names the argument in the ValueError for a non-str.

    App. C.5: "Text normalization uses Unicode NFKC, case folding, and whitespace normalization"; App. B.5
    normalises actions with "the same text normalization" as observations. ``normalize_text(x)`` equals
    ``" ".join(normalize_lines(x))``.
    """
    return " ".join(_folded(text, what).split())


def normalize_lines(text: str, *, what: str = "text") -> list[str]:
    """The non-empty lines of ``text`` after NFKC, case folding, line-end standardisation and whitespace
    collapse within each line (App. B.5 observation normalisation, line order kept)."""
    folded = _folded(text, what).replace("\r\n", "\n").replace("\r", "\n")
    lines = (" ".join(line.split()) for line in folded.split("\n"))
    return [line for line in lines if line]
