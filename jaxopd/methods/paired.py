"""Paired comparison of evaluations that played the same tasks under the same seeds.

Two agents evaluated on the same (task, seed) episodes can be compared far more tightly than their separate
mean ± std over three seeds says: most of the spread of a success rate is which games were drawn, and both agents
drew the same ones. Owns :func:`paired_comparison` (a pure function of the episode outcomes):

- each agent's success rate over the shared episodes, with a 95 % bootstrap interval that resamples *tasks* (all
  seeds of a drawn task together: the episodes of one game are not independent);
- the difference of each agent from a baseline, with the same task-resampling bootstrap interval (the two
  agents' episodes of a drawn task move together, which is what makes the comparison paired);
- the discordant episodes (won by one agent only) and the exact two-sided McNemar p-value (a binomial test of
  the discordant episodes against 1/2).

Outcomes come as ``{(task_id, seed): won}`` maps; episodes an agent did not play are an error, never silently
dropped (``restrict_to_common`` is the explicit way to compare on the shared part). The command line is
``experiments.compare_evals``.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np

Outcomes = Mapping[tuple[str, int], bool]

BOOTSTRAP_RESAMPLES = 10_000
CONFIDENCE = 0.95


def outcomes_of(episodes: Sequence[Mapping[str, Any]]) -> dict[tuple[str, int], bool]:
    """``{(task_id, seed): won}`` of an evaluation's episode records (``evaluation.json``'s ``episodes``).
    ValueError when a record lacks a field or a (task, seed) appears twice."""
    outcomes: dict[tuple[str, int], bool] = {}
    for index, episode in enumerate(episodes):
        try:
            key = (str(episode["task_id"]), int(episode["seed"]))
            won = bool(episode["won"])
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"episode {index} has no task_id / seed / won ({error!r})") from None
        if key in outcomes:
            raise ValueError(f"episode {index} repeats task {key[0]!r} under seed {key[1]}")
        outcomes[key] = won
    return outcomes


def restrict_to_common(named: Mapping[str, Outcomes]) -> tuple[dict[str, dict[tuple[str, int], bool]], int]:
    """Every agent's outcomes on the episodes all of them played, and how many episodes were left out in all."""
    common = set.intersection(*(set(o) for o in named.values())) if named else set()
    left_out = sum(len(o) - len(common) for o in named.values())
    return {name: {key: bool(o[key]) for key in common} for name, o in named.items()}, left_out


def mcnemar_exact_p(only_first: int, only_second: int) -> float:
    """Two-sided exact McNemar p-value: P(a split of the discordant episodes at least this uneven | p = 1/2)."""
    if only_first < 0 or only_second < 0:
        raise ValueError(f"discordant counts must be >= 0, got {only_first} and {only_second}")
    n = only_first + only_second
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(only_first, only_second) + 1)) / 2 ** n
    return min(1.0, 2.0 * tail)


def _check_same_episodes(named: Mapping[str, Outcomes]) -> list[tuple[str, int]]:
    names = list(named)
    if not names:
        raise ValueError("no evaluations to compare")
    keys = set(named[names[0]])
    if not keys:
        raise ValueError(f"evaluation {names[0]!r} has no episodes")
    for name in names[1:]:
        other = set(named[name])
        if other != keys:
            missing, extra = sorted(keys - other), sorted(other - keys)
            detail = []
            if missing:
                detail.append(f"{len(missing)} of {names[0]!r}'s episodes are missing (first: task "
                              f"{missing[0][0]!r}, seed {missing[0][1]})")
            if extra:
                detail.append(f"{len(extra)} are not in {names[0]!r} (first: task {extra[0][0]!r}, seed "
                              f"{extra[0][1]})")
            raise ValueError(f"evaluation {name!r} did not play the same episodes as {names[0]!r}: "
                             + "; ".join(detail) + " (restrict_to_common / --common compares the shared ones)")
    return sorted(keys)


def _interval(samples: np.ndarray) -> list[float]:
    low, high = np.quantile(samples, [(1 - CONFIDENCE) / 2, (1 + CONFIDENCE) / 2])
    return [float(low), float(high)]


def paired_comparison(named: Mapping[str, Outcomes], *, baseline: str | None = None,
                      resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0) -> dict[str, Any]:
    """Success rates and differences from ``baseline`` (default: the first agent) over the same episodes.

    Returns ``{"baseline", "episodes", "tasks", "seeds", "resamples", "confidence", "agents": {name: {...}}}``
    where each agent has ``successes``, ``success_rate``, ``success_ci`` and ``per_seed`` (success rate per seed),
    and every agent but the baseline ``difference`` (its rate minus the baseline's), ``difference_ci``,
    ``only_this`` / ``only_baseline`` (discordant episodes) and ``mcnemar_p``. Rates are fractions in [0, 1].
    ValueError when the agents did not play the same episodes or ``baseline`` is not one of them.
    """
    if resamples < 1:
        raise ValueError(f"resamples must be at least 1, got {resamples}")
    keys = _check_same_episodes(named)
    names = list(named)
    baseline = names[0] if baseline is None else baseline
    if baseline not in named:
        raise ValueError(f"baseline {baseline!r} is not one of the evaluations {names}")
    tasks = sorted({task for task, _ in keys})
    seeds = sorted({s for _, s in keys})
    task_index = {task: i for i, task in enumerate(tasks)}
    # wins[a, t] and plays[t]: wins of agent a on task t summed over its seeds, and the episodes of task t
    wins = np.zeros((len(names), len(tasks)))
    plays = np.zeros(len(tasks))
    for task, s in keys:
        plays[task_index[task]] += 1
        for a, name in enumerate(names):
            wins[a, task_index[task]] += named[name][(task, s)]
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, len(tasks), size=(resamples, len(tasks)))
    counts = np.stack([np.bincount(row, minlength=len(tasks)) for row in draws])   # (resamples, tasks)
    boot_plays = counts @ plays
    boot_rates = (counts @ wins.T) / boot_plays[:, None]                            # (resamples, agents)
    b = names.index(baseline)
    agents: dict[str, Any] = {}
    for a, name in enumerate(names):
        outcomes = named[name]
        row: dict[str, Any] = {
            "successes": int(wins[a].sum()), "success_rate": float(wins[a].sum() / len(keys)),
            "success_ci": _interval(boot_rates[:, a]),
            "per_seed": {str(s): float(np.mean([outcomes[(t, s2)] for t, s2 in keys if s2 == s])) for s in seeds},
        }
        if a != b:
            only_this = sum(outcomes[k] and not named[baseline][k] for k in keys)
            only_base = sum(named[baseline][k] and not outcomes[k] for k in keys)
            row.update(difference=row["success_rate"] - float(wins[b].sum() / len(keys)),
                       difference_ci=_interval(boot_rates[:, a] - boot_rates[:, b]),
                       only_this=int(only_this), only_baseline=int(only_base),
                       mcnemar_p=mcnemar_exact_p(int(only_this), int(only_base)))
        agents[name] = row
    return {"baseline": baseline, "episodes": len(keys), "tasks": len(tasks), "seeds": seeds,
            "resamples": int(resamples), "confidence": CONFIDENCE, "agents": agents}


__all__ = ["BOOTSTRAP_RESAMPLES", "CONFIDENCE", "outcomes_of", "restrict_to_common", "mcnemar_exact_p",
           "paired_comparison"]
