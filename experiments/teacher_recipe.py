"""The CPU teacher and student of results/train, rebuilt from random weights by one resumable command.

The best CPU teacher here (``teacher-more-hf``, 40.3 % on all 48 generated ``valid_unseen`` games) and its student
(``student-tool40-hf``) are not one training run but a chain of eight, each fine-tuning the previous one's export
(results/train/README.md, stops 27-31 and 33): the copy warm-up's two stages, SFT on a first thinking format,
then fine-tunes that changed the thinking and added demonstration copies. A fresh machine has none of these
checkpoints (``runs/`` is not in git), and the chain takes about four hours on 2 cores (five with the two
evaluations), more than a session. This module owns the chain: ``STAGES`` are the very commands of results/train,
in order, with their output folders under ``--runs``.

    python -m experiments.teacher_recipe                      # run every stage not yet done, in order
    python -m experiments.teacher_recipe --dry-run            # the commands, and which stages are done
    python -m experiments.teacher_recipe --until teacher-more # stop after that stage (here: no evaluations)
    python -m experiments.teacher_recipe --recipe one-sft     # the recipe that fits one session (below)

``ONE_SFT`` (``--recipe one-sft``, stop 42) is the recipe that fits a session: a fresh machine keeps nothing of
``runs/`` from one session to the next, and the chain does not fit one. It shares the chain's copy warm-up, then
trains ONE supervised run from the warm-up's weights on the chain's final data (``task-tool-act-here`` thinking,
``said`` actions, the take, refused and missing copies), its batches grouped by length; its step-150 export is the
student; then it evaluates the teacher as the chain does. On a fresh machine the first stage also generates the
games and runs the searching expert (its 5 minutes took 20 at stop 42); the whole recipe took about 2.2 h there.
It is shorter, not better: its teacher won 2.1 % (3 of 144) of the 48 games' episodes (results/train, stop 42);
resumed to 1,600 steps (a warm restart of the cosine schedule, 70 more minutes) it won 9.7 %, within noise of the
chain's rebuilt 11.8 % (stop 43).

``ONE_SFT_SUB`` (``--recipe one-sft-sub``, stop 48) is the one-sft run as stops 42-45 made the best teacher built
here (34.0 %): four segments of the same run folder, resumed to 800, 1,600, 2,400 and 2,800 steps (each a warm
restart of the cosine schedule), over the SFT corpus's sub-vocabulary (``train --sub-vocabulary``: 592 token ids
instead of 151,936, a step about half as long). Its step-1,600 export is the student (25.0 % of the 48 games'
episodes, stop 48), step 2,800 the teacher (31.9 %, stop 49; the full-vocabulary run's: 34.0 %, paired -2.1 points,
p 0.76); each is evaluated after its segment.

The chain's last two stages evaluate the teacher and the student as stop 35 did (all 48 generated ``valid_unseen``
games, seeds 42/43/44; about 30 minutes each) and print their success beside the documented one. A stage is done when
every folder it exports holds a complete Qwen3 Hugging Face checkpoint (its config, and safetensors as long as
their headers say) and an evaluation stage's folder all of ``experiments.evaluate``'s files, whoever made them,
so the command can be killed and rerun: it starts again at the first stage not done. An interrupted SFT stage
resumes from its own orbax checkpoints (``experiments.train`` resumes an ``--out`` folder that holds them, with
the same data order); an interrupted copy warm-up or evaluation stage starts over. Each stage runs as its own
process, its output in ``<runs>/recipe-logs/<stage>.log``; the recipe's record, ``<runs>/teacher_recipe.json``,
holds every run of each stage: its command, wall-clock seconds, exit status, CPU model and what decides its
numbers (the CPU's model and vector features, the numeric packages' versions; ``machine``: this machine's whole
``jaxopd.machine.machine_info``).

The numbers repeat exactly only on the same CPU model and features (XLA compiles for the host's vector
extensions): on one machine the copy warm-up's first 200 steps gave the same loss to the last digit twice (stop
38), while on the AMD EPYC of stop 36 its phase change came between steps 1,600 and 1,800, at stop 29 between
1,800 and 2,000, with the same jax. A rerun that finds stages done on another machine says so. A rebuilt teacher
is the same recipe, not the same weights, and not the same player: rebuilt on the AVX-512 EPYC of stops 36-38,
every stage saw the documented batches token for token and the teacher won 11.8 % of the 48 games' episodes, not
40.3 % (results/train/README.md, stop 38). Evaluate it again before comparing against it.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

from jaxopd.cli import Parser, UsageError, check_out_dir, run_main
from jaxopd.machine import machine_info, numerics, same_numerics

__all__ = ["Stage", "STAGES", "ONE_SFT", "ONE_SFT_SUB", "RECIPES", "recipe_stages", "checkpoint_complete",
           "stage_done", "run_recipe", "main"]

# The searching-expert SFT settings every stage from the act teacher on shares (results/train, stops 30-31).
_TOOL_SFT = ("--method sft --preset cpu --sft-demonstrations searching-expert --sft-thinking task-tool-act-here "
             "--first-stage-tokens 96 --total-tokens 128 --max-supervised-tokens 120 --max-turns 30 "
             "--sft-context-weight 1.0 --sft-renamed-copies 1 --sft-take-copies 3 --sft-refused-copies 1")


@dataclasses.dataclass(frozen=True)
class Stage:
    """One command of the chain: ``python -m <module> <args>``, ``{runs}`` in ``args`` standing for the runs
    folder; ``exports`` the checkpoint folders (relative to it) whose completeness marks the stage done;
    ``measured_s`` the wall-clock seconds results/train measured for it on 2 CPU cores (for the plan), ``source``
    where. An evaluation stage names its output folder (``evaluation``: done when ``experiments.evaluate`` wrote
    all its files there) and the success rate results/train measured for the model it plays
    (``documented_success``)."""

    name: str
    module: str
    args: str
    exports: tuple[str, ...]
    measured_s: float
    source: str
    evaluation: str | None = None
    documented_success: float | None = None

    @property
    def outputs(self) -> tuple[str, ...]:
        """Every folder (relative to the runs folder) whose completeness marks the stage done."""
        return self.exports + ((self.evaluation,) if self.evaluation else ())

    def argv(self, runs: str) -> list[str]:
        return shlex.split(self.args.format(runs=runs))

    def command(self, runs: str) -> str:
        return f"python -m {self.module} {shlex.join(self.argv(runs))}"


def _evaluate(name: str, model: str, out: str, measured_s: float, source: str, success: float) -> Stage:
    """The stop-35 evaluation of ``model``: all 48 generated ``valid_unseen`` games x seeds 42/43/44."""
    return Stage(name, "experiments.evaluate",
                 f"--student {{runs}}/{model} --split valid_unseen --seeds 42 43 44 --max-turns 30 "
                 f"--max-prompt-tokens 1024 --think-tokens 96 128 --slots 8 --no-progress --out {{runs}}/eval/{out}",
                 (), measured_s, source, evaluation=f"eval/{out}", documented_success=success)


STAGES: tuple[Stage, ...] = (
    Stage("copy-warmup-1", "experiments.copy_probe",
          "--steps 2400 --filler 32 --evaluations 12 --vocab-from-sft --no-progress --export {runs}/copy1-hf "
          "--out {runs}/copy_probe/warmup-stage1-state.json",
          ("copy1-hf",), 293, "stop 27 (A F A copies: the induction head)"),
    Stage("copy-warmup-2", "experiments.copy_probe",
          "--init {runs}/copy1-hf --steps 400 --rows multi --width 1024 --filler 960 --batch-size 2 "
          "--held-out-gaps 32 128 512 900 --evaluations 10 --vocab-from-sft --no-progress --export {runs}/copy2-hf "
          "--out {runs}/copy_probe/warmup-stage2-state.json",
          ("copy2-hf",), 432, "stop 27 (copies at prompt distances)"),
    Stage("teacher-list", "experiments.train",
          "--method sft --preset cpu --sft-demonstrations searching-expert --sft-thinking task-list-plan-here "
          "--first-stage-tokens 96 --total-tokens 128 --max-supervised-tokens 112 --max-turns 30 "
          "--sft-context-weight 1.0 --sft-renamed-copies 1 --sft-take-copies 2 --lr-schedule cosine --batch-size 8 "
          "--steps 840 --checkpoint-every 30 --keep-checkpoints 3 --no-eval --no-progress --out {runs}/sft-list "
          "--student {runs}/copy2-hf --export {runs}/teacher-list-hf --export-at 150 {runs}/student-list-hf",
          ("teacher-list-hf", "student-list-hf"), 5530, "stop 29"),
    Stage("teacher-act", "experiments.train",
          "--method sft --preset cpu --sft-demonstrations searching-expert --sft-thinking task-list-act-here "
          "--first-stage-tokens 96 --total-tokens 128 --max-supervised-tokens 112 --max-turns 30 "
          "--sft-context-weight 1.0 --sft-renamed-copies 1 --sft-take-copies 3 --sft-refused-copies 1 "
          "--lr-schedule cosine --learning-rate 3e-4 --batch-size 8 --steps 380 --checkpoint-every 30 "
          "--keep-checkpoints 2 --no-eval --no-progress --out {runs}/sft-act --student {runs}/teacher-list-hf "
          "--export {runs}/teacher-act-hf",
          ("teacher-act-hf",), 3072, "stop 30"),
    Stage("student-tool40", "experiments.train",
          _TOOL_SFT + " --lr-schedule cosine --learning-rate 3e-4 --batch-size 8 --steps 40 --checkpoint-every 20 "
          "--keep-checkpoints 2 --no-eval --no-progress --out {runs}/sft-tool40 --student {runs}/teacher-act-hf "
          "--export {runs}/student-tool40-hf",
          ("student-tool40-hf",), 300, "stop 33 (the student: 19.4 % on 48 games)"),
    Stage("teacher-tool", "experiments.train",
          _TOOL_SFT + " --lr-schedule cosine --learning-rate 3e-4 --batch-size 8 --steps 300 --checkpoint-every 30 "
          "--keep-checkpoints 2 --no-eval --no-progress --out {runs}/sft-tool --student {runs}/teacher-act-hf "
          "--export {runs}/teacher-tool-hf",
          ("teacher-tool-hf",), 2279, "stop 31"),
    Stage("teacher-missing", "experiments.train",
          _TOOL_SFT + " --sft-missing-copies 1 --lr-schedule cosine --learning-rate 2e-4 --batch-size 8 --steps 240 "
          "--checkpoint-every 30 --keep-checkpoints 2 --no-eval --no-progress --out {runs}/sft-missing "
          "--student {runs}/teacher-tool-hf --export {runs}/teacher-missing-hf",
          ("teacher-missing-hf",), 1777, "stop 31"),
    Stage("teacher-more", "experiments.train",
          _TOOL_SFT + " --sft-missing-copies 1 --lr-schedule cosine --learning-rate 2e-4 --batch-size 8 --steps 200 "
          "--checkpoint-every 40 --keep-checkpoints 2 --no-eval --no-progress --out {runs}/sft-more "
          "--student {runs}/teacher-missing-hf --export {runs}/teacher-more-hf",
          ("teacher-more-hf",), 1692, "stop 31 (the teacher: 40.3 % on 48 games)"),
    _evaluate("evaluate-teacher", "teacher-more-hf", "teacher-more-48", 1705, "stop 35", 58 / 144),
    _evaluate("evaluate-student", "student-tool40-hf", "student-tool40-48", 2082, "stop 35", 28 / 144),
)

# The recipe that fits one session (stop 42): the same copy warm-up, then ONE supervised run from its weights on the
# chain's final data (task-tool-act-here thinking, said actions, take/refused/missing copies; 800 steps of 8 are 0.7
# of an epoch of its 9,094 samples), its step-150 export the student, then the teacher's evaluation. Measured on a
# fresh 2-core machine: games, expert and warm-up 29 min, SFT 65 min, evaluation 39 min; its teacher won 2.1 %.
ONE_SFT: tuple[Stage, ...] = (
    STAGES[0],
    STAGES[1],
    Stage("teacher-one", "experiments.train",
          _TOOL_SFT + " --sft-missing-copies 1 --sft-action-format said --sft-group-by-length 32 --lr-schedule cosine "
          "--batch-size 8 --steps 800 --checkpoint-every 50 --keep-checkpoints 2 --no-eval --no-progress "
          "--out {runs}/sft-one --student {runs}/copy2-hf --export {runs}/teacher-one-hf "
          "--export-at 150 {runs}/student-one-hf",
          ("teacher-one-hf", "student-one-hf"), 3914, "stop 42 (one SFT run from the copy warm-up)"),
    _evaluate("evaluate-teacher-one", "teacher-one-hf", "teacher-one-48", 2324, "stop 42", 3 / 144),
)


def _sub_segment(steps: int, export: str, measured_s: float, source: str) -> Stage:
    """One segment of the one-sft run over the corpus's sub-vocabulary: the same run folder resumed to ``steps``
    (``--steps`` larger than the last segment's: a warm restart of the cosine schedule, as stops 43-45 ran it)."""
    return Stage(f"sub-sft-{steps}", "experiments.train",
                 _TOOL_SFT + " --sft-missing-copies 1 --sft-action-format said --sft-group-by-length 32 "
                 f"--lr-schedule cosine --sub-vocabulary --batch-size 8 --steps {steps} --checkpoint-every 50 "
                 "--keep-checkpoints 2 --no-eval --no-progress --out {runs}/sft-sub --student {runs}/copy2-hf "
                 f"--export {{runs}}/{export}",
                 (export,), measured_s, source)


# The one-sft run as stops 42-45 made the 34 % teacher (steps 800, 1,600, 2,400 and 2,800, each segment resuming the
# last with a larger --steps), over the SFT corpus's sub-vocabulary (--sub-vocabulary, stop 48): the softmax, the
# embedding and the optimizer state over a few hundred ids instead of 151,936. Step 1,600 is the student (25.0 %,
# stop 48), step 2,800 the teacher (31.9 %, stop 49); both are evaluated. Stops 48-49 ran it whole: 4.4 h of
# measured stages plus 12 min of games and expert, part of it sharing the 2 cores.
ONE_SFT_SUB: tuple[Stage, ...] = (
    STAGES[0],
    STAGES[1],
    _sub_segment(800, "sub800-hf", 3000, "stop 48, sharing the cores half the time; 2.8 % in play"),
    _sub_segment(1600, "sub1600-hf", 3605, "stop 48, sharing the cores with an evaluation for 40 min (the student)"),
    _evaluate("evaluate-sub1600", "sub1600-hf", "sub1600-48", 1166, "stop 48 (the student)", 36 / 144),
    _sub_segment(2400, "sub2400-hf", 2395, "stop 49, resumed from step 1,600, alone but for a 4-min smoke run"),
    _sub_segment(2800, "sub2800-hf", 1179, "stop 49, alone (the teacher)"),
    _evaluate("evaluate-sub2800", "sub2800-hf", "sub2800-48", 2176, "stop 49, beside a distillation run (the teacher)",
              46 / 144),
)
RECIPES: dict[str, tuple[Stage, ...]] = {"chain": STAGES, "one-sft": ONE_SFT, "one-sft-sub": ONE_SFT_SUB}
STAGE_NAMES = tuple(dict.fromkeys(stage.name for stages in RECIPES.values() for stage in stages))
RECORD = "teacher_recipe.json"


def checkpoint_complete(folder: str | os.PathLike) -> bool:
    """``folder`` is a Qwen3 Hugging Face checkpoint whose files were written to the end
    (``jaxopd.models.weights.check_checkpoint_files``)."""
    from jaxopd.models.weights import CheckpointError, check_checkpoint_files
    try:
        check_checkpoint_files(folder)
    except (CheckpointError, OSError):
        return False
    return True


def evaluation_success(folder: str | os.PathLike) -> float | None:
    """The overall success rate (mean over seeds) of a finished ``experiments.evaluate`` output folder, None when
    one of its files is missing or ``evaluation.json`` does not read."""
    from jaxopd.methods.evaluate import OUTPUT_FILES
    folder = Path(folder)
    if not all((folder / name).is_file() for name in OUTPUT_FILES):
        return None
    try:
        summary = json.loads((folder / OUTPUT_FILES[0]).read_text())["summaries"][-1]
        return float(summary["overall"]["success_rate"]["mean"])
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return None


def stage_done(stage: Stage, runs: str | os.PathLike) -> bool:
    if stage.evaluation is not None and evaluation_success(Path(runs) / stage.evaluation) is None:
        return False
    return all(checkpoint_complete(Path(runs) / folder) for folder in stage.exports)


Runner = Callable[[Sequence[str], Path], int]


def run_in_process(argv: Sequence[str], log: Path) -> int:
    """Runs ``argv`` as a child process, its stdout and stderr appended to ``log``; returns its exit status."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as handle:
        handle.write(f"\n# {time.strftime('%Y-%m-%d %H:%M:%S')} {shlex.join(argv)}\n")
        handle.flush()
        return subprocess.run(list(argv), stdout=handle, stderr=subprocess.STDOUT, check=False).returncode


def _other_machines(record: dict, machine: dict) -> list[str]:
    """The stages whose last successful run was made on a machine whose numerics differ from ``machine``'s."""
    others = []
    for name, entries in record.get("stages", {}).items():
        done = [entry for entry in entries if entry.get("exit_status") == 0]
        if done and same_numerics(done[-1].get("machine", {}), machine) is False:
            others.append(name)
    return others


def recipe_stages(recipe: str) -> tuple[Stage, ...]:
    if recipe not in RECIPES:
        raise ValueError(f"unknown recipe {recipe!r}; choose one of {sorted(RECIPES)}")
    return RECIPES[recipe]


def run_recipe(runs: str, *, recipe: str = "chain", until: str | None = None, runner: Runner = run_in_process,
               log: Callable[[str], None] = print) -> int:
    """Runs every stage of ``RECIPES[recipe]`` not done, in order, up to ``until`` (inclusive; default the last);
    returns 0, or the exit status of the first stage that failed (later stages do not run). Records each stage in
    ``<runs>/RECORD``."""
    stages = recipe_stages(recipe)
    names = [stage.name for stage in stages]
    if until is not None and until not in names:
        raise ValueError(f"stage {until!r} is not in the {recipe} recipe; its stages: {', '.join(names)}")
    root = Path(runs)
    root.mkdir(parents=True, exist_ok=True)
    record_path = root / RECORD
    record = json.loads(record_path.read_text()) if record_path.is_file() else {}
    record["machine"] = machine = machine_info(devices=False)
    record.setdefault("stages", {})
    others = _other_machines(record, machine)
    last = names.index(until) if until is not None else len(stages) - 1
    for stage in stages[:last + 1]:
        if stage_done(stage, root):
            log(f"[{stage.name}] done: {', '.join(str(root / f) for f in stage.outputs)}{_success(stage, root)}")
            continue
        if others:
            log(f"note: {', '.join(others)} ran on another CPU or other package versions than this machine "
                f"({machine['cpu']}, jax {machine['jax']}): the stages run here continue from their weights, so "
                "the chain repeats neither machine's numbers exactly")
            others = []
        argv = [sys.executable, "-m", stage.module, *stage.argv(runs)]
        logfile = root / "recipe-logs" / f"{stage.name}.log"
        log(f"[{stage.name}] running (about {stage.measured_s / 60:.0f} min on 2 cores when measured), "
            f"output in {logfile}:\n  {stage.command(runs)}")
        started = time.time()
        status = runner(argv, logfile)
        entry = {"command": stage.command(runs), "started": time.strftime("%Y-%m-%d %H:%M:%S",
                                                                            time.localtime(started)),
                 "wall_s": round(time.time() - started, 1), "exit_status": status, "log": str(logfile),
                 "cpu": machine["cpu"], "machine": numerics(machine)}
        record["stages"].setdefault(stage.name, []).append(entry)
        record_path.write_text(json.dumps(record, indent=2) + "\n")
        if status != 0:
            log(f"[{stage.name}] failed with exit status {status}; see {logfile}. Rerun to continue from it.")
            return status
        if not stage_done(stage, root):
            log(f"[{stage.name}] exited 0 but did not write {', '.join(stage.outputs)} under {root}")
            return 1
        log(f"[{stage.name}] finished in {entry['wall_s']:,.0f} s{_success(stage, root)}")
    return 0


def _success(stage: Stage, root: Path) -> str:
    if stage.evaluation is None:
        return ""
    rate = evaluation_success(root / stage.evaluation)
    return (f"; success {100 * rate:.1f} % (results/train, {stage.source}: {100 * stage.documented_success:.1f} %; "
            "another CPU model gives other weights, see the module's docstring)")


def build_parser() -> Parser:
    parser = Parser(prog="python -m experiments.teacher_recipe", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", default="runs",
                        help="the folder every stage reads and writes its checkpoints in (default: runs)")
    parser.add_argument("--recipe", choices=sorted(RECIPES), default="chain",
                        help="chain: the eight runs of the documented teacher and student (about 5.3 h); one-sft: "
                             "the copy warm-up and one SFT run, which fit a session (about 2.2 h; stop 42); "
                             "one-sft-sub: the copy warm-up and the one-sft run to 2,800 steps in the segments of "
                             "stops 42-45, over the corpus's sub-vocabulary, evaluating steps 1,600 and 2,800 (about "
                             "4.5 h; stops 48-49)")
    parser.add_argument("--until", choices=STAGE_NAMES, default=None,
                        help="stop after this stage of the recipe (default: its last)")
    parser.add_argument("--dry-run", action="store_true", help="print the stages' commands and which are done")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    def body() -> int:
        args = build_parser().parse_args(argv)
        if not args.dry_run:
            check_out_dir("--runs", args.runs)
        elif Path(args.runs).exists() and not Path(args.runs).is_dir():
            raise UsageError(f"--runs {args.runs!r} is not a folder")
        stages = RECIPES[args.recipe]
        if args.until is not None and args.until not in {stage.name for stage in stages}:
            raise UsageError(f"--until {args.until!r} is not a stage of --recipe {args.recipe}; its stages: "
                             f"{', '.join(stage.name for stage in stages)}")
        if args.dry_run:
            total = 0.0
            for stage in stages:
                done = stage_done(stage, args.runs)
                total += 0 if done else stage.measured_s
                print(f"# {stage.name} ({'done' if done else f'{stage.measured_s / 60:.0f} min'}; {stage.source})")
                print(stage.command(args.runs))
            print(f"# left: about {total / 3600:.1f} h on 2 CPU cores (the stages' measured wall-clock)")
            return 0
        return run_recipe(args.runs, recipe=args.recipe, until=args.until)

    return run_main(body)


if __name__ == "__main__":
    raise SystemExit(main())
