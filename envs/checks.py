"""Transition consistency checks of the ActFirst-OPD paper, App. B.5, for ALFWorld and ScienceWorld.

Owns the observation/action text normalisation used to compare an executed transition with its
reference counterpart, and the per-benchmark rules that decide whether reference guidance may
continue. Each rule below quotes the sentence of App. B.5 it implements.

App. B.5, common part: "Retaining reference guidance requires a valid action, agreement of the
[student]'s termination flag with the reference, and the benchmark-specific conditions below. The
generated action need not equal the reference action."
"""
from __future__ import annotations

import dataclasses
import re
import unicodedata
from typing import Any, Iterable, Mapping

__all__ = [
    "TransitionCheck",
    "TransitionSide",
    "normalize_text_line",
    "normalize_observation",
    "normalize_action",
    "normalize_scienceworld_observation",
    "split_scienceworld_enumeration",
    "normalized_action_set",
    "is_alfworld_action_valid",
    "is_scienceworld_action_valid",
    "check_alfworld_transition",
    "check_scienceworld_transition",
    "check_transition",
    "observation_texts_equivalent",
]

_HELP_ACTION = "help"


@dataclasses.dataclass(frozen=True)
class TransitionCheck:
    """Outcome of one transition check: ``ok`` and, when not ok, every rule that failed."""

    ok: bool
    reasons: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return self.ok


@dataclasses.dataclass(frozen=True)
class TransitionSide:
    """The observable outcome of one transition (actual or reference) that the checks compare.

    ``envs.base.Observation`` has these attributes too, so an Observation can be passed directly;
    a mapping with these keys is accepted as well (e.g. one record of a reference cache).
    """

    text: str
    done: bool
    admissible_actions: tuple[str, ...] = ()
    action_templates: tuple[str, ...] = ()


def _as_side(value: Any, what: str) -> TransitionSide:
    if isinstance(value, TransitionSide):
        return value
    if isinstance(value, Mapping):
        get = value.get
        if "text" not in value or "done" not in value:
            raise ValueError(f"{what}: a mapping needs at least the keys 'text' and 'done', got {sorted(value)}")
    else:
        if not hasattr(value, "text") or not hasattr(value, "done"):
            raise ValueError(f"{what}: expected an Observation, TransitionSide or mapping, got {type(value).__name__}")

        def get(key, default=None, _v=value):
            return getattr(_v, key, default)
    text = get("text")
    if not isinstance(text, str):
        raise ValueError(f"{what}: 'text' must be a str, got {type(text).__name__}")
    return TransitionSide(text=text, done=bool(get("done")),
                          admissible_actions=tuple(get("admissible_actions", ()) or ()),
                          action_templates=tuple(get("action_templates", ()) or ()))


# ----------------------------------------------------------------------------------------------
# Normalisation
# ----------------------------------------------------------------------------------------------

def normalize_text_line(line: str) -> str:
    """NFKC, case folding and whitespace collapse of a single line (leading/trailing space removed)."""
    return " ".join(unicodedata.normalize("NFKC", line).casefold().split())


def _normalized_lines(text: str) -> list[str]:
    # App. B.5: "applying Unicode NFKC normalization and case folding, standardizing line endings,
    # collapsing whitespace within each line, and removing empty lines."
    text = unicodedata.normalize("NFKC", text).casefold()
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    lines = (" ".join(line.split()) for line in text.split("\n"))
    return [line for line in lines if line]


def normalize_observation(text: str) -> str:
    """App. B.5 observation normalisation, common to all benchmarks.

    "We normalize observation text before comparison by applying Unicode NFKC normalization and case
    folding, standardizing line endings, collapsing whitespace within each line, and removing empty
    lines. The remaining line order is preserved except in ScienceWorld."
    """
    if not isinstance(text, str):
        raise ValueError(f"observation text must be a str, got {type(text).__name__}")
    return "\n".join(_normalized_lines(text))


def normalize_action(action: str) -> str:
    """Action text normalisation ("the same text normalization" as observations, on one line)."""
    if not isinstance(action, str):
        raise ValueError(f"action must be a str, got {type(action).__name__}")
    return " ".join(_normalized_lines(action))


def normalized_action_set(actions: Iterable[str]) -> frozenset[str]:
    """Actions/templates after text normalisation "with duplicates removed and order ignored"."""
    return frozenset(normalize_action(a) for a in actions)


# ---- ScienceWorld enumeration sorting ---------------------------------------------------------

_CLAUSE_START = re.compile(r"^(which|that)\b")
# "(containing ...)" with no parenthesis inside: the innermost, non-nested form.
_CONTAINING_GROUP = re.compile(r"\(containing ([^()]*)\)")
_ENUMERATION_ANCHOR = "is:"


def split_scienceworld_enumeration(enumeration: str) -> list[str]:
    """Split an object enumeration into items, as App. B.5 specifies for ScienceWorld.

    "Enumeration parsing ignores commas inside parentheses and retains clauses starting with which or
    that with their preceding item." So ``"a stove, which is off, a cup (containing a, b)"`` gives
    ``["a stove, which is off", "a cup (containing a, b)"]``.
    """
    pieces: list[str] = []
    depth = 0
    start = 0
    for i, char in enumerate(enumeration):
        if char == "(":
            depth += 1
        elif char == ")":
            depth = max(depth - 1, 0)
        elif char == "," and depth == 0:
            pieces.append(enumeration[start:i])
            start = i + 1
    pieces.append(enumeration[start:])
    items: list[str] = []
    for piece in (p.strip() for p in pieces):
        if not piece:
            continue
        if items and _CLAUSE_START.match(piece):
            items[-1] = f"{items[-1]}, {piece}"
        else:
            items.append(piece)
    return items


def _sorted_enumeration(enumeration: str) -> str:
    return ", ".join(sorted(split_scienceworld_enumeration(enumeration)))


def _is_top_level(line: str, position: int) -> bool:
    return line.count("(", 0, position) == line.count(")", 0, position)


def _sort_containing_groups(line: str) -> str:
    """Sort the items of every non-nested ``(containing ...)`` expression of a line.

    Non-nested: the expression holds no parenthesis and is not inside another parenthesis
    (a ``(containing ...)`` that is part of a nesting is left in its original order).
    """
    def replace(match: re.Match) -> str:
        if not _is_top_level(line, match.start()):
            return match.group(0)
        return f"(containing {_sorted_enumeration(match.group(1))})"

    return _CONTAINING_GROUP.sub(replace, line)


def _sort_after_last_is(line: str) -> str:
    """Sort the enumeration that follows the last ``is:`` of a line (one final period kept in place)."""
    anchor = line.rfind(_ENUMERATION_ANCHOR)
    if anchor < 0:
        return line
    head, tail = line[: anchor + len(_ENUMERATION_ANCHOR)], line[anchor + len(_ENUMERATION_ANCHOR):].strip()
    period = tail.endswith(".")
    if period:
        tail = tail[:-1]
    sorted_tail = _sorted_enumeration(tail)
    if not sorted_tail:
        return line
    return f"{head} {sorted_tail}{'.' if period else ''}"


def normalize_scienceworld_observation(text: str) -> str:
    """App. B.5 ScienceWorld observation normalisation.

    "Observation normalization additionally sorts lines and object enumerations inside non-nested
    (containing ...) expressions and after the last is: on each line. Enumeration parsing ignores
    commas inside parentheses and retains clauses starting with which or that with their preceding
    item." Applied after :func:`normalize_observation`: per line, the non-nested ``(containing ...)``
    enumerations are sorted, then the enumeration after the line's last ``is:``; finally the lines.
    """
    if not isinstance(text, str):
        raise ValueError(f"observation text must be a str, got {type(text).__name__}")
    lines = [_sort_after_last_is(_sort_containing_groups(line)) for line in _normalized_lines(text)]
    return "\n".join(sorted(lines))


# ----------------------------------------------------------------------------------------------
# Action validity
# ----------------------------------------------------------------------------------------------

def is_alfworld_action_valid(action: str | None, admissible_actions: Iterable[str]) -> bool:
    """App. B.5, ALFWorld: "An action is valid if its normalized text belongs to the current
    admissible-action set, excluding help." A missing (unparsed) action is invalid."""
    if action is None:
        return False
    normalized = normalize_action(action)
    if not normalized or normalized == _HELP_ACTION:
        return False
    return normalized in (normalized_action_set(admissible_actions) - {_HELP_ACTION})


def is_scienceworld_action_valid(action: str | None, admissible_actions: Iterable[str]) -> bool:
    """App. B.5, ScienceWorld: "An action is valid if its normalized text appears in the current
    admissible-action list." ("The full admissible-action list is used for action validation.")"""
    if action is None:
        return False
    normalized = normalize_action(action)
    return bool(normalized) and normalized in normalized_action_set(admissible_actions)


# ----------------------------------------------------------------------------------------------
# Transition checks
# ----------------------------------------------------------------------------------------------

def _termination_reason(actual: TransitionSide, reference: TransitionSide) -> list[str]:
    # App. B.5: "agreement of the [student]'s termination flag with the reference".
    if actual.done != reference.done:
        return [f"termination flag differs: actual done={actual.done}, reference done={reference.done}"]
    return []


def check_alfworld_transition(action: str | None, admissible_actions: Iterable[str],
                              next_observation: Any, reference_next_observation: Any) -> TransitionCheck:
    """App. B.5 ALFWorld transition check.

    Args:
      action: the executed (student) action text; ``None`` when none could be parsed.
      admissible_actions: the admissible set of the state in which ``action`` was executed.
      next_observation / reference_next_observation: Observation-like outcomes (``text``, ``done``,
        ``admissible_actions``) of the actual and the reference transition.

    Rules: the action is valid (:func:`is_alfworld_action_valid`); the termination flags agree;
    "We require the normalized next observation o_{t+1} to equal o_{t+1}^ref"; "For nonterminal
    transitions, the next admissible-action sets must also match after text normalization and
    deduplication; this comparison is omitted for terminal transitions."
    """
    actual = _as_side(next_observation, "next_observation")
    reference = _as_side(reference_next_observation, "reference_next_observation")
    reasons: list[str] = []
    if not is_alfworld_action_valid(action, admissible_actions):
        reasons.append(f"action {action!r} is not in the admissible set (help excluded)")
    reasons += _termination_reason(actual, reference)
    if normalize_observation(actual.text) != normalize_observation(reference.text):
        reasons.append("normalized next observation differs from the reference")
    terminal = actual.done or reference.done
    if not terminal and (normalized_action_set(actual.admissible_actions)
                         != normalized_action_set(reference.admissible_actions)):
        reasons.append("next admissible-action sets differ (nonterminal transition)")
    return TransitionCheck(ok=not reasons, reasons=tuple(reasons))


def check_scienceworld_transition(action: str | None, admissible_actions: Iterable[str],
                                  next_observation: Any, reference_next_observation: Any) -> TransitionCheck:
    """App. B.5 ScienceWorld transition check.

    Rules: the action is valid (:func:`is_scienceworld_action_valid`, against the full admissible
    list of the state in which it was executed); the termination flags agree; "We compare normalized
    next observations and action-template sets, including for terminal transitions" with the
    observation normalisation of :func:`normalize_scienceworld_observation` and templates "with
    duplicates removed and order ignored". Not compared, as App. B.5 states: possible-object aliases
    ("their enumeration can vary across resets"), the admissible-action lists ("used for action
    validation, not set equality"), separate room descriptions, inventory, reward and score.
    """
    actual = _as_side(next_observation, "next_observation")
    reference = _as_side(reference_next_observation, "reference_next_observation")
    reasons: list[str] = []
    if not is_scienceworld_action_valid(action, admissible_actions):
        reasons.append(f"action {action!r} is not in the admissible-action list")
    reasons += _termination_reason(actual, reference)
    if normalize_scienceworld_observation(actual.text) != normalize_scienceworld_observation(reference.text):
        reasons.append("normalized next observation differs from the reference")
    if normalized_action_set(actual.action_templates) != normalized_action_set(reference.action_templates):
        reasons.append("action-template sets differ")
    return TransitionCheck(ok=not reasons, reasons=tuple(reasons))


def observation_texts_equivalent(benchmark: str, text_a: str, text_b: str) -> bool:
    """Whether two observation texts are equal under ``benchmark``'s App. B.5 normalisation.

    ScienceWorld uses :func:`normalize_scienceworld_observation` (its enumerations can come in another
    order after a reset); every other benchmark uses :func:`normalize_observation`.
    """
    if benchmark == "scienceworld":
        return normalize_scienceworld_observation(text_a) == normalize_scienceworld_observation(text_b)
    return normalize_observation(text_a) == normalize_observation(text_b)


_CHECKS = {"alfworld": check_alfworld_transition, "scienceworld": check_scienceworld_transition}


def check_transition(benchmark: str, action: str | None, admissible_actions: Iterable[str],
                     next_observation: Any, reference_next_observation: Any) -> TransitionCheck:
    """Dispatch to the App. B.5 check of ``benchmark`` ("alfworld" or "scienceworld")."""
    try:
        check = _CHECKS[benchmark]
    except KeyError:
        raise ValueError(f"no transition check for benchmark {benchmark!r}; known: {sorted(_CHECKS)}") from None
    return check(action, admissible_actions, next_observation, reference_next_observation)
