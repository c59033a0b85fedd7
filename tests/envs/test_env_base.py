"""jaxopd_envs.base: the one spelling of int, bool and text arguments, and the typed Observation record."""
import numpy as np
import pytest

from jaxopd_envs.base import Observation, require_bool, require_int, require_text


def test_require_int_takes_ints_and_numpy_integers_only():
    assert require_int(3, "n") == 3 and type(require_int(np.int64(3), "n")) is int
    assert require_int(np.uint8(0), "n", minimum=0) == 0
    for bad in (True, False, np.bool_(True), 1.0, 1.5, "1", None, [1]):
        with pytest.raises(ValueError, match="n must be an int"):
            require_int(bad, "n")
    with pytest.raises(ValueError, match="n must be >= 1, got 0"):
        require_int(0, "n", minimum=1)


def test_require_bool_rejects_truthy_strings_and_numbers():
    assert require_bool(True, "flag") is True and require_bool(np.bool_(False), "flag") is False
    for bad in ("False", "true", 0, 1, None, 1.0):
        with pytest.raises(ValueError, match="flag must be a bool"):
            require_bool(bad, "flag")


def test_require_text_rejects_what_utf8_cannot_carry():
    assert require_text("look\u00a0around", "action") == "look\u00a0around"
    for bad in ("look\ud800", "\udc80"):
        with pytest.raises(ValueError, match="action is not valid text"):
            require_text(bad, "action")
    with pytest.raises(ValueError, match="action must be a str"):
        require_text(b"look", "action")


def test_observation_flags_are_bools():
    """Issue 15.19: Observation(done="False") is an error, not a finished episode."""
    obs = Observation(text="t", instruction="i", done=np.bool_(True), won=np.bool_(False), turn=np.int64(2))
    assert obs.done is True and obs.won is False and type(obs.turn) is int
    for field, value in (("done", "False"), ("won", 1), ("last_action_valid", None), ("turn", True), ("turn", -1)):
        with pytest.raises(ValueError, match=f"Observation.{field}"):
            Observation(text="t", instruction="i", **{field: value})
