"""Evaluate a student agent: the student alone, think-then-act, on ALFWorld ``valid_seen`` / ``valid_unseen`` or the
ScienceWorld ``eval`` split, for seeds 42, 43 and 44 (mean ± sample std over seeds), or plot learning curves from
the evaluation records training runs write.

Owns the command line: input checks (one line and exit code 2 for bad input), the model, tokenizer, engine and
task source, the run (``jaxopd.methods.evaluate.evaluate_policy``) and its outputs (``write_evaluation``: JSON,
markdown, per-episode CSV, a per-task-type PNG, with the command line, the machine and every departure from the
paper's evaluation protocol, which ``jaxopd.methods.evaluate``'s docstring records). Each finished episode is
appended to ``<out>/episodes.partial.jsonl`` (after a first line naming the evaluation's settings), so the same
command after a kill plays only the episodes not yet played; the file is removed once the outputs are written.

    python -m experiments.evaluate --student /models/student --benchmark alfworld --split valid_seen valid_unseen
    python -m experiments.evaluate --model-preset tiny --num-tasks 2 --seeds 42 --max-turns 2   # smoke test only
    python -m experiments.evaluate --history runs/a/eval.jsonl runs/b/eval.jsonl --out runs/curves
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from jaxopd import cli
from jaxopd.methods.benchmarks import (BENCHMARKS, EVAL_SPLITS, GAME_SOURCES, TRAIN_SPLIT, BenchmarkError,
                                       BenchmarkSource, resolve_source, subset)
from jaxopd.methods.evaluate import (PAPER_SEEDS, PAPER_TEMPERATURE, EpisodeRecord, evaluate_policy, markdown_table,
                                     plot_learning_curves, read_history, summarize, write_evaluation)

PAPER = {"max_turns": 30, "max_prompt_tokens": 20_480, "first_stage_tokens": 1_920, "total_tokens": 2_048,
         "second_stage_max_tokens": 128, "temperature": PAPER_TEMPERATURE, "top_p": 1.0, "top_k": 0,
         "seeds": PAPER_SEEDS, "batch": 64,
         "tasks": {("alfworld", "valid_seen"): 140, ("alfworld", "valid_unseen"): 134, ("scienceworld", "eval"): 150}}
DEFAULT_SPLIT = {"alfworld": "valid_unseen", "scienceworld": "eval"}
PAGE_SIZE = 64


@dataclasses.dataclass(frozen=True)
class EvalOptions:
    """Everything the run needs, checked by ``preflight``."""

    student: str | None
    model_preset: str | None
    benchmark: str
    games: str
    splits: tuple[str, ...]
    num_tasks: int | None
    seeds: tuple[int, ...]
    greedy: bool
    temperature: float
    max_turns: int
    max_prompt_tokens: int
    first_stage_tokens: int
    total_tokens: int
    slots: int
    num_pages: int | None
    out: Path
    progress: bool = True
    command: str = ""

    @property
    def random_weights(self) -> bool:
        return self.student is None


# ------------------------------------------------------------------------------------------------ the CLI
def build_parser() -> argparse.ArgumentParser:
    p = cli.Parser(prog="python -m experiments.evaluate",
                   description="Evaluate a student agent alone (think-then-act) on ALFWorld or ScienceWorld over "
                               "seeds, or plot learning curves (--history).")
    p.add_argument("--student", default=None, metavar="DIR", help="Hugging Face model folder of the student")
    p.add_argument("--model-preset", default=None, metavar="NAME",
                   help="an architecture preset with RANDOM weights and the offline Qwen3 tokenizer (smoke tests only; "
                        "e.g. tiny)")
    p.add_argument("--benchmark", default="alfworld", choices=BENCHMARKS)
    p.add_argument("--games", default="auto", choices=GAME_SOURCES,
                   help="ALFWorld games: auto (official under $ALFWORLD_DATA when set, else generated), generated, "
                        "official")
    p.add_argument("--split", nargs="+", default=None,
                   help="evaluation split(s) (default: valid_unseen on ALFWorld, eval on ScienceWorld); several "
                        "splits are also reported pooled, like the paper's All column")
    p.add_argument("--num-tasks", type=int, default=None, metavar="N",
                   help="a deterministic subset of N tasks per split (default: all)")
    p.add_argument("--seeds", type=int, nargs="+", default=list(PAPER_SEEDS), help="evaluation seeds (42 43 44)")
    sampling = p.add_mutually_exclusive_group()
    sampling.add_argument("--greedy", action="store_true", help="greedy decoding (temperature 0)")
    sampling.add_argument("--temperature", type=float, default=None,
                          help=f"sampling temperature (default {PAPER_TEMPERATURE}, the paper's evaluation)")
    p.add_argument("--max-turns", type=int, default=PAPER["max_turns"])
    p.add_argument("--max-prompt-tokens", type=int, default=PAPER["max_prompt_tokens"])
    p.add_argument("--think-tokens", type=int, nargs=2, default=[PAPER["first_stage_tokens"], PAPER["total_tokens"]],
                   metavar=("FIRST", "TOTAL"),
                   help="thinking budget of a full response: first-stage and total tokens (default 1920 2048; the "
                        "continuation makes at most 128)")
    p.add_argument("--slots", type=int, default=16, help="concurrent episodes (the engine's max_slots)")
    p.add_argument("--num-pages", type=int, default=None,
                   help="KV pages of the engine (default: every slot can hold a full-length sequence at once)")
    p.add_argument("--out", default=None, help="output folder (default runs/evaluate/<benchmark>-<time>)")
    p.add_argument("--history", nargs="+", default=None, metavar="FILE",
                   help="only plot learning curves from these JSONL evaluation records (one dict per line: update, "
                        "wall_s, success_rate_mean, success_rate_std, optional label/method)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def options_from_args(args: argparse.Namespace) -> EvalOptions:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(args.out) if args.out else Path("runs") / "evaluate" / f"{args.benchmark}-{stamp}"
    first, total = args.think_tokens
    return EvalOptions(student=args.student, model_preset=args.model_preset, benchmark=args.benchmark,
                       games=args.games, splits=tuple(args.split or (DEFAULT_SPLIT[args.benchmark],)),
                       num_tasks=args.num_tasks, seeds=tuple(args.seeds), greedy=args.greedy,
                       temperature=0.0 if args.greedy else (PAPER_TEMPERATURE if args.temperature is None
                                                            else args.temperature),
                       max_turns=args.max_turns, max_prompt_tokens=args.max_prompt_tokens,
                       first_stage_tokens=first, total_tokens=total, slots=args.slots, num_pages=args.num_pages,
                       out=out, progress=not args.no_progress,
                       command=cli.command_line("python -m experiments.evaluate"))


def check_options(options: EvalOptions) -> None:
    """The cheap checks of the user's input (no model, no games); ``ValueError`` naming the problem."""
    if (options.student is None) == (options.model_preset is None):
        raise ValueError("give exactly one of --student DIR (a trained student) or --model-preset NAME (random "
                         "weights, smoke tests only)")
    if options.student is not None:
        from jaxopd.models.folders import check_folder_tokenizer

        cli.check_checkpoint_folder("--student", options.student)
        check_folder_tokenizer(options.student)         # a Llama folder (or its base) carries its own tokenizer
    else:
        cli.check_random_preset("--model-preset", options.model_preset)
    if options.benchmark == "alfworld" and options.games != "generated":
        cli.check_alfworld_data()
    known = (*EVAL_SPLITS[options.benchmark], TRAIN_SPLIT[options.benchmark])
    for split in options.splits:
        if split not in known:
            raise ValueError(f"unknown {options.benchmark} split {split!r}; choose from {', '.join(known)}")
    if len(set(options.splits)) != len(options.splits):
        raise ValueError(f"--split names a split twice: {' '.join(options.splits)}")
    if options.games != "auto" and options.benchmark == "scienceworld":
        raise ValueError("--games applies to ALFWorld only")
    if options.num_tasks is not None and options.num_tasks < 1:
        raise ValueError(f"--num-tasks must be at least 1, got {options.num_tasks}")
    if len(set(options.seeds)) != len(options.seeds):
        raise ValueError(f"--seeds must be distinct, got {' '.join(map(str, options.seeds))}")
    if not math.isfinite(options.temperature) or options.temperature < 0:
        raise ValueError(f"--temperature must be a finite number >= 0, got {options.temperature}")
    for flag, value in (("--max-turns", options.max_turns), ("--max-prompt-tokens", options.max_prompt_tokens),
                        ("--slots", options.slots)):
        if value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")
    if not 0 < options.first_stage_tokens <= options.total_tokens:
        raise ValueError(f"--think-tokens needs 0 < FIRST <= TOTAL, got {options.first_stage_tokens} "
                         f"{options.total_tokens}")
    minimum = 1 + math.ceil((options.max_prompt_tokens + options.total_tokens + 1) / PAGE_SIZE)
    if options.num_pages is not None and options.num_pages < minimum:
        raise ValueError(f"--num-pages {options.num_pages} cannot hold one sequence of "
                         f"{options.max_prompt_tokens} prompt + {options.total_tokens} response tokens; at least "
                         f"{minimum} are needed")


def preflight(options: EvalOptions, *, source: BenchmarkSource | None = None) -> BenchmarkSource:
    """Every check that can fail on the user's input, before the model is built; returns the task source (ALFWorld
    games generated on first use, which is not an input problem and can take long)."""
    check_options(options)
    cli.check_out_dir("--out", options.out, create=False)      # created once the task source has passed too
    if source is None:
        source = resolve_source(options.benchmark, options.games, progress=options.progress)
    check_splits(options, source)
    cli.check_out_dir("--out", options.out)
    return source


def check_splits(options: EvalOptions, source: BenchmarkSource) -> None:
    """Every evaluated split of ``source`` holds tasks: ``BenchmarkError`` naming the split otherwise (official games
    under ``$ALFWORLD_DATA`` may lack a split, or hold no solvable game of it)."""
    from jaxopd_envs.alfworld import NoGamesError

    for split in options.splits:
        try:
            tasks = source.tasks(split)
        except NoGamesError as error:
            raise BenchmarkError(f"{source.describe()}: {error}") from None
        if not tasks:
            raise BenchmarkError(f"{source.describe()} holds no {split} tasks")


def engine_config_for(options: EvalOptions):
    """Engine limits from the prompt and response limits (the arithmetic of ``actfirst_alfworld.engine_config_for``):
    a sequence is at most ``max_prompt_tokens + total_tokens`` (+1) tokens, rounded up to whole pages, and by default
    every slot can hold one at once, so no request is preempted. No score requests are sent."""
    return sized_engine_config(options.slots, options.max_prompt_tokens, options.total_tokens,
                               num_pages=options.num_pages)


def sized_engine_config(slots: int, max_prompt_tokens: int, total_tokens: int, *, num_pages: int | None = None):
    """The engine of :func:`engine_config_for` from plain limits: ``slots`` sequences of at most ``max_prompt_tokens
    + total_tokens`` (+1) tokens each, whole pages, all resident at once unless ``num_pages`` says otherwise."""
    from jaxopd.sampler import EngineConfig, fine_length_step

    longest = max_prompt_tokens + total_tokens + 1
    max_seq_len = math.ceil(longest / PAGE_SIZE) * PAGE_SIZE
    pages_per_seq = max_seq_len // PAGE_SIZE
    prefill_chunk = min(1024, max_seq_len)
    return EngineConfig(max_slots=slots, page_size=PAGE_SIZE,
                        num_pages=num_pages or slots * pages_per_seq + 1, max_seq_len=max_seq_len,
                        prefill_chunk=prefill_chunk, max_prefill_tokens=max(prefill_chunk, 8192),
                        max_prefill_rows=4, scoring=False, prefill_length_step=fine_length_step(prefill_chunk))


def rollout_config_for(options: EvalOptions):
    from jaxopd.rollout.strategies.base import RolloutConfig
    from jaxopd.rollout.thinking import ThinkingBudget

    budget = ThinkingBudget(first_stage_tokens=options.first_stage_tokens, total_tokens=options.total_tokens,
                            second_stage_max_tokens=PAPER["second_stage_max_tokens"])
    return RolloutConfig(max_turns=options.max_turns, max_prompt_tokens=options.max_prompt_tokens,
                         thinking_budget=budget, temperature=options.temperature, top_p=1.0, top_k=0,
                         seed=options.seeds[0])


def departures_from_paper(options: EvalOptions, source: BenchmarkSource, task_counts: dict[str, int],
                          available: dict[str, int]) -> list[str]:
    """Every way this evaluation differs from App. C.4 (Table 7) / App. C.1, in words."""
    out = []
    if options.random_weights:
        out.append(f"model: RANDOM weights of the `{options.model_preset}` architecture — a smoke test of the "
                   "pipeline; its numbers say nothing about any agent")
    if options.benchmark == "alfworld" and source.games != "official":
        out.append(f"tasks: {source.describe()}")
    for split, n in task_counts.items():
        paper_n = PAPER["tasks"].get((options.benchmark, split))
        if paper_n is not None and n != paper_n:
            out.append(f"{split}: {n} tasks (paper: {paper_n}; {available[split]} available here)")
        elif paper_n is None:
            out.append(f"{split}: not an evaluation split of the paper")
    if options.greedy:
        out.append(f"sampling: greedy (paper: temperature {PAPER_TEMPERATURE}); the seeds then differ in name only")
    elif options.temperature != PAPER_TEMPERATURE:
        out.append(f"sampling: temperature {options.temperature:g} (paper: {PAPER_TEMPERATURE})")
    if tuple(options.seeds) != PAPER_SEEDS:
        out.append(f"seeds: {', '.join(map(str, options.seeds))} (paper: 42, 43, 44)")
    for name, value in (("max_turns", options.max_turns), ("max_prompt_tokens", options.max_prompt_tokens),
                        ("first_stage_tokens", options.first_stage_tokens), ("total_tokens", options.total_tokens)):
        if value != PAPER[name]:
            out.append(f"{name.replace('_', ' ')}: {value:,} (paper: {PAPER[name]:,})")
    if options.slots != PAPER["batch"]:
        out.append(f"concurrency: {options.slots} concurrent episodes (paper: evaluation batch of 64 tasks; "
                   "outcomes do not depend on it)")
    out.append("engine: jaxopd's paged-KV JAX sampler (prefix sharing on, which leaves outputs unchanged) instead of "
               "vLLM on 8 A100-SXM4-80GB")
    return out


def _load_model(options: EvalOptions):
    from jaxopd.models.folders import load_or_init
    from jaxopd.models.weights import model_record

    model = load_or_init(options.student, options.model_preset)
    if options.student is not None:
        return model, model_record(model, name=Path(options.student).name, weights=options.student)
    return model, {**model_record(model, name=options.model_preset, weights=None),
                   "note": "random weights: smoke test only"}


PARTIAL_FILE = "episodes.partial.jsonl"
_NOT_IDENTITY = ("out", "progress", "command", "slots", "num_pages")   # settings that do not change an episode


def evaluation_identity(options: EvalOptions, source: BenchmarkSource) -> dict[str, Any]:
    """What an evaluation's episodes depend on: the options but where the results go and how many run at once, the
    games' folder, and the student's weight files (name, size, modification time: a model exported again into the
    same folder is another model)."""
    values = {k: v for k, v in dataclasses.asdict(options).items() if k not in _NOT_IDENTITY}
    values = {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}
    weights = sorted(Path(options.student).glob("*.safetensors")) if options.student else []
    return {**values, "games_root": str(source.root) if source.root else None,
            "student_files": [[w.name, w.stat().st_size, w.stat().st_mtime_ns] for w in weights]}


def read_partial(out: Path, identity: Mapping[str, Any]) -> dict[tuple[int, str], EpisodeRecord]:
    """The episodes a killed evaluation of ``identity`` left in ``out``; ``ValueError`` when they are another
    evaluation's. A torn last line (killed mid-write) is skipped, and so are episodes that ended in an error (the
    kill may have caused it): they are played again."""
    from jaxopd.methods.metrics_log import read_jsonl

    lines = read_jsonl(out / PARTIAL_FILE)
    if not lines:
        return {}
    if lines[0].get("identity") != dict(identity):
        raise ValueError(f"{out / PARTIAL_FILE} holds the episodes of another evaluation "
                         f"({json.dumps(lines[0].get('identity'), sort_keys=True)}); remove it or give another --out")
    records = [EpisodeRecord.from_dict(line["record"]) for line in lines[1:]]
    return {(r.seed, r.task_id): r for r in records if not r.failed_with_error}


class PartialWriter:
    """Appends each finished episode to ``out/episodes.partial.jsonl`` (the identity line first)."""

    def __init__(self, out: Path, identity: Mapping[str, Any]):
        out.mkdir(parents=True, exist_ok=True)
        self.path = out / PARTIAL_FILE
        text = self.path.read_text(encoding="utf-8") if self.path.is_file() else ""
        text = text[:text.rfind("\n") + 1]             # without a torn last line (a kill mid-write)
        self.path.write_text(text, encoding="utf-8")
        self._handle = self.path.open("a", encoding="utf-8")
        if not text:
            self._write({"identity": dict(identity)})

    def _write(self, line: Mapping[str, Any]) -> None:
        self._handle.write(json.dumps(line, sort_keys=True) + "\n")
        self._handle.flush()

    def __call__(self, record: EpisodeRecord) -> None:
        self._write({"record": record.as_dict()})

    def close(self) -> None:
        self._handle.close()


def run_evaluation(options: EvalOptions, source: BenchmarkSource, *,
                   model_and_info: tuple[Any, dict[str, Any]] | None = None,
                   engine_factory: Callable[[Any, Any, Any], Any] | None = None, tokenizer: Any = None,
                   pool_backend: str = "auto") -> dict[str, Any]:
    """Run the evaluation and write its outputs into ``options.out``; returns what ``evaluation.json`` holds.

    The keyword arguments exist for tests: ``model_and_info`` replaces loading the model, ``engine_factory(model,
    engine_config, tokenizer)`` replaces ``jaxopd.sampler.Engine``, ``tokenizer`` ``load_folder_tokenizer``.
    """
    from jaxopd.machine import machine_info
    from jaxopd_envs.pool import EnvPool

    log = print if options.progress else (lambda *a, **k: None)
    timing: dict[str, float] = {}
    t = time.perf_counter()
    tasks, task_counts, available = [], {}, {}
    for split in options.splits:
        split_tasks = source.tasks(split)
        if not split_tasks:
            raise BenchmarkError(f"{source.describe()} holds no {split} tasks")
        chosen = subset(split_tasks, options.num_tasks)
        tasks += chosen
        task_counts[split], available[split] = len(chosen), len(split_tasks)
    timing["tasks_s"] = time.perf_counter() - t
    log(f"tasks: {', '.join(f'{s} {n}/{available[s]}' for s, n in task_counts.items())} from {source.describe()}",
        flush=True)

    t = time.perf_counter()
    if tokenizer is None:
        from jaxopd.models.folders import load_folder_tokenizer
        tokenizer = load_folder_tokenizer(options.student)
    model, model_info = model_and_info if model_and_info is not None else _load_model(options)
    timing["model_s"] = time.perf_counter() - t
    log(f"model: {model_info.get('name')} "
        f"{'(RANDOM weights: smoke test only)' if options.random_weights else 'from ' + str(options.student)} "
        f"({timing['model_s']:.1f} s)", flush=True)

    engine_config = engine_config_for(options)
    if engine_factory is None:
        from jaxopd.sampler import Engine

        def engine_factory(model, config, tokenizer):
            return Engine(model, config, tokenizer=tokenizer)

    rollout_config = rollout_config_for(options)
    identity = evaluation_identity(options, source)
    done = read_partial(Path(options.out), identity)
    if done:
        log(f"resuming: {len(done)} of {len(tasks) * len(options.seeds)} episodes were played by an earlier run "
            f"({Path(options.out) / PARTIAL_FILE})", flush=True)
    engine = engine_factory(model, engine_config, tokenizer)
    slots = max(1, min(options.slots, len(tasks) * len(options.seeds)))
    t = time.perf_counter()
    with contextlib.ExitStack() as stack:
        if hasattr(engine, "__enter__"):
            stack.enter_context(engine)
        pool = stack.enter_context(EnvPool(source.env_factory, num_slots=slots, backend=pool_backend))
        partial = PartialWriter(Path(options.out), identity)
        stack.callback(partial.close)
        pooled, records = evaluate_policy(engine, pool, tokenizer, tasks, seeds=options.seeds,
                                          rollout_config=rollout_config, greedy=options.greedy,
                                          progress=options.progress, benchmark=options.benchmark,
                                          split="+".join(options.splits), done=done, on_record=partial)
    timing["evaluation_s"] = time.perf_counter() - t
    engine_stats = dict(getattr(engine, "stats", None) or {})
    if engine_stats.get("prefill_padded_tokens"):
        log(f"engine: {engine_stats['generated_tokens']:,} tokens generated, {engine_stats['prefill_tokens']:,} "
            f"prefilled ({engine_stats['prefill_tokens'] / engine_stats['prefill_padded_tokens']:.0%} of the padded "
            f"prefill shapes), {engine_stats['prefill_tokens_saved']:,} taken from shared prefixes", flush=True)
    summaries = [summarize([r for r in records if r.split == split], benchmark=options.benchmark, split=split)
                 for split in options.splits]
    if len(options.splits) > 1:
        summaries.append(pooled)

    notes = []
    if options.random_weights:
        notes.append(f"**Smoke test: the student has RANDOM weights (`{options.model_preset}` architecture); these "
                     "numbers measure nothing.**")
    meta = {
        "experiment": "student evaluation (think-then-act, no reference; ActFirst-OPD Sec. 5 / App. C.4)",
        "command": options.command,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "notes": notes,
        "model": {**{k: v for k, v in model_info.items() if k != "config"},
                  "description": (f"RANDOM weights ({options.model_preset}): smoke test only"
                                  if options.random_weights else f"{options.student}")},
        "random_weights": options.random_weights,
        "source": {"benchmark": options.benchmark, "games": source.games,
                   "root": str(source.root) if source.root else None, "description": source.describe()},
        "splits": list(options.splits), "task_counts": task_counts, "available_tasks": available,
        "seeds": list(options.seeds),
        "sampling": {"greedy": options.greedy, "temperature": rollout_config.temperature if not options.greedy
                     else 0.0, "top_p": rollout_config.top_p, "top_k": rollout_config.top_k},
        "rollout_config": dataclasses.asdict(rollout_config),
        "engine_config": dataclasses.asdict(engine_config) if dataclasses.is_dataclass(engine_config) else None,
        "slots": slots,
        "engine_stats": engine_stats,       # this run's (a resumed evaluation: its episodes since the resume)
        "resumed_episodes": len(done),     # played by an earlier, killed run of this evaluation (not in timing_s)
        "departures": departures_from_paper(options, source, task_counts, available),
        "machine": machine_info(),
        "timing_s": timing,
    }
    write_evaluation(options.out, summaries, records, meta)
    (Path(options.out) / PARTIAL_FILE).unlink(missing_ok=True)
    return {"meta": meta, "summaries": summaries, "records": records}


def run_history(paths: Sequence[str], out: Path) -> list[Path]:
    history = read_history(paths)
    cli.check_out_dir("--out", out)
    return plot_learning_curves(history, out)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return cli.run_main(lambda: _main(args))


def _main(args: argparse.Namespace) -> int:
    if args.history:
        out = Path(args.out) if args.out else Path("runs") / "evaluate" / (
            "curves-" + datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))
        with cli.usage_errors(ValueError):       # an unreadable or malformed history file
            paths = run_history(args.history, out)
        print(f"Wrote {', '.join(p.name for p in paths)} to {out}")
        return 0
    with cli.usage_errors(ValueError):           # BenchmarkError is a ValueError
        options = options_from_args(args)
        source = preflight(options)
    try:
        results = run_evaluation(options, source)
    except ValueError as exc:                    # a checkpoint that cannot load, a split without tasks
        from jaxopd.models.weights import CheckpointError
        if isinstance(exc, (CheckpointError, BenchmarkError)):
            raise cli.UsageError(str(exc)) from None
        raise
    print()
    for summary in results["summaries"]:
        print(markdown_table(summary))
    if options.random_weights:
        print("NOTE: random weights (smoke test only): these numbers measure nothing.")
    print(f"Wrote evaluation.json, evaluation.md, episodes.csv, success_by_task_type.png to {options.out}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
