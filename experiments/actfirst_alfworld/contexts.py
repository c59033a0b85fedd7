"""Initial interaction contexts of ALFWorld training tasks for the rollout-speedup experiment (App. C.5).

Owns sampling tasks proportionally across the six task types with a seed, reading each sampled game's initial
context (reset observation, instruction, admissible actions) from the real engine, saving / loading such a
context set as JSON (so machines without the ``alfworld`` package can run the experiment), and rendering the
two prompts of each context (think-then-act and action-only) into token ids.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from jaxopd_envs.alfworld import TASK_TYPES as ALFWORLD_TASK_TYPES  # stdlib-only import: no alfworld needed
from .protocol import TaskContext

ALFWORLD_PROMPT_LIMIT = 10_240      # ActFirst paper's ALFWorld prompt limit (App. C, Table 6)
FULL_MODE = "full"                  # think-then-act prompt of full responses
FAST_MODE = "next_action"           # action-only prompt without reference (App. C.5)
SNAPSHOT_FORMAT = 1


@dataclasses.dataclass(frozen=True)
class InitialContext:
    """What the agent sees at turn 1 of an ALFWorld task."""

    task_id: str
    task_type: str
    instruction: str
    observation: str
    admissible_actions: tuple[str, ...]

    def __post_init__(self):
        if self.task_type not in ALFWORLD_TASK_TYPES:
            raise ValueError(f"{self.task_id}: unknown ALFWorld task type {self.task_type!r}")
        if not self.admissible_actions:
            raise ValueError(f"{self.task_id}: an initial context needs its admissible actions")
        object.__setattr__(self, "admissible_actions", tuple(self.admissible_actions))


@dataclasses.dataclass(frozen=True)
class ContextSet:
    """Sampled initial contexts, in sampling order (consecutive groups of 16 form the batches), and where
    they came from (games source, pool size per task type, seed)."""

    contexts: tuple[InitialContext, ...]
    source: dict[str, Any]

    def __len__(self) -> int:
        return len(self.contexts)

    def head(self, n: int) -> "ContextSet":
        if n > len(self.contexts):
            raise ValueError(f"asked for {n} contexts, the set has {len(self.contexts)}")
        return ContextSet(self.contexts[:n], {**self.source, "num_contexts": n})


# -------------------------------------------------------------------------------------------- sampling
def proportional_allocation(pool_counts: Mapping[str, int], n: int) -> dict[str, int]:
    """Split ``n`` draws across types in proportion to ``pool_counts`` (largest-remainder rounding; ties go
    to the type listed first). Every type with a pool gets ``floor`` or ``ceil`` of its exact share."""
    if n < 0:
        raise ValueError(f"number of draws must be >= 0, got {n}")
    total = sum(pool_counts.values())
    if total <= 0:
        raise ValueError("cannot allocate draws over an empty pool")
    exact = {k: n * c / total for k, c in pool_counts.items()}
    quota = {k: math.floor(v) for k, v in exact.items()}
    left = n - sum(quota.values())
    order = sorted(pool_counts, key=lambda k: (-(exact[k] - quota[k]), list(pool_counts).index(k)))
    for k in order[:left]:
        quota[k] += 1
    return quota


def sample_proportionally(task_types: Sequence[str], n: int, seed: int) -> list[int]:
    """Indices into ``task_types`` (one entry per task of the pool): ``n`` draws allocated across types in
    proportion to the pool (``proportional_allocation``), drawn without replacement within a type while the
    type's pool lasts (then a fresh permutation of it is appended, and so on), returned in a seeded random
    order so that consecutive batches mix types. Deterministic in ``seed``."""
    if n < 1:
        raise ValueError(f"number of contexts must be >= 1, got {n}")
    by_type: dict[str, list[int]] = collections.defaultdict(list)
    for i, task_type in enumerate(task_types):
        by_type[task_type].append(i)
    if not by_type:
        raise ValueError("the task pool is empty")
    types = ([t for t in ALFWORLD_TASK_TYPES if t in by_type]
             + sorted(t for t in by_type if t not in ALFWORLD_TASK_TYPES))
    quota = proportional_allocation({t: len(by_type[t]) for t in types}, n)
    rng = np.random.default_rng(seed)
    chosen: list[int] = []
    for t in types:
        pool = by_type[t]
        picks: list[int] = []
        while len(picks) < quota[t]:
            take = min(len(pool), quota[t] - len(picks))
            picks.extend(pool[j] for j in rng.permutation(len(pool))[:take])
        chosen.extend(picks)
    return [chosen[j] for j in rng.permutation(len(chosen))]


# ----------------------------------------------------------------------------------------- from ALFWorld
def collect_initial_contexts(n: int, *, seed: int = 42, split: str = "train",
                             game_root: str | os.PathLike | None = None) -> ContextSet:
    """Sample ``n`` tasks of ``split`` proportionally across task types and read their initial contexts from
    the real ALFWorld engine (official games under ``$ALFWORLD_DATA`` or ``game_root``, else the generated
    ones of ``jaxopd_envs.alfworld_gen``, generated on first use)."""
    from jaxopd_envs.alfworld import AlfWorldEnv   # needs the alfworld package

    env = AlfWorldEnv(game_root)
    try:
        tasks = list(env.tasks(split))
        picks = sample_proportionally([t.task_type for t in tasks], n, seed)
        observed: dict[str, InitialContext] = {}
        contexts = []
        for i in picks:
            task = tasks[i]
            if task.task_id not in observed:
                obs = env.reset(task)
                observed[task.task_id] = InitialContext(task.task_id, task.task_type, obs.instruction, obs.text,
                                                        tuple(obs.admissible_actions))
            contexts.append(observed[task.task_id])
    finally:
        env.close()
    pool = collections.Counter(t.task_type for t in tasks)
    sampled = collections.Counter(c.task_type for c in contexts)
    source = {"benchmark": "alfworld", "games": env.source, "game_root": str(env.game_root), "split": split,
              "seed": seed, "num_contexts": n, "distinct_tasks": len(observed), "pool_size": len(tasks),
              "pool_per_type": {t: pool.get(t, 0) for t in ALFWORLD_TASK_TYPES},
              "sampled_per_type": {t: sampled.get(t, 0) for t in ALFWORLD_TASK_TYPES}}
    return ContextSet(tuple(contexts), source)


# ------------------------------------------------------------------------------------------- snapshots
def save_context_set(path: str | os.PathLike, context_set: ContextSet) -> Path:
    """Write a context set as JSON (distinct contexts once, plus the sampled order)."""
    distinct: dict[str, InitialContext] = {}
    for c in context_set.contexts:
        distinct.setdefault(c.task_id, c)
    payload = {"format": SNAPSHOT_FORMAT, "source": context_set.source,
               "order": [c.task_id for c in context_set.contexts],
               "contexts": [dataclasses.asdict(c) for c in distinct.values()]}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1, ensure_ascii=False) + "\n")
    return path


def load_context_set(path: str | os.PathLike) -> ContextSet:
    """Read a snapshot written by ``save_context_set``."""
    path = Path(path)
    try:
        payload = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the context snapshot {str(path)!r}: {exc}") from exc
    if not isinstance(payload, dict) or payload.get("format") != SNAPSHOT_FORMAT:
        raise ValueError(f"{str(path)!r} is not a context snapshot of format {SNAPSHOT_FORMAT}")
    expected = {"contexts": list, "order": list, "source": dict}
    for key, kind in expected.items():
        if not isinstance(payload.get(key), kind):
            raise ValueError(f"{str(path)!r} is not a complete context snapshot: its {key!r} is "
                             f"{'missing' if key not in payload else type(payload[key]).__name__}, a "
                             f"{kind.__name__} is needed (snapshots are written by --write-contexts-snapshot)")
    fields = {f.name for f in dataclasses.fields(InitialContext)}
    by_id = {}
    for index, entry in enumerate(payload["contexts"]):
        if not isinstance(entry, dict) or set(entry) != fields:
            given = sorted(entry) if isinstance(entry, dict) else type(entry).__name__
            raise ValueError(f"{str(path)!r}: context {index} needs exactly the fields {sorted(fields)}, got {given}")
        try:
            if isinstance(entry["admissible_actions"], str):
                raise TypeError("admissible_actions is one string, not a list of actions")
            actions = tuple(entry["admissible_actions"])
            by_id[entry["task_id"]] = InitialContext(**dict(entry, admissible_actions=actions))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{str(path)!r}: context {index}: {exc}") from None
    missing = [t for t in payload["order"] if not isinstance(t, str) or t not in by_id]
    if missing:
        raise ValueError(f"{str(path)!r}: the order names unknown contexts, e.g. {missing[0]!r}")
    source = dict(payload["source"], snapshot=str(path))
    return ContextSet(tuple(by_id[t] for t in payload["order"]), source)


# ----------------------------------------------------------------------------------------------- prompts
def tokenize_contexts(context_set: ContextSet, tokenizer: Any, *,
                      max_prompt_tokens: int = ALFWORLD_PROMPT_LIMIT) -> list[TaskContext]:
    """Render each context's think-then-act and action-only prompts (no history at turn 1) into token ids."""
    from jaxopd.rollout.prompts import PromptInputs, render_prompt

    rendered: dict[str, tuple[list[int], list[int]]] = {}
    out = []
    for index, c in enumerate(context_set.contexts):
        if c.task_id not in rendered:
            inputs = PromptInputs(benchmark="alfworld", instruction=c.instruction, history=(),
                                  observation=c.observation, admissible_actions=c.admissible_actions)
            full = render_prompt(tokenizer, FULL_MODE, inputs, max_prompt_tokens).token_ids
            fast = render_prompt(tokenizer, FAST_MODE, inputs, max_prompt_tokens).token_ids
            rendered[c.task_id] = (full, fast)
        full, fast = rendered[c.task_id]
        out.append(TaskContext(index=index, context_id=c.task_id, task_type=c.task_type,
                               full_prompt_ids=tuple(full), fast_prompt_ids=tuple(fast)))
    return out
