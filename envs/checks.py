"""Transition consistency checks of the ActFirst-OPD paper, App. B.5, for ALFWorld and ScienceWorld.

Owns the observation normal forms used to compare an executed transition with its reference
counterpart (built on the one text normaliser, :mod:`jaxopd_envs.text`; ScienceWorld's adds line and
enumeration sorting) and the per-benchmark rules that decide whether reference guidance may continue.
Each rule below quotes the sentence of App. B.5 it implements.

App. B.5, common part: "Retaining reference guidance requires a valid action, agreement of the
[student]'s termination flag with the reference, and the benchmark-specific conditions below. The
generated action need not equal the reference action."
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Iterable, Mapping

import numpy as np

from jaxopd_envs.text import normalize_lines, normalize_text

__all__ = [
    "TransitionCheck",
    "TransitionSide",
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

    ``jaxopd_envs.base.Observation`` has these attributes too, so an Observation can be passed directly;
    a mapping with these keys is accepted as well (e.g. one record of a reference cache).
    """

    text: str
    done: bool
    admissible_actions: tuple[str, ...] = ()
    action_templates: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("admissible_actions", "action_templates"):
            object.__setattr__(self, name, _text_sequence(getattr(self, name), name))


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
    done = get("done")
    if not isinstance(done, (bool, np.bool_)):
        raise ValueError(f"{what}: 'done' must be a bool, got {type(done).__name__} {done!r}")
    return TransitionSide(text=text, done=bool(done),
                          admissible_actions=_text_sequence(get("admissible_actions", ()) or (),
                                                            f"{what}.admissible_actions"),
                          action_templates=_text_sequence(get("action_templates", ()) or (),
                                                          f"{what}.action_templates"))


# ----------------------------------------------------------------------------------------------
# Normalisation
# ----------------------------------------------------------------------------------------------

normalize_action = normalize_text
"""Action text normalisation: App. B.5 applies "the same text normalization" as to observations, on one
line (the project's one normaliser, :func:`jaxopd_envs.text.normalize_text`, under the name callers use)."""


def normalize_observation(text: str) -> str:
    """App. B.5 observation normalisation, common to all benchmarks.

    "We normalize observation text before comparison by applying Unicode NFKC normalization and case
    folding, standardizing line endings, collapsing whitespace within each line, and removing empty
    lines. The remaining line order is preserved except in ScienceWorld."
    """
    return "\n".join(normalize_lines(text, what="observation text"))


def _text_sequence(values: Any, name: str) -> tuple[str, ...]:
    """``values`` as a tuple of str; a lone str or bytes (which would be read letter by letter) is a
    ValueError naming ``name``, as is any element that is not a str."""
    if isinstance(values, (str, bytes, bytearray)):
        raise ValueError(f"{name} must be a sequence of str, not one {type(values).__name__} "
                         f"(got {values!r:.60})")
    try:
        values = tuple(values)
    except TypeError:
        raise ValueError(f"{name} must be a sequence of str, got {type(values).__name__}") from None
    for index, value in enumerate(values):
        if not isinstance(value, str):
            raise ValueError(f"{name}[{index}] must be a str, got {type(value).__name__}")
    return values


def normalized_action_set(actions: Iterable[str], *, name: str = "actions") -> frozenset[str]:
    """Actions/templates after text normalisation "with duplicates removed and order ignored"."""
    return frozenset(normalize_text(a) for a in _text_sequence(actions, name))


# ---- ScienceWorld enumeration sorting ---------------------------------------------------------
#
# The sorting is a normal form: normalising its output again changes nothing, and the same items in
# another order give the same text. Three choices make it one:
# - a period that ends an item of the enumeration after "is:" is punctuation, not part of the item: it
#   is removed from every item (the sentence's own period is the last item's), and the sorted
#   enumeration ends with one period when any item ended with one. Keeping it on the item made the
#   result ambiguous: "is: c ., b" gave "is: b, c .", whose " ." was then read as the sentence's period.
# - parenthesis depth is one clamped scan (an unmatched ")" does not go below 0) shared by the
#   enumeration split, the "non-nested" test of (containing ...) and the choice of the "is:" anchor;
# - the anchor is the last "is:" outside parentheses, and its enumeration is sorted only when every item
#   is balanced (each parenthesis has its partner in the same item): then moving an item changes neither
#   what a parenthesis encloses nor which (containing ...) groups are nested. Malformed enumerations keep
#   their order.

_CLAUSE_START = re.compile(r"^(which|that)\b")
# "(containing ...)" with no parenthesis inside: the innermost, non-nested form.
_CONTAINING_GROUP = re.compile(r"\(containing ([^()]*)\)")
_ENUMERATION_ANCHOR = "is:"


def _depths(text: str) -> list[int]:
    """Parenthesis depth before each character of ``text`` (and after the last), clamped at 0."""
    depths = [0]
    for char in text:
        depth = depths[-1]
        if char == "(":
            depth += 1
        elif char == ")":
            depth = max(depth - 1, 0)
        depths.append(depth)
    return depths


def _balanced(text: str) -> bool:
    """Whether every parenthesis of ``text`` has its partner inside ``text``."""
    depth = 0
    for char in text:
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
            if depth < 0:
                return False
    return depth == 0


def split_scienceworld_enumeration(enumeration: str) -> list[str]:
    """Split an object enumeration into items, as App. B.5 specifies for ScienceWorld.

    "Enumeration parsing ignores commas inside parentheses and retains clauses starting with which or
    that with their preceding item." So ``"a stove, which is off, a cup (containing a, b)"`` gives
    ``["a stove, which is off", "a cup (containing a, b)"]``. Items are stripped; empty ones are dropped.
    """
    depths = _depths(enumeration)
    pieces: list[str] = []
    start = 0
    for i, char in enumerate(enumeration):
        if char == "," and depths[i] == 0:
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


def _sort_containing_groups(line: str) -> str:
    """Sort the items of every non-nested ``(containing ...)`` expression of a line.

    Non-nested: the expression holds no parenthesis and is not inside another parenthesis
    (a ``(containing ...)`` that is part of a nesting is left in its original order).
    """
    depths = _depths(line)

    def replace(match: re.Match) -> str:
        if depths[match.start()] != 0:
            return match.group(0)
        return f"(containing {_sorted_enumeration(match.group(1))})"

    return _CONTAINING_GROUP.sub(replace, line)


def _enumeration_anchor(line: str) -> int:
    """Start of the last ``is:`` of ``line`` outside parentheses, or -1."""
    depths = _depths(line)
    anchor = line.rfind(_ENUMERATION_ANCHOR)
    while anchor >= 0 and depths[anchor] != 0:
        anchor = line.rfind(_ENUMERATION_ANCHOR, 0, anchor)
    return anchor


def _sort_after_last_is(line: str) -> str:
    """Sort the enumeration that follows the last ``is:`` of a line; see the note above on periods."""
    anchor = _enumeration_anchor(line)
    if anchor < 0:
        return line
    head, tail = line[: anchor + len(_ENUMERATION_ANCHOR)], line[anchor + len(_ENUMERATION_ANCHOR):]
    items = split_scienceworld_enumeration(tail)
    if not all(_balanced(item) for item in items):
        return line        # malformed: moving an unmatched parenthesis would change what it encloses
    period = any(item.endswith(".") for item in items)
    items = [stripped for stripped in (item.rstrip(" .") for item in items) if stripped]
    if not items:
        return line
    return f"{head} {', '.join(sorted(items))}{'.' if period else ''}"


def normalize_scienceworld_observation(text: str) -> str:
    """App. B.5 ScienceWorld observation normalisation.

    "Observation normalization additionally sorts lines and object enumerations inside non-nested
    (containing ...) expressions and after the last is: on each line. Enumeration parsing ignores
    commas inside parentheses and retains clauses starting with which or that with their preceding
    item." Applied after :func:`normalize_observation`: per line, the non-nested ``(containing ...)``
    enumerations are sorted, then the enumeration after the line's last ``is:`` (outside parentheses;
    item-final periods are punctuation, see the note above); finally the lines. It is a normal form:
    normalising its result again returns it unchanged.
    """
    lines = [_sort_after_last_is(_sort_containing_groups(line))
             for line in normalize_lines(text, what="observation text")]
    return "\n".join(sorted(lines))


# ----------------------------------------------------------------------------------------------
# Action validity
# ----------------------------------------------------------------------------------------------

def is_alfworld_action_valid(action: str | None, admissible_actions: Iterable[str]) -> bool:
    """App. B.5, ALFWorld: "An action is valid if its normalized text belongs to the current
    admissible-action set, excluding help." A missing (unparsed) action is invalid."""
    admissible = normalized_action_set(admissible_actions, name="admissible_actions") - {_HELP_ACTION}
    if action is None:
        return False
    normalized = normalize_text(action, what="action")
    return bool(normalized) and normalized in admissible


def is_scienceworld_action_valid(action: str | None, admissible_actions: Iterable[str]) -> bool:
    """App. B.5, ScienceWorld: "An action is valid if its normalized text appears in the current
    admissible-action list." ("The full admissible-action list is used for action validation.")"""
    admissible = normalized_action_set(admissible_actions, name="admissible_actions")
    if action is None:
        return False
    normalized = normalize_text(action, what="action")
    return bool(normalized) and normalized in admissible


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
    """Dispatch to the App. B.5 check of ``benchmark`` ("alfworld" or "scienceworld").

    ``admissible_actions`` is a sequence of str; one str or bytes (which would be read letter by letter)
    is a ValueError naming the argument, here and in every check and validity function of this module.
    """
    try:
        check = _CHECKS[benchmark]
    except KeyError:
        raise ValueError(f"no transition check for benchmark {benchmark!r}; known: {sorted(_CHECKS)}") from None
    return check(action, admissible_actions, next_observation, reference_next_observation)
