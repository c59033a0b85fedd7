"""Evaluation of a student agent: the student alone, think-then-act (the vanilla rollout), over evaluation tasks and
seeds; per-episode records, their summary (mean ± sample std over seeds, per task type) and its outputs.

Owns ``EpisodeRecord`` (one task × seed outcome), ``summarize`` (a pure function of the records),
``evaluate_policy`` (runs ``VanillaStrategy`` for every seed on an ``EnvPool``; an episode that raises is kept as
a failed record with its reason), ``markdown_table`` / ``write_evaluation`` (JSON, markdown, CSV and a per-task-type
PNG) and ``plot_learning_curves`` (success rate against update and against wall-clock, from the evaluation records
training runs write). Task sources and splits are ``jaxopd.methods.benchmarks``'s; the command line is
``experiments.evaluate``.

The protocol of ActFirst-OPD (papers/actfirst-opd.txt, Sec. 5 "Evaluation Protocols and Metrics", App. C.1 and
App. C.4, Table 7):

- think-then-act interaction without reference information; one trajectory per task and seed; evaluation seeds
  42, 43 and 44 for the same checkpoint; every metric reported as the mean and the *sample* standard deviation
  (ddof = 1) over the three seeds (App. C.4);
- sampling temperature 0.4, top-p 1.0, top-k disabled, thinking mode on (Table 7; training rollouts use 1.0);
- prompt limit 20,480 tokens; full responses under the App. B.3 thinking budget of 1,920 first-stage / 2,048
  total tokens, the continuation at most 128 tokens (training: 384 / 512);
- 30 interaction turns on ALFWorld and ScienceWorld; evaluation batch 64 tasks;
- ALFWorld: 140 ``valid_seen`` and 134 ``valid_unseen`` tasks, evaluated separately; "task-type and overall
  results pool the seen and unseen tasks" (Table 1's All column); ScienceWorld: the 150-task ``eval`` split;
- metrics (App. C.1): success rate (SR, a percentage; success = the goal within the turn limit; ScienceWorld:
  score >= 99.999, which is ``jaxopd_envs.scienceworld``'s ``won``), Round = interaction turns averaged over successful
  *and* failed episodes, invalid attempts included (a failed ALFWorld episode counts 30), and ScienceWorld's score,
  the highest score reached in the episode clipped to [0, 100].

Here success rates are fractions in [0, 1] in every dict and file (the markdown table shows percentages); scores
are the environment's (ScienceWorld 0-100; ALFWorld 1.0 when won). ``greedy`` evaluation (temperature 0) is offered
besides the paper's sampled evaluation; under it the seeds differ in nothing but their name.
"""
from __future__ import annotations

import concurrent.futures
import csv
import dataclasses
import json
import logging
import math
import queue
import statistics
import threading
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from jaxopd_envs.base import Task
from jaxopd.rollout.prompts import executed_actions_and_answers
from jaxopd.rollout.strategies.base import Episode, RolloutConfig
from jaxopd.rollout.strategies.vanilla import VanillaStrategy
from jaxopd.rollout.trajectory import Trajectory, Turn

logger = logging.getLogger(__name__)

__all__ = ["PAPER_SEEDS", "PAPER_TEMPERATURE", "ALFWORLD_TASK_TYPES", "EpisodeRecord", "summarize",
           "evaluate_policy", "markdown_table", "write_evaluation", "plot_learning_curves", "history_record",
           "read_history", "OUTPUT_FILES", "CURVE_FILES"]

PAPER_SEEDS = (42, 43, 44)
PAPER_TEMPERATURE = 0.4
STD_KIND = "sample standard deviation over seeds (ddof=1); null with a single seed"
# Table 1's order and column names.
ALFWORLD_TASK_TYPES = {"pick_and_place_simple": "Pick", "look_at_obj_in_light": "Look",
                       "pick_clean_then_place_in_recep": "Clean", "pick_heat_then_place_in_recep": "Heat",
                       "pick_cool_then_place_in_recep": "Cool", "pick_two_obj_and_place": "Pick2"}
OUTPUT_FILES = ("evaluation.json", "evaluation.md", "episodes.csv", "success_by_task_type.png")
CURVE_FILES = ("success_vs_update.png", "success_vs_wallclock.png")
ERROR_PREFIX = "error: "
_TRANSCRIPT_FIELDS = ("actions", "feedback", "answers")     # per-round lists: in evaluation.json only


# ----------------------------------------------------------------------------------------------- records
@dataclasses.dataclass(frozen=True)
class EpisodeRecord:
    """One evaluation episode: a task played once under one seed. ``rounds``: the executed turns (invalid attempts
    included); ``end_reason``: the trajectory's (``trajectory.END_REASONS``) or ``"error: ..."`` for an episode that
    raised (then ``won`` is False and ``score`` the last one the environment reported). ``split``: the task's.
    ``actions`` / ``feedback`` / ``answers``: the executed action of each round, the environment's answer to it
    and the model's response text that chose it, thinking included (the transcript a reader checks the agent by;
    in ``evaluation.json``, not in the CSV). ``instruction``: the task instruction the agent was given (in both)."""

    task_id: str
    task_type: str
    seed: int
    won: bool
    score: float
    rounds: int
    end_reason: str
    split: str = ""
    actions: tuple[str, ...] = ()
    feedback: tuple[str, ...] = ()
    answers: tuple[str, ...] = ()
    instruction: str = ""

    @classmethod
    def from_trajectory(cls, trajectory: Trajectory, seed: int) -> "EpisodeRecord":
        return cls(task_id=trajectory.task.task_id, task_type=trajectory.task.task_type, seed=int(seed),
                   won=bool(trajectory.won), score=float(trajectory.score), rounds=int(trajectory.num_turns),
                   end_reason=str(trajectory.end_reason), split=trajectory.task.split,
                   actions=tuple(turn.action for turn in trajectory.turns),
                   feedback=tuple(turn.next_observation.text for turn in trajectory.turns),
                   answers=tuple(_choosing_text(turn) for turn in trajectory.turns),
                   instruction=trajectory.turns[0].observation.instruction if trajectory.turns else "")

    @property
    def failed_with_error(self) -> bool:
        return self.end_reason.startswith(ERROR_PREFIX)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "EpisodeRecord":
        """The record ``as_dict`` gave (read back from JSON: its lists become tuples again)."""
        values = dict(data)
        for name in _TRANSCRIPT_FIELDS:
            values[name] = tuple(values.get(name, ()))
        return cls(**values)


# ----------------------------------------------------------------------------------------------- summary
def _mean(values: Sequence[float]) -> float | None:
    return float(statistics.fmean(values)) if values else None


def _across_seeds(values: Sequence[float | None]) -> dict[str, Any]:
    """Mean and sample std (ddof=1) of per-seed values; seeds without a value (e.g. no success) are left out and
    ``n`` says how many seeds contributed."""
    present = [float(v) for v in values if v is not None]
    std = float(statistics.stdev(present)) if len(present) > 1 else None
    return {"mean": _mean(present), "std": std, "n": len(present)}


def _seed_metrics(records: Sequence[EpisodeRecord]) -> dict[str, Any]:
    successes = [r for r in records if r.won]
    return {"episodes": len(records), "successes": len(successes),
            "success_rate": len(successes) / len(records) if records else None,
            "mean_rounds": _mean([r.rounds for r in records]),
            "mean_rounds_success": _mean([r.rounds for r in successes]),
            "mean_score": _mean([r.score for r in records]),
            "errors": sum(r.failed_with_error for r in records)}


def _task_type_order(task_types: Iterable[str]) -> list[str]:
    present = set(task_types)
    known = [t for t in ALFWORLD_TASK_TYPES if t in present]
    return known + sorted(present - set(known))


def summarize(records: Sequence[EpisodeRecord], *, benchmark: str, split: str) -> dict[str, Any]:
    """The summary of evaluation episodes (a pure function; deterministic key order).

    Per seed: episodes, successes, success rate, mean rounds over all episodes and over successful ones, mean score,
    errors. Overall and per task type: the mean and sample std (ddof=1) over seeds of the per-seed values (null std
    with one seed). ``split`` only labels the summary (records of several splits are pooled as given).
    """
    records = list(records)
    seeds = sorted({r.seed for r in records})
    by_seed = {seed: [r for r in records if r.seed == seed] for seed in seeds}
    per_seed = {str(seed): _seed_metrics(by_seed[seed]) for seed in seeds}
    metrics = ("success_rate", "mean_rounds", "mean_rounds_success", "mean_score")
    overall = {name: _across_seeds([per_seed[str(s)][name] for s in seeds]) for name in metrics}
    task_types: dict[str, Any] = {}
    for task_type in _task_type_order(r.task_type for r in records):
        per_type_seed = {seed: _seed_metrics([r for r in by_seed[seed] if r.task_type == task_type])
                         for seed in seeds}
        present = [seed for seed in seeds if per_type_seed[seed]["episodes"]]
        task_types[task_type] = {
            "label": ALFWORLD_TASK_TYPES.get(task_type, task_type),
            "episodes": sum(per_type_seed[s]["episodes"] for s in present),
            "tasks": len({r.task_id for r in records if r.task_type == task_type}),
            **{name: _across_seeds([per_type_seed[s][name] for s in present]) for name in metrics},
            "per_seed_success_rate": {str(s): per_type_seed[s]["success_rate"] for s in present},
        }
    end_reasons: dict[str, int] = {}
    for r in records:
        key = ERROR_PREFIX.strip() if r.failed_with_error else r.end_reason
        end_reasons[key] = end_reasons.get(key, 0) + 1
    return {
        "benchmark": benchmark,
        "split": split,
        "seeds": seeds,
        "std": STD_KIND,
        "num_episodes": len(records),
        "num_tasks": len({r.task_id for r in records}),
        "num_errors": sum(r.failed_with_error for r in records),
        "end_reasons": dict(sorted(end_reasons.items())),
        "overall": overall,
        "per_seed": per_seed,
        "task_types": task_types,
    }


# ----------------------------------------------------------------------------------------------- running
class _EvalVanilla(VanillaStrategy):
    """Vanilla think-then-act that exposes each slot's live episode, so an episode that raises keeps its turns."""

    def __init__(self, *args, live: dict[int, Episode], **kwargs):
        super().__init__(*args, **kwargs)
        self._live = live

    def start_episode(self, episode: Episode) -> None:
        super().start_episode(episode)
        self._live[episode.slot] = episode


def _choosing_text(turn: Turn) -> str:
    """The text of the response that chose a turn's action (its action request's, else its full response's)."""
    responses = turn.action_responses or turn.responses
    return responses[0].text if responses else ""


def _error_record(task: Task, seed: int, error: BaseException, episode: Episode | None) -> EpisodeRecord:
    message = " ".join(f"{type(error).__name__}: {error}".split())[:300]
    rounds, score, actions, feedback, instruction = 0, 0.0, (), (), ""
    if episode is not None and episode.task.task_id == task.task_id:
        rounds, score = len(episode.steps), float(episode.observation.score)
        actions, feedback = executed_actions_and_answers(episode.history, episode.observation.text)
        instruction = episode.observation.instruction
    return EpisodeRecord(task_id=task.task_id, task_type=task.task_type, seed=int(seed), won=False, score=score,
                         rounds=rounds, end_reason=f"{ERROR_PREFIX}{message}", split=task.split, actions=actions,
                         feedback=feedback, instruction=instruction)


def evaluate_policy(engine: Any, source_or_pool: Any, tokenizer: Any, tasks: Sequence[Task], *,
                    seeds: Sequence[int] = PAPER_SEEDS, rollout_config: RolloutConfig, greedy: bool,
                    progress: bool = True, slots: int | None = None, backend: str = "auto",
                    benchmark: str | None = None, split: str | None = None,
                    done: Mapping[tuple[int, str], EpisodeRecord] | None = None,
                    on_record: Callable[[EpisodeRecord], None] | None = None
                    ) -> tuple[dict[str, Any], list[EpisodeRecord]]:
    """Play every task once per seed with the vanilla think-then-act strategy; ``(summarize(records), records)``.

    ``source_or_pool``: an ``EnvPool`` (used as is) or a ``BenchmarkSource`` (a pool of ``slots`` slots is built on
    its factory, ``backend`` as ``EnvPool`` takes it, and closed afterwards). Each seed runs with
    ``rollout_config`` with ``seed`` set to it and, when ``greedy``, temperature 0. All (seed, task) episodes share
    the pool's slots, at most one episode per slot at a time. ``RolloutStrategy.collect`` lets the first exception
    end the whole batch, so episodes are run here one by one: an episode that raises is recorded as failed
    (``end_reason`` ``"error: <type>: <message>"``, its executed turns as rounds) and the others go on. Records come
    in seed order, then task order.

    ``done`` maps ``(seed, task_id)`` to the record of an episode already played (a resumed evaluation): it is not
    played again and comes back in its place. ``on_record(record)`` is called once for each episode played here,
    as it finishes (``experiments.evaluate`` appends it to a file, so a killed evaluation resumes).
    """
    tasks = list(tasks)
    seeds = [int(s) for s in seeds]
    if not tasks:
        raise ValueError("evaluate_policy needs at least one task")
    if not seeds:
        raise ValueError("evaluate_policy needs at least one seed")
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds must be distinct, got {seeds}")
    benchmark = benchmark or tasks[0].benchmark
    split = split or "+".join(dict.fromkeys(t.split for t in tasks))
    temperature = 0.0 if greedy else rollout_config.temperature

    from jaxopd_envs.pool import EnvPool
    own_pool = not isinstance(source_or_pool, EnvPool)
    if own_pool:
        factory = getattr(source_or_pool, "env_factory", source_or_pool)
        if not callable(factory):
            raise ValueError(f"source_or_pool must be an EnvPool or a BenchmarkSource, got "
                             f"{type(source_or_pool).__name__}")
        num_slots = slots or min(len(tasks) * len(seeds), int(getattr(engine, "max_slots", 8) or 8))
        pool = EnvPool(factory, num_slots=max(1, num_slots), backend=backend)
    else:
        pool = source_or_pool
    try:
        live: dict[int, Episode] = {}
        strategies = {seed: _EvalVanilla(engine, pool, tokenizer,
                                         dataclasses.replace(rollout_config, seed=seed, temperature=temperature),
                                         live=live)
                      for seed in seeds}
        done = dict(done or {})
        jobs = [(seed, task) for seed in seeds for task in tasks if (seed, task.task_id) not in done]
        free_slots: queue.SimpleQueue = queue.SimpleQueue()
        for slot in range(pool.num_slots):
            free_slots.put(slot)
        lock = threading.Lock()
        counts = {"won": sum(r.won for r in done.values()), "errors": sum(r.failed_with_error for r in done.values())}
        from tqdm import tqdm
        bar = tqdm(total=len(jobs) + len(done), initial=len(done), desc=f"evaluate {benchmark} {split}",
                   unit="episode", disable=not progress, dynamic_ncols=True)

        def play(seed: int, task: Task) -> EpisodeRecord:
            slot = free_slots.get()
            try:
                live.pop(slot, None)
                try:
                    record = EpisodeRecord.from_trajectory(strategies[seed].run_episode(slot, task), seed)
                except Exception as error:  # noqa: BLE001 - reported as a failed episode, never lost
                    logger.warning("episode %s (seed %d) failed", task.task_id, seed, exc_info=True)
                    record = _error_record(task, seed, error, live.get(slot))
            finally:
                live.pop(slot, None)
                free_slots.put(slot)
            with lock:
                if on_record is not None:
                    on_record(record)
                counts["won"] += record.won
                counts["errors"] += record.failed_with_error
                bar.update(1)
                bar.set_postfix(won=counts["won"], errors=counts["errors"], refresh=False)
            return record

        try:
            workers = max(1, min(pool.num_slots, len(jobs)))
            with concurrent.futures.ThreadPoolExecutor(max_workers=workers,
                                                       thread_name_prefix="evaluate") as executor:
                futures = {(seed, task.task_id): executor.submit(play, seed, task) for seed, task in jobs}
                played = {key: future.result() for key, future in futures.items()}
            records = [done[key] if key in done else played[key]
                       for key in ((seed, task.task_id) for seed in seeds for task in tasks)]
        finally:
            bar.close()
    finally:
        if own_pool:
            pool.close()
    return summarize(records, benchmark=benchmark, split=split), records


# ----------------------------------------------------------------------------------------------- outputs
def _fmt(stat: Mapping[str, Any], scale: float = 1.0, digits: int = 1) -> str:
    mean, std = stat.get("mean"), stat.get("std")
    if mean is None:
        return "—"
    text = f"{mean * scale:.{digits}f}"
    return text + (f" ± {std * scale:.{digits}f}" if std is not None else "")


def _benchmark_name(benchmark: str) -> str:
    return {"alfworld": "ALFWorld", "scienceworld": "ScienceWorld"}.get(benchmark, benchmark)


def markdown_table(summary: Mapping[str, Any]) -> str:
    """The summary as markdown: overall metrics, per task type, per seed ("mean ± std" over seeds)."""
    with_score = summary["benchmark"] != "alfworld"
    seeds = summary["seeds"]
    std_note = "sample std over seeds" if len(seeds) > 1 else "one seed, no std"
    lines = [f"### {_benchmark_name(summary['benchmark'])} `{summary['split']}` — seeds {', '.join(map(str, seeds))} "
             f"(mean ± {std_note})", "",
             f"{summary['num_tasks']} tasks × {len(seeds)} seed(s) = {summary['num_episodes']} episodes"
             + (f"; **{summary['num_errors']} episode(s) failed with an error**" if summary["num_errors"] else "")
             + "; end reasons: " + ", ".join(f"{k} {v}" for k, v in summary["end_reasons"].items()), "",
             "| Metric | Value |", "|---|---|"]
    overall = summary["overall"]
    lines.append(f"| Success rate (%) | {_fmt(overall['success_rate'], 100)} |")
    if with_score:
        lines.append(f"| Score | {_fmt(overall['mean_score'])} |")
    lines.append(f"| Rounds (all episodes) | {_fmt(overall['mean_rounds'])} |")
    lines.append(f"| Rounds (successful episodes) | {_fmt(overall['mean_rounds_success'])} |")
    lines += ["", "| Task type | Tasks | Success rate (%) | " + ("Score | " if with_score else "") + "Rounds |",
              "|---|---|---|" + ("---|" if with_score else "") + "---|"]
    for name, row in summary["task_types"].items():
        label = row["label"] if row["label"] == name else f"{row['label']} (`{name}`)"
        lines.append(f"| {label} | {row['tasks']} | {_fmt(row['success_rate'], 100)} | "
                     + (f"{_fmt(row['mean_score'])} | " if with_score else "") + f"{_fmt(row['mean_rounds'])} |")
    lines += ["", "| Seed | Episodes | Successes | Success rate (%) | " + ("Score | " if with_score else "")
              + "Rounds | Errors |", "|---|---|---|---|" + ("---|" if with_score else "") + "---|---|"]
    for seed, row in summary["per_seed"].items():
        score = f"{row['mean_score']:.1f} | " if with_score else ""
        lines.append(f"| {seed} | {row['episodes']} | {row['successes']} | {100 * row['success_rate']:.1f} | {score}"
                     f"{row['mean_rounds']:.1f} | {row['errors']} |")
    return "\n".join(lines) + "\n"


def _as_summaries(summary: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [summary] if isinstance(summary, Mapping) else list(summary)


def _json_default(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if hasattr(value, "item"):
        return value.item()
    return str(value)


def write_evaluation(out_dir: str | Path, summary: Mapping[str, Any] | Sequence[Mapping[str, Any]],
                     records: Sequence[EpisodeRecord], meta: Mapping[str, Any]) -> list[Path]:
    """Write ``evaluation.json`` (meta, summaries, episodes), ``evaluation.md``, ``episodes.csv`` and
    ``success_by_task_type.png`` into ``out_dir``; returns their paths. ``summary``: one summary or several (e.g.
    one per split and their pooled summary)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summaries = _as_summaries(summary)
    paths = [out / name for name in OUTPUT_FILES]
    payload = {"meta": dict(meta), "summaries": summaries, "episodes": [r.as_dict() for r in records]}
    paths[0].write_text(json.dumps(payload, indent=2, default=_json_default) + "\n")
    md = ["# Student evaluation", ""]
    for note in meta.get("notes", ()):
        md.append(f"> {note}")
    if meta.get("notes"):
        md.append("")
    for key in ("command", "model", "source", "sampling"):
        if key in meta:
            value = meta[key]
            if isinstance(value, Mapping):
                value = value.get("description") or ", ".join(f"{k} {v}" for k, v in value.items())
            md.append(f"- {key}: {value}")
    md.append("")
    for s in summaries:
        md += [markdown_table(s), ""]
    departures = meta.get("departures") or []
    if departures:
        md += ["## Departures from the paper's evaluation protocol", ""] + [f"- {d}" for d in departures] + [""]
    paths[1].write_text("\n".join(md))
    with paths[2].open("w", newline="") as handle:
        fields = [f.name for f in dataclasses.fields(EpisodeRecord) if f.name not in _TRANSCRIPT_FIELDS]
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        for r in records:
            writer.writerow({name: value for name, value in r.as_dict().items() if name in fields})
    _plot_task_types(summaries, paths[3])
    return paths


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _plot_task_types(summaries: Sequence[Mapping[str, Any]], path: Path) -> None:
    plt = _pyplot()
    types: list[str] = _task_type_order(t for s in summaries for t in s["task_types"])
    labels = ["All"] + [ALFWORLD_TASK_TYPES.get(t, t) for t in types]
    width = 0.8 / max(1, len(summaries))
    fig, ax = plt.subplots(figsize=(max(6.0, 2.5 + len(labels) * (0.4 + 0.3 * len(summaries))), 4.2))
    for i, s in enumerate(summaries):
        stats = [s["overall"]["success_rate"]] + [s["task_types"].get(t, {}).get("success_rate", {}) for t in types]
        means = [100 * (st.get("mean") or 0.0) for st in stats]
        stds = [100 * (st.get("std") or 0.0) for st in stats]
        errors = [[min(d, m) for d, m in zip(stds, means)], [min(d, 100 - m) for d, m in zip(stds, means)]]
        xs = [j + (i - (len(summaries) - 1) / 2) * width for j in range(len(labels))]
        ax.bar(xs, means, width, yerr=errors, capsize=3,       # error bars clipped to [0, 100]
               label=f"{_benchmark_name(s['benchmark'])} {s['split']}")
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=30 if len(labels) > 8 else 0, ha="right" if len(labels) > 8 else "center",
                       fontsize=8 if len(labels) > 8 else 10)
    ax.set_ylabel("success rate (%)")
    ax.set_ylim(0, 105)
    seeds = summaries[0]["seeds"] if summaries else []
    ax.set_title(f"Success rate by task type (mean ± std over seeds {', '.join(map(str, seeds))})", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------- learning curves
def history_record(summary: Mapping[str, Any], *, update: int, wall_s: float, label: str | None = None
                   ) -> dict[str, Any]:
    """One learning-curve point from an evaluation summary (what a training run appends to its JSONL history)."""
    rate = summary["overall"]["success_rate"]
    record = {"update": int(update), "wall_s": float(wall_s), "success_rate_mean": rate["mean"],
              "success_rate_std": rate["std"] if rate["std"] is not None else 0.0,
              "benchmark": summary["benchmark"], "split": summary["split"]}
    if label is not None:
        record["label"] = label
    return record


def read_history(paths: Sequence[str | Path]) -> list[dict[str, Any]]:
    """The learning-curve records of JSONL files (one dict per line; blank lines skipped). ``ValueError`` naming
    the file and line for a missing file, bad JSON or a record without update / wall_s / success_rate_mean. A record
    without label or method is labelled by its file's name."""
    history = []
    for path in map(Path, paths):
        if not path.is_file():
            raise ValueError(f"--history {str(path)!r} is not a file")
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: not JSON ({exc.msg})") from None
            try:
                _check_history_record(record)
            except ValueError as exc:
                raise ValueError(f"{path}:{number}: {exc}") from None
            if "label" not in record and "method" not in record:
                record = {**record, "label": path.stem}
            history.append(record)
    if not history:
        raise ValueError("the --history files hold no records")
    return history


def _check_history_record(record: Any) -> None:
    if not isinstance(record, Mapping):
        raise ValueError(f"a history record must be a JSON object, got {type(record).__name__}")
    for key in ("update", "wall_s", "success_rate_mean"):
        value = record.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"history record needs a finite number {key!r}, got {value!r}")
    std = record.get("success_rate_std")
    if std is not None and (isinstance(std, bool) or not isinstance(std, (int, float)) or not math.isfinite(std)):
        raise ValueError(f"history record's 'success_rate_std' must be a finite number, got {std!r}")


def plot_learning_curves(history: Sequence[Mapping[str, Any]], out_dir: str | Path) -> list[Path]:
    """``success_vs_update.png`` and ``success_vs_wallclock.png``: one line per label (``label``, else ``method``,
    else "run"), error bars = ``success_rate_std``. Success rates are fractions in [0, 1], plotted in percent;
    wall-clock is ``wall_s`` (training time), shown in seconds, minutes or hours by its range."""
    for record in history:
        _check_history_record(record)
    if not history:
        raise ValueError("plot_learning_curves needs at least one history record")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lines: dict[str, list[Mapping[str, Any]]] = {}
    for record in history:
        lines.setdefault(str(record.get("label") or record.get("method") or "run"), []).append(record)
    max_wall = max(float(r["wall_s"]) for r in history)
    unit, divisor = ("s", 1.0) if max_wall < 120 else ("min", 60.0) if max_wall < 7200 else ("h", 3600.0)
    plt = _pyplot()
    paths = [out / name for name in CURVE_FILES]
    for path, key, xlabel, scale in ((paths[0], "update", "update", 1.0),
                                     (paths[1], "wall_s", f"training wall-clock ({unit})", divisor)):
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for label, points in lines.items():
            points = sorted(points, key=lambda r: (float(r[key]), float(r["update"])))
            xs = [float(r[key]) / scale for r in points]
            ys = [100 * float(r["success_rate_mean"]) for r in points]
            errors = [100 * float(r.get("success_rate_std") or 0.0) for r in points]
            ax.errorbar(xs, ys, yerr=errors, marker="o", markersize=3, capsize=3, label=label)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("evaluation success rate (%)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        ax.set_title("Success rate (mean ± std over evaluation seeds)", fontsize=10)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
    return paths
