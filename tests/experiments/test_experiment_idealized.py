"""Proposition 1, the calibrated batch estimates of App. C.5 and the App. A.2 bounds against hand-computed values."""
import math

import pytest

from jaxopd_experiments.actfirst_alfworld import idealized as ideal


# ------------------------------------------------------------------------------------------ Proposition 1
def test_prop1_completion_times_and_speedup_hand_values():
    # T = 4 turns, l_fast = 1 s, l_full = 4 s: Vanilla 4*4 = 16 s; ActFirst 3*1 + 4 = 7 s; S = 16/7.
    assert ideal.vanilla_completion_time(4, 4.0) == 16.0
    assert ideal.actfirst_completion_time(4, 1.0, 4.0) == 7.0
    assert ideal.ideal_speedup(4, 1.0, 4.0) == pytest.approx(16 / 7)
    # T = 30, 16-token fast vs 512-token full at equal per-token cost (ratio 1/32): 30*32 / (29 + 32) = 960/61
    assert ideal.ideal_speedup(30, 1.0, 32.0) == pytest.approx(960 / 61)
    # a single turn gains nothing; equal latencies gain nothing
    assert ideal.ideal_speedup(1, 0.5, 3.0) == 1.0
    assert ideal.ideal_speedup(10, 2.0, 2.0) == 1.0


def test_prop1_bounds_limit_and_monotonicity():
    assert ideal.ideal_speedup_bounds(4, 1.0, 4.0) == (1.0, 4.0)
    assert ideal.ideal_speedup_bounds(2, 1.0, 8.0) == (1.0, 2.0)
    assert ideal.ideal_speedup_bounds(50, 1.0, 8.0) == (1.0, 8.0)
    assert ideal.ideal_speedup_limit(0.5, 4.0) == 8.0
    previous = 0.0
    for T in range(1, 200):
        s = ideal.ideal_speedup(T, 0.5, 4.0)
        lo, hi = ideal.ideal_speedup_bounds(T, 0.5, 4.0)
        assert lo <= s <= hi + 1e-12
        # Eq. 19: S = 1 / (rho + (1 - rho) / T) with rho = l_fast / l_full
        assert s == pytest.approx(1.0 / (0.125 + 0.875 / T))
        assert s >= previous
        previous = s
    assert previous == pytest.approx(8.0, rel=0.05)


@pytest.mark.parametrize("call", [
    lambda: ideal.ideal_speedup(0, 1.0, 2.0),
    lambda: ideal.ideal_speedup(2.5, 1.0, 2.0),
    lambda: ideal.ideal_speedup(3, 2.0, 1.0),          # Prop. 1 needs l_fast <= l_full
    lambda: ideal.ideal_speedup(3, 0.0, 1.0),
    lambda: ideal.ideal_speedup(3, 1.0, float("inf")),
    lambda: ideal.actfirst_concurrency_bound(16, 30, 1.0, 4.0, 0),
    lambda: ideal.actfirst_concurrency_bound(0, 30, 1.0, 4.0, 16),
])
def test_bad_arguments_raise_value_error(call):
    with pytest.raises(ValueError):
        call()


# ------------------------------------------------------------------------------- App. C.5 calibrated
def test_calibrated_batch_estimate_hand_values():
    # T = 3; task 0: fast 1, full 4; task 1: fast 2, full 3.
    # Vanilla = max(3*4, 3*3) = 12; ActFirst = max(2*1 + 4, 2*2 + 3) = 7.
    est = ideal.calibrated_batch_estimate(3, [1.0, 2.0], [4.0, 3.0])
    assert (est.vanilla, est.actfirst) == (12.0, 7.0)
    assert est.speedup == pytest.approx(12 / 7)
    # a task whose fast action is slower than its full response: the inner max picks the fast action
    est = ideal.calibrated_batch_estimate(2, [5.0], [3.0])
    assert (est.vanilla, est.actfirst) == (6.0, 10.0)
    # one task with l_fast <= l_full reduces to Proposition 1
    est = ideal.calibrated_batch_estimate(7, [0.5], [3.0])
    assert est.speedup == pytest.approx(ideal.ideal_speedup(7, 0.5, 3.0))


def test_calibrated_speedup_is_a_ratio_of_sums():
    # batch A (T=3): V 12, A 7 (above); batch B: fast 1, full 2 -> V 6, A 2*1 + 2 = 4. (12 + 6) / (7 + 4).
    batches = [([1.0, 2.0], [4.0, 3.0]), ([1.0], [2.0])]
    assert ideal.calibrated_speedup(3, batches) == pytest.approx(18 / 11)
    with pytest.raises(ValueError):
        ideal.calibrated_speedup(3, [])
    with pytest.raises(ValueError):
        ideal.calibrated_batch_estimate(3, [1.0, 2.0], [4.0])


# ---------------------------------------------------------------------------------------- App. A.2
def test_dependency_and_concurrency_bounds_hand_values():
    # N = 16, T = 30, l_fast = 1, l_full = 4.
    assert ideal.actfirst_dependency_bound(30, 1.0, 4.0) == 33.0                  # 29*1 + 4
    assert ideal.actfirst_concurrency_bound(16, 30, 1.0, 4.0, 16) == 150.0        # 16*30*5 / 16
    assert ideal.actfirst_concurrency_bound(16, 30, 1.0, 4.0, 256) == 9.375       # 2400 / 256
    assert ideal.actfirst_completion_lower_bound(16, 30, 1.0, 4.0, 16) == 150.0
    assert ideal.actfirst_completion_lower_bound(16, 30, 1.0, 4.0, 256) == 33.0
    # Eq. 26 keeps the measured baseline: 130 s / max(33, 75) at b_max = 32
    assert ideal.realized_speedup_upper_bound(130.0, 16, 30, 1.0, 4.0, 32) == pytest.approx(130 / 75)


def test_eq27_cap_and_eq28_condition_hand_values():
    # b_max = 16 = N: concurrency term 16*4 / (16*5) = 0.8 < 1 -> no speedup possible (paper: 0.80x, 0.92x)
    assert ideal.ideal_baseline_speedup_upper_bound(16, 30, 1.0, 4.0, 16) == pytest.approx(0.8)
    c = ideal.speedup_necessary_condition(16, 30, 1.0, 4.0, 16)
    assert c.min_b_max == pytest.approx(20.0)                                    # 16 * (1 + 1/4)
    assert c.horizon_ok and not c.concurrency_ok and not c.holds
    assert c.speedup_cap == pytest.approx(0.8)
    # b_max = 32: concurrency term 1.6, horizon term 120/33 -> cap 1.6, condition holds
    c = ideal.speedup_necessary_condition(16, 30, 1.0, 4.0, 32)
    assert c.holds and c.speedup_cap == pytest.approx(1.6)
    # b_max = 256: the horizon term binds: min(120/33, 256*4/80 = 12.8)
    assert ideal.ideal_baseline_speedup_upper_bound(16, 30, 1.0, 4.0, 256) == pytest.approx(120 / 33)
    # T = 1 or l_fast = l_full: the horizon term is exactly one, never > 1
    assert not ideal.speedup_necessary_condition(16, 1, 1.0, 4.0, 256).holds
    assert not ideal.speedup_necessary_condition(16, 8, 4.0, 4.0, 256).holds
    # the threshold sits exactly at N (1 + rho): just above holds, at it does not
    assert ideal.speedup_necessary_condition(10, 4, 1.0, 4.0, 13).concurrency_ok                # 13 > 12.5
    assert not ideal.speedup_necessary_condition(8, 4, 7.0, 8.0, 15).concurrency_ok             # 15 = 8 * (1 + 7/8)


def test_eq27_cap_never_exceeds_the_dependency_bound_ratio():
    for N in (1, 4, 16):
        for T in (1, 2, 5, 30):
            for b in (1, 8, 16, 64, 512):
                cap = ideal.ideal_baseline_speedup_upper_bound(N, T, 0.3, 2.0, b)
                lower = ideal.actfirst_completion_lower_bound(N, T, 0.3, 2.0, b)
                assert cap == pytest.approx(T * 2.0 / lower)
                assert cap <= ideal.ideal_speedup(T, 0.3, 2.0) + 1e-12
                assert math.isfinite(cap)
