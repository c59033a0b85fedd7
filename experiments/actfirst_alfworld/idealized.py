"""Idealized rollout-completion times and speedup bounds of ActFirst-OPD (paper Prop. 1, App. A.1, A.2, C.5).

Owns the closed forms only: Proposition 1's completion times and speedup, the calibrated per-batch estimates
of App. C.5, and the finite-concurrency bounds and necessary condition of App. A.2 (Eq. 21–28). Pure
functions of latencies (seconds) and counts; no engine, no I/O.

The paper's equations were lost in text extraction; they are rebuilt here from its prose, each step below.

**Proposition 1 / App. A.1** (one task, T turns, constant latencies ``0 < l_fast <= l_full``, unlimited
concurrency, no environment time). Think-then-act ("Vanilla") must finish the full response of turn t
before context t+1 exists, so (Eq. 9)

    C_Vanilla = T * l_full.

ActFirst submits the fast action and the full response of turn t together at ``s_t``; only the fast action
gates the next context: ``s_1 = 0``, ``s_{t+1} = s_t + l_fast`` (Eq. 10), so ``s_t = (t-1) l_fast`` (Eq. 11).
Interaction ends at ``T l_fast``; the full response of turn t ends at ``s_t + l_full``; the last one ends
last, hence (Eq. 12)

    C_ActFirst = max(T l_fast, (T-1) l_fast + l_full) = (T-1) l_fast + l_full      (as l_full >= l_fast),

and (Eq. 13)

    S_ideal(T) = T l_full / ((T-1) l_fast + l_full).

Bounds (Eq. 14–18): the denominator is >= l_full (so S <= T) and >= T l_fast (so S <= l_full / l_fast), and
<= T l_full (so S >= 1): ``1 <= S_ideal(T) <= min(T, l_full / l_fast)``. Rewriting (Eq. 19)
``S_ideal(T) = 1 / (l_fast/l_full + (1 - l_fast/l_full) / T)`` shows S is nondecreasing in T with limit
``l_full / l_fast`` (Eq. 20).

**Calibrated batch estimates / App. C.5.** With per-context latencies ``l_fast,i``, ``l_full,i`` (medians of
three single-request measurements) held constant over T virtual turns, a batch waits for its slowest task:

    Vanilla_B  = max_i T l_full,i
    ActFirst_B = max_i [ (T-1) l_fast,i + max(l_fast,i, l_full,i) ]

(the inner max covers both requests of the last turn; it reduces to Prop. 1 when l_fast,i <= l_full,i).
A scan point's estimate is ``sum_B Vanilla_B / sum_B ActFirst_B``, the same ratio of sums as the measured
speedup. These assume unrestricted overlap and are not hardware upper bounds.

**Finite concurrency / App. A.2** (N tasks of T turns, at most ``b_max`` admitted requests at once, shared by
both kinds; ``l_fast <= l_full`` lower-bound the time a request holds a slot). Dependency constraint: the
context of task i at turn t+1 needs the fast action of turn t, ``s_{i,t+1} >= s_{i,t} + l_fast`` (Eq. 21),
so ``s_{i,T} >= (T-1) l_fast`` and the batch cannot finish before its last full response (Eq. 22):

    C_ActFirst >= (T-1) l_fast + l_full.

Concurrency constraint: with n(u) <= b_max admitted unfinished requests at time u, the NT fast and NT full
requests occupy slots for at least ``N T (l_fast + l_full)`` slot-seconds, and
``N T (l_fast + l_full) <= integral_0^C n(u) du <= b_max C`` (Eq. 23), so (Eq. 24)

    C_ActFirst >= N T (l_fast + l_full) / b_max.

Together (Eq. 25) ``C_ActFirst >= max{(T-1) l_fast + l_full, N T (l_fast + l_full) / b_max}``, and with the
measured baseline under the same cap (Eq. 26)

    S_real = C_Vanilla / C_ActFirst <= C_Vanilla / max{(T-1) l_fast + l_full, N T (l_fast + l_full) / b_max}.

When Vanilla attains its ideal ``C_Vanilla = T l_full`` (it needs only N <= b_max slots), dividing through
gives (Eq. 27), with rho = l_fast / l_full,

    S_real <= min{ T l_full / ((T-1) l_fast + l_full),  b_max l_full / (N (l_fast + l_full)) }
            = min{ S_ideal(T),  b_max / (N (1 + rho)) }.

S_real > 1 therefore needs both terms above one (Eq. 28). The first: ``T l_full > (T-1) l_fast + l_full``
iff ``(T-1)(l_full - l_fast) > 0`` iff ``T >= 2`` and ``l_fast < l_full`` (the horizon term). The second:

    b_max > N (1 + l_fast / l_full) = N (l_fast + l_full) / l_full

(the concurrency term). With N = 16 this already rules out a speedup at b_max = 16 for any latencies, as the
paper observes (0.80x and 0.92x). The condition is necessary, not sufficient.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np


# ------------------------------------------------------------------------------------------------- checks
def _check_horizon(T: int) -> int:
    if isinstance(T, bool) or not isinstance(T, (int, np.integer)) or T < 1:
        raise ValueError(f"the horizon T must be an integer >= 1, got {T!r}")
    return int(T)


def _check_count(value: int, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


def _check_latency(value: float, name: str) -> float:
    value = float(value)
    if not math.isfinite(value) or value <= 0.0:
        raise ValueError(f"{name} must be a finite latency > 0 seconds, got {value!r}")
    return value


def _check_latency_pair(l_fast: float, l_full: float) -> tuple[float, float]:
    l_fast = _check_latency(l_fast, "l_fast")
    l_full = _check_latency(l_full, "l_full")
    if l_fast > l_full:
        raise ValueError(f"Proposition 1 and App. A.2 assume l_fast <= l_full, got l_fast={l_fast!r} > "
                         f"l_full={l_full!r} (use the calibrated batch estimates for arbitrary latencies)")
    return l_fast, l_full


def _check_latency_vectors(l_fast: Sequence[float], l_full: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    fast = np.asarray(l_fast, dtype=np.float64)
    full = np.asarray(l_full, dtype=np.float64)
    if fast.ndim != 1 or full.ndim != 1 or fast.shape != full.shape or fast.size == 0:
        raise ValueError(f"per-task latencies must be two non-empty 1-D sequences of equal length, got shapes "
                         f"{fast.shape} and {full.shape}")
    for name, values in (("l_fast", fast), ("l_full", full)):
        if not np.all(np.isfinite(values)) or np.any(values <= 0.0):
            raise ValueError(f"every {name} must be a finite latency > 0 seconds, got {values.tolist()}")
    return fast, full


# ------------------------------------------------------------------------------------ Proposition 1
def vanilla_completion_time(T: int, l_full: float) -> float:
    """Eq. 9: ``T l_full`` (think-then-act: each turn waits for its full response)."""
    return _check_horizon(T) * _check_latency(l_full, "l_full")


def actfirst_completion_time(T: int, l_fast: float, l_full: float) -> float:
    """Eq. 12: ``(T-1) l_fast + l_full`` (the last full response starts at ``(T-1) l_fast``)."""
    T = _check_horizon(T)
    l_fast, l_full = _check_latency_pair(l_fast, l_full)
    return (T - 1) * l_fast + l_full


def ideal_speedup(T: int, l_fast: float, l_full: float) -> float:
    """Proposition 1 / Eq. 13: ``S_ideal(T) = T l_full / ((T-1) l_fast + l_full)``."""
    return vanilla_completion_time(T, l_full) / actfirst_completion_time(T, l_fast, l_full)


def ideal_speedup_bounds(T: int, l_fast: float, l_full: float) -> tuple[float, float]:
    """Eq. 18: ``(1, min(T, l_full / l_fast))``, the range that ``S_ideal(T)`` lies in."""
    T = _check_horizon(T)
    l_fast, l_full = _check_latency_pair(l_fast, l_full)
    return 1.0, min(float(T), l_full / l_fast)


def ideal_speedup_limit(l_fast: float, l_full: float) -> float:
    """Eq. 20: ``lim_{T→∞} S_ideal(T) = l_full / l_fast``."""
    l_fast, l_full = _check_latency_pair(l_fast, l_full)
    return l_full / l_fast


# ------------------------------------------------------------------- calibrated estimates (App. C.5)
@dataclasses.dataclass(frozen=True)
class BatchEstimate:
    """Calibrated completion-time estimates of one batch under unrestricted overlap (seconds)."""

    vanilla: float
    actfirst: float

    @property
    def speedup(self) -> float:
        return self.vanilla / self.actfirst


def calibrated_batch_estimate(T: int, l_fast: Sequence[float], l_full: Sequence[float]) -> BatchEstimate:
    """App. C.5: ``Vanilla_B = max_i T l_full,i``, ``ActFirst_B = max_i [(T-1) l_fast,i + max(l_fast,i, l_full,i)]``.

    ``l_fast[i]``, ``l_full[i]`` are the calibrated latencies of task i of the batch (any order of the two).
    """
    T = _check_horizon(T)
    fast, full = _check_latency_vectors(l_fast, l_full)
    vanilla = float(np.max(T * full))
    actfirst = float(np.max((T - 1) * fast + np.maximum(fast, full)))
    return BatchEstimate(vanilla=vanilla, actfirst=actfirst)


def calibrated_speedup(T: int, batches: Sequence[tuple[Sequence[float], Sequence[float]]]) -> float:
    """``sum_B Vanilla_B / sum_B ActFirst_B`` over batches given as ``(l_fast per task, l_full per task)``."""
    if len(batches) == 0:
        raise ValueError("calibrated_speedup needs at least one batch")
    estimates = [calibrated_batch_estimate(T, fast, full) for fast, full in batches]
    return sum(e.vanilla for e in estimates) / sum(e.actfirst for e in estimates)


# ------------------------------------------------------------------------------ App. A.2 bounds
def actfirst_dependency_bound(T: int, l_fast: float, l_full: float) -> float:
    """Eq. 22: ``C_ActFirst >= (T-1) l_fast + l_full`` (the fast-action chain, then the last full response)."""
    return actfirst_completion_time(T, l_fast, l_full)


def actfirst_concurrency_bound(num_tasks: int, T: int, l_fast: float, l_full: float, b_max: int) -> float:
    """Eq. 24: ``C_ActFirst >= N T (l_fast + l_full) / b_max`` (slot-seconds needed over slots available)."""
    num_tasks = _check_count(num_tasks, "the number of tasks N")
    T = _check_horizon(T)
    b_max = _check_count(b_max, "b_max")
    l_fast, l_full = _check_latency_pair(l_fast, l_full)
    return num_tasks * T * (l_fast + l_full) / b_max


def actfirst_completion_lower_bound(num_tasks: int, T: int, l_fast: float, l_full: float, b_max: int) -> float:
    """Eq. 25: the larger of the dependency (Eq. 22) and concurrency (Eq. 24) bounds."""
    return max(actfirst_dependency_bound(T, l_fast, l_full),
               actfirst_concurrency_bound(num_tasks, T, l_fast, l_full, b_max))


def realized_speedup_upper_bound(vanilla_time: float, num_tasks: int, T: int, l_fast: float, l_full: float,
                                 b_max: int) -> float:
    """Eq. 26: ``S_real <= C_Vanilla / max{(T-1) l_fast + l_full, N T (l_fast + l_full) / b_max}``,
    keeping the measured baseline completion time ``vanilla_time`` under the same cap."""
    vanilla_time = _check_latency(vanilla_time, "the Vanilla completion time")
    return vanilla_time / actfirst_completion_lower_bound(num_tasks, T, l_fast, l_full, b_max)


def ideal_baseline_speedup_upper_bound(num_tasks: int, T: int, l_fast: float, l_full: float, b_max: int) -> float:
    """Eq. 27: with ``C_Vanilla = T l_full``, ``S_real <= min{S_ideal(T), b_max l_full / (N (l_fast + l_full))}``."""
    num_tasks = _check_count(num_tasks, "the number of tasks N")
    b_max = _check_count(b_max, "b_max")
    horizon_term = ideal_speedup(T, l_fast, l_full)
    concurrency_term = b_max * l_full / (num_tasks * (l_fast + l_full))
    return min(horizon_term, concurrency_term)


@dataclasses.dataclass(frozen=True)
class NecessaryCondition:
    """Eq. 28 at one (N, T, b_max, l_fast, l_full): S_real > 1 is possible only if ``holds``.

    ``horizon_ok``: T >= 2 and l_fast < l_full (the first term of Eq. 27 exceeds one).
    ``concurrency_ok``: b_max > ``min_b_max`` = N (1 + l_fast / l_full) (the second term exceeds one).
    ``speedup_cap``: the Eq. 27 upper bound itself.
    """

    num_tasks: int
    T: int
    b_max: int
    latency_ratio: float          # l_fast / l_full
    min_b_max: float              # N (1 + l_fast / l_full); b_max must exceed it
    horizon_ok: bool
    concurrency_ok: bool
    speedup_cap: float

    @property
    def holds(self) -> bool:
        return self.horizon_ok and self.concurrency_ok


def speedup_necessary_condition(num_tasks: int, T: int, l_fast: float, l_full: float,
                                b_max: int) -> NecessaryCondition:
    """Eq. 28, the necessary condition for ``S_real > 1`` when Vanilla attains ``T l_full`` (see module doc)."""
    num_tasks = _check_count(num_tasks, "the number of tasks N")
    T = _check_horizon(T)
    b_max = _check_count(b_max, "b_max")
    l_fast, l_full = _check_latency_pair(l_fast, l_full)
    ratio = l_fast / l_full
    min_b_max = num_tasks * (1.0 + ratio)
    return NecessaryCondition(
        num_tasks=num_tasks, T=T, b_max=b_max, latency_ratio=ratio, min_b_max=min_b_max,
        horizon_ok=T >= 2 and l_fast < l_full, concurrency_ok=b_max > min_b_max,
        speedup_cap=ideal_baseline_speedup_upper_bound(num_tasks, T, l_fast, l_full, b_max))
