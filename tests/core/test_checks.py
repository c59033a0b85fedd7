"""App. B.5 transition consistency checks: one crafted observation pair (or more) per rule."""
from __future__ import annotations

import random

import pytest

from jaxopd_envs.base import Observation
from jaxopd_envs.checks import (
    TransitionSide,
    check_alfworld_transition,
    check_scienceworld_transition,
    check_transition,
    is_alfworld_action_valid,
    is_scienceworld_action_valid,
    normalize_action,
    normalize_observation,
    normalize_scienceworld_observation,
    split_scienceworld_enumeration,
)

# ---- common normalisation ----------------------------------------------------------------------

def test_normalize_observation_each_step():
    # NFKC: fullwidth letters and the "ﬁ" ligature; case folding: "ß" -> "ss"; \r\n and \r line ends;
    # tabs/multiple spaces collapsed within a line; empty and blank lines removed; order preserved.
    raw = "  Ｙou  see\tthe ﬁre.\r\n\r\n   \rSTRAßE 1 \n\nend"
    assert normalize_observation(raw) == "you see the fire.\nstrasse 1\nend"
    assert normalize_observation("b\na") == "b\na"                      # line order kept
    assert normalize_action("  Go  to\tCabinet 1 ") == "go to cabinet 1"
    with pytest.raises(ValueError, match="must be a str"):
        normalize_observation(None)


# ---- ALFWorld ----------------------------------------------------------------------------------

ALF_ADMISSIBLE = ("go to cabinet 1", "go to countertop 1", "inventory", "look", "help")
ALF_OBS = "You arrive at cabinet 1. The cabinet 1 is closed."
ALF_NEXT_ADMISSIBLE = ("open cabinet 1", "go to countertop 1", "look", "inventory")


def alf(text=ALF_OBS, done=False, admissible=ALF_NEXT_ADMISSIBLE):
    return Observation(text=text, instruction="put a mug in cabinet", admissible_actions=admissible, done=done)


def test_alfworld_identical_transition_passes():
    result = check_alfworld_transition("go to cabinet 1", ALF_ADMISSIBLE, alf(), alf())
    assert result.ok and result.reasons == () and bool(result)


def test_alfworld_action_validity_rule():
    assert is_alfworld_action_valid("  Go to  CABINET 1", ALF_ADMISSIBLE)
    assert not is_alfworld_action_valid("help", ALF_ADMISSIBLE)          # help excluded even if listed
    assert not is_alfworld_action_valid("HELP ", ALF_ADMISSIBLE)
    assert not is_alfworld_action_valid("go to cabinet 2", ALF_ADMISSIBLE)
    assert not is_alfworld_action_valid(None, ALF_ADMISSIBLE)
    assert not is_alfworld_action_valid("", ALF_ADMISSIBLE)
    result = check_alfworld_transition("go to cabinet 2", ALF_ADMISSIBLE, alf(), alf())
    assert not result.ok
    assert result.reasons == ("action 'go to cabinet 2' is not in the admissible set (help excluded)",)


def test_alfworld_observation_equality_after_normalisation_only():
    variant = "you  arrive at CABINET 1.\r\nthe cabinet 1 is closed.\n\n"   # not equal as lines differ
    same_after_norm = "You   arrive at Cabinet 1. The cabinet 1 is closed.\r\n\n"
    assert check_alfworld_transition("go to cabinet 1", ALF_ADMISSIBLE, alf(same_after_norm), alf()).ok
    failed = check_alfworld_transition("go to cabinet 1", ALF_ADMISSIBLE, alf(variant), alf())
    assert failed.reasons == ("normalized next observation differs from the reference",)
    swapped = check_alfworld_transition("look", ALF_ADMISSIBLE, alf("b\na"), alf("a\nb"))
    assert not swapped.ok                                            # no line sorting in ALFWorld
    changed = check_alfworld_transition("look", ALF_ADMISSIBLE, alf("you see a mug 2."), alf("you see a mug 1."))
    assert not changed.ok


def test_alfworld_admissible_sets_compared_on_nonterminal_transitions_only():
    reordered = ("LOOK", "inventory", "go to countertop 1", "open  cabinet 1", "look")   # order, case, duplicate
    assert check_alfworld_transition("go to cabinet 1", ALF_ADMISSIBLE, alf(admissible=reordered), alf()).ok
    missing = ALF_NEXT_ADMISSIBLE[1:]
    failed = check_alfworld_transition("go to cabinet 1", ALF_ADMISSIBLE, alf(admissible=missing), alf())
    assert failed.reasons == ("next admissible-action sets differ (nonterminal transition)",)
    terminal = check_alfworld_transition("go to cabinet 1", ALF_ADMISSIBLE, alf(done=True, admissible=missing),
                                         alf(done=True))
    assert terminal.ok                                               # omitted for terminal transitions


def test_alfworld_termination_flags_must_agree():
    result = check_alfworld_transition("go to cabinet 1", ALF_ADMISSIBLE, alf(done=True), alf(done=False))
    assert not result.ok
    assert result.reasons == ("termination flag differs: actual done=True, reference done=False",)


def test_alfworld_reports_every_failed_rule():
    result = check_alfworld_transition("help", ALF_ADMISSIBLE, alf("elsewhere", done=True), alf())
    assert len(result.reasons) == 3 and not result.ok


# ---- ScienceWorld ------------------------------------------------------------------------------

KITCHEN = ("This room is called the kitchen. In it, you see: \n"
           "\tthe agent\n"
           "\ta substance called air\n"
           "\ta counter. On the counter is: a bowl (containing a red apple, a banana, an orange), a drawer.\n"
           "\ta cupboard. The cupboard door is open. In the cupboard is: a tin cup (containing nothing), "
           "a drawer, a ceramic cup (containing nothing).\n"
           "\ta stove, which is turned off. On the stove is: nothing.\n"
           "You also see:\n"
           "\tA door to the hallway (that is open)")

KITCHEN_REORDERED = ("This room is called the kitchen. In it, you see: \n"
                     "\ta stove, which is turned off. On the stove is: nothing.\n"
                     "\ta cupboard. The cupboard door is open. In the cupboard is: a ceramic cup (containing "
                     "nothing), a drawer, a tin cup (containing nothing).\n"
                     "\tthe agent\n"
                     "\ta counter. On the counter is: a drawer, a bowl (containing an orange, a red apple, "
                     "a banana).\n"
                     "\ta substance called air\n"
                     "You also see:\n"
                     "\tA door to the hallway (that is open)")

SW_TEMPLATES = ("open OBJ", "close OBJ", "focus on OBJ", "go OBJ", "look around", "wait")
SW_ADMISSIBLE = ("open cupboard", "close cupboard", "focus on air", "go hallway", "look around", "wait")


def sw(text=KITCHEN, done=False, templates=SW_TEMPLATES, admissible=SW_ADMISSIBLE, objects=("air", "cupboard")):
    return Observation(text=text, instruction="boil water", admissible_actions=admissible,
                       action_templates=templates, objects=objects, done=done)


def test_scienceworld_enumeration_and_line_reordering_counts_as_equal():
    assert normalize_scienceworld_observation(KITCHEN) == normalize_scienceworld_observation(KITCHEN_REORDERED)
    assert check_scienceworld_transition("look around", SW_ADMISSIBLE, sw(KITCHEN_REORDERED), sw()).ok


def test_scienceworld_changed_object_does_not_count_as_equal():
    changed = KITCHEN.replace("a tin cup (containing nothing)", "a steel cup (containing nothing)")
    result = check_scienceworld_transition("look around", SW_ADMISSIBLE, sw(changed), sw())
    assert result.reasons == ("normalized next observation differs from the reference",)
    contents = KITCHEN.replace("(containing a red apple, a banana, an orange)", "(containing a red apple, a banana)")
    assert not check_scienceworld_transition("look around", SW_ADMISSIBLE, sw(contents), sw()).ok
    state = KITCHEN.replace("The cupboard door is open.", "The cupboard door is closed.")
    assert not check_scienceworld_transition("look around", SW_ADMISSIBLE, sw(state), sw()).ok


def test_scienceworld_exact_normal_form():
    line = "\ta counter. On the counter is: a drawer, a bowl (containing an orange, a banana)."
    assert normalize_scienceworld_observation(line) == \
        "a counter. on the counter is: a bowl (containing a banana, an orange), a drawer."
    assert normalize_scienceworld_observation("b line\na line\n\n") == "a line\nb line"


def test_enumeration_parsing_ignores_commas_inside_parentheses():
    assert split_scienceworld_enumeration("a jar (containing salt, water), a cup") == \
        ["a jar (containing salt, water)", "a cup"]
    a = "on the table is: a jar (containing salt, water), a cup."
    b = "on the table is: a cup, a jar (containing water, salt)."
    assert normalize_scienceworld_observation(a) == normalize_scienceworld_observation(b)


def test_enumeration_keeps_which_and_that_clauses_with_their_item():
    assert split_scienceworld_enumeration("a stove, which is turned off, a cup, that is red, a pot") == \
        ["a stove, which is turned off", "a cup, that is red", "a pot"]
    same = ("on the counter is: a stove, which is turned off, a cup.",
            "on the counter is: a cup, a stove, which is turned off.")
    assert normalize_scienceworld_observation(same[0]) == normalize_scienceworld_observation(same[1])
    # The clause describes a different object: sorting comma pieces naively would call these equal.
    moved = ("on the counter is: a stove, which is turned on, a cup.",
             "on the counter is: a stove, a cup, which is turned on.")
    assert normalize_scienceworld_observation(moved[0]) != normalize_scienceworld_observation(moved[1])
    # "whichever" is not a clause start
    assert split_scienceworld_enumeration("a, whichever b") == ["a", "whichever b"]


def test_only_the_enumeration_after_the_last_is_is_sorted():
    reference = "on the table is: b, a. in the box is: c, d."
    assert normalize_scienceworld_observation("on the table is: b, a. in the box is: d, c.") == \
        normalize_scienceworld_observation(reference)
    assert normalize_scienceworld_observation("on the table is: a, b. in the box is: c, d.") != \
        normalize_scienceworld_observation(reference)


def test_nested_containing_expressions_are_not_sorted():
    # The outer "(containing ...)" holds another parenthesis: it is nested, so its order counts;
    # the inner one is part of a nesting too (see normalize_scienceworld_observation's docstring).
    a = "a box (containing a jar (containing salt, water), a cup)"
    b = "a box (containing a cup, a jar (containing salt, water))"
    assert normalize_scienceworld_observation(a) != normalize_scienceworld_observation(b)
    c = "a box (containing a jar (containing water, salt), a cup)"
    assert normalize_scienceworld_observation(a) != normalize_scienceworld_observation(c)
    # two separate non-nested groups on one line are each sorted
    d = "a jar (containing salt, water) and a pot (containing b, a)"
    e = "a jar (containing water, salt) and a pot (containing a, b)"
    assert normalize_scienceworld_observation(d) == normalize_scienceworld_observation(e)


def test_scienceworld_action_validity_against_full_list():
    assert is_scienceworld_action_valid(" Open   CUPBOARD ", SW_ADMISSIBLE)
    assert not is_scienceworld_action_valid("open fridge", SW_ADMISSIBLE)
    assert not is_scienceworld_action_valid(None, SW_ADMISSIBLE)
    result = check_scienceworld_transition("open fridge", SW_ADMISSIBLE, sw(), sw())
    assert result.reasons == ("action 'open fridge' is not in the admissible-action list",)


def test_scienceworld_template_sets_compared_even_on_terminal_transitions():
    shuffled = ("WAIT", "look around", "go OBJ", "focus on OBJ", "close OBJ", "open OBJ", "open  obj")
    assert check_scienceworld_transition("wait", SW_ADMISSIBLE, sw(templates=shuffled), sw()).ok
    fewer = SW_TEMPLATES[:-1]
    result = check_scienceworld_transition("wait", SW_ADMISSIBLE, sw(done=True, templates=fewer), sw(done=True))
    assert result.reasons == ("action-template sets differ",)


def test_scienceworld_ignores_objects_and_admissible_lists_of_the_next_state():
    actual = sw(admissible=("something else",), objects=("air", "cupboard", "cupboard door"))
    assert check_scienceworld_transition("look around", SW_ADMISSIBLE, actual, sw()).ok


def test_scienceworld_termination_flags_must_agree():
    result = check_scienceworld_transition("wait", SW_ADMISSIBLE, sw(done=False), sw(done=True))
    assert result.reasons == ("termination flag differs: actual done=False, reference done=True",)


def test_inputs_as_mappings_and_dispatch():
    reference = {"text": KITCHEN, "done": False, "action_templates": list(SW_TEMPLATES)}
    actual = TransitionSide(text=KITCHEN_REORDERED, done=False, action_templates=SW_TEMPLATES)
    assert check_transition("scienceworld", "wait", SW_ADMISSIBLE, actual, reference).ok
    assert not check_transition("alfworld", "wait", SW_ADMISSIBLE, actual, reference).ok   # ALFWorld keeps line order
    with pytest.raises(ValueError, match="no transition check for benchmark 'webshop'"):
        check_transition("webshop", "wait", (), actual, reference)
    with pytest.raises(ValueError, match="needs at least the keys"):
        check_transition("alfworld", "wait", (), {"text": "x"}, reference)
    with pytest.raises(ValueError, match="expected an Observation"):
        check_transition("alfworld", "wait", (), 42, reference)


# ---- ScienceWorld normal form: properties over random enumerations (issue 15, item 18) ----------------

_NOUNS = ("a cup", "b", "c", "an orange", "a red apple", "the agent", "a substance called water", "a tin cup",
          "a drawer", "nothing", "a thermometer", "Ｃ", "ab", "a b", "Stove")
_CLAUSES = ("which is turned off", "that is open", "which is on")
_ITEM_ENDS = ("", "", "", ".", " .", "..", " . .")
_ANCHORS = ("on the table is:", "In the cupboard is:", "a counter. On the counter is:", "on it is:")


def _random_item(rng):
    """One enumeration item as (parts to shuffle, parts in fixed order): a noun, maybe a non-nested
    (containing ...) group (its items are shuffled per rendering), a nested one (fixed), a which/that
    clause, and a trailing-period variant that travels with the item."""
    noun = rng.choice(_NOUNS)
    group = None
    if rng.random() < 0.3:
        group = [rng.choice(_NOUNS) for _ in range(rng.randrange(1, 4))]
    nested = None
    if group is None and rng.random() < 0.1:
        nested = f"(containing a jar (containing {rng.choice(_NOUNS)}, {rng.choice(_NOUNS)}), {rng.choice(_NOUNS)})"
    clause = rng.choice(_CLAUSES) if rng.random() < 0.2 else None
    return noun, group, nested, clause, rng.choice(_ITEM_ENDS)


def _spaced(rng, text):
    return rng.choice(("", " ", "  ", "\t")) + text + rng.choice(("", " ", "  "))


def _comma(rng):
    return rng.choice((",", ", ", " , ", ",  ", ",\t"))


def _render_item(rng, item):
    noun, group, nested, clause, end = item
    text = noun
    if group is not None:
        members = list(group)
        rng.shuffle(members)
        text += " (containing " + _comma(rng).join(_spaced(rng, m) for m in members) + ")"
    if nested is not None:
        text += " " + nested
    if clause is not None:
        text += _comma(rng) + clause
    if rng.random() < 0.2:
        text = text.upper()
    return _spaced(rng, text + end)


def _render_line(rng, anchor, items, final_period):
    items = list(items)
    rng.shuffle(items)
    return _spaced(rng, anchor) + _comma(rng).join(_render_item(rng, i) for i in items) + final_period


def _random_observation(rng):
    """The same observation twice, each rendering with its own item, group-member and line order, its
    own spacing and case: (text_a, text_b)."""
    lines = []
    for _ in range(rng.randrange(1, 4)):
        anchor = rng.choice(_ANCHORS)
        items = [_random_item(rng) for _ in range(rng.randrange(1, 6))]
        lines.append((anchor, items, rng.choice(("", "", ".", " .", ". "))))
    texts = []
    for _ in range(2):
        order = list(lines)
        rng.shuffle(order)
        texts.append(rng.choice(("\n", "\r\n", "\n\n")).join(_render_line(rng, *line) for line in order))
    return tuple(texts)


@pytest.mark.slow  # heavier than the README's test run allows (run in CI: pytest -m slow)
def test_scienceworld_normal_form_is_idempotent_and_order_free_on_random_enumerations():
    # "on the table is: c ., b" used to give "... b, c ." and then "... b, c.": the item's period was read
    # as the sentence's once sorting moved it last. An item-final period is punctuation now.
    assert normalize_scienceworld_observation("on the table is: c ., b") == "on the table is: b, c."
    assert normalize_scienceworld_observation("on the table is: b, c .") == "on the table is: b, c."
    rng = random.Random(15018)
    for case in range(20_000):
        text_a, text_b = _random_observation(rng)
        once = normalize_scienceworld_observation(text_a)
        assert normalize_scienceworld_observation(once) == once, (case, text_a)
        assert normalize_scienceworld_observation(text_b) == once, (case, text_a, text_b)


def test_scienceworld_normal_form_is_idempotent_on_arbitrary_text():
    # Malformed text too: unbalanced parentheses, "is:" inside parentheses, empty items, stray periods.
    pieces = ("a", "b", "c ", " ", ",", ", ", ".", " .", "(", ")", "(containing ", "is:", " is: ", "which ",
              "that ", "\n", "X")
    rng = random.Random(19)
    for case in range(20_000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randrange(1, 30)))
        once = normalize_scienceworld_observation(text)
        assert normalize_scienceworld_observation(once) == once, (case, text)


def test_admissible_list_given_as_one_string_is_rejected():
    # Issue 15, item 19: a str was read letter by letter ("look" made "l", "o", "k" admissible).
    side = TransitionSide(text="x", done=False)
    for bad in ("look", b"look"):
        for benchmark in ("alfworld", "scienceworld"):
            with pytest.raises(ValueError, match="admissible_actions must be a sequence of str"):
                check_transition(benchmark, "l", bad, side, side)
            with pytest.raises(ValueError, match="admissible_actions must be a sequence of str"):
                check_transition(benchmark, None, bad, side, side)
        with pytest.raises(ValueError, match="admissible_actions must be a sequence of str"):
            is_alfworld_action_valid("l", bad)
        with pytest.raises(ValueError, match="admissible_actions must be a sequence of str"):
            is_scienceworld_action_valid("l", bad)
    with pytest.raises(ValueError, match=r"admissible_actions\[1\] must be a str"):
        check_transition("alfworld", "look", ["look", 3], side, side)
    # the next state's lists too, whether given as a mapping or a TransitionSide
    with pytest.raises(ValueError, match="next_observation.admissible_actions must be a sequence of str"):
        check_transition("alfworld", "look", ["look"], {"text": "x", "done": False, "admissible_actions": "look"},
                         side)
    with pytest.raises(ValueError, match="action_templates must be a sequence of str"):
        TransitionSide(text="x", done=False, action_templates="open OBJ")
    assert check_transition("alfworld", "look", ("look",), side, side).ok


@pytest.mark.parametrize("done", ["False", "True", 0, 1, None])
def test_done_must_be_a_bool_not_a_truthy_value(done):
    """Issue 15 item 19: {"done": "False"} used to count as done."""
    side = {"text": "You arrive at the desk.", "done": done, "admissible_actions": ["look"]}
    good = {"text": "You arrive at the desk.", "done": False, "admissible_actions": ["look"]}
    with pytest.raises(ValueError, match="'done' must be a bool"):
        check_transition("alfworld", "look", ["look"], side, good)
    import numpy as np
    assert check_transition("alfworld", "look", ["look"], dict(good, done=np.bool_(False)), good).ok
