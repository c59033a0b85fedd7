"""Train a student agent: on-policy distillation (vanilla OPD, ActFirst-OPD and its ablations, STI-OPD, ActionOPD)
or supervised fine-tuning on walkthroughs (``--method sft``: how a teacher is made here without a download).

    python -m experiments.train --method actfirst --preset cpu --student runs/student-hf --teacher runs/teacher-hf \\
        --out runs/train/actfirst --export runs/train/actfirst/student-hf
    python -m experiments.train --method sft --preset cpu --steps 600 --out runs/sft/teacher \\
        --export runs/sft/teacher/hf

A run is one config (``jaxopd.methods.config``: a ``DistillConfig``, or an ``SFTConfig`` for ``--method sft``):
the method's paper defaults, then the preset, then a ``--config FILE``, then the flags given here, one per config
field, made from the fields' types, defaults and help; it is printed at the start and saved as
``<out>/config.json``. A folder that holds checkpoints is resumed. Outputs: ``train.jsonl`` / ``eval.jsonl`` and
TensorBoard events, evaluation tables and plots under ``<out>/eval/``, ``summary.json``, and with ``--export`` the
trained student as a Hugging Face folder. Bad input (a missing checkpoint folder, a wrong preset, an unwritable
``--out``, ``$ALFWORLD_DATA`` pointing at nothing, a teacher with another vocabulary) is one line on stderr and exit
code 2.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable, NoReturn, Sequence

from jaxopd import cli
from jaxopd.train import distributed
from jaxopd.cli import UsageError
from jaxopd.machine import machine_info
from jaxopd.methods.benchmarks import BenchmarkError, GeneratedCounts, resolve_source, subset
from jaxopd.methods.config import (METHODS, PRESETS, DistillConfig, RunConfig, SFTConfig, build_config,
                                   field_owner)
from jaxopd.methods.metrics_log import read_jsonl
from jaxopd.methods.run_folder import CONFIG_FILE, Interrupted, RunFolderError, RunLock, check_resume

RUN_FLAGS = ("config", "method", "preset", "out", "export", "steps", "export_at", "no_eval", "no_progress",
             "phase_log", "num_processes")
"""The flags that are not config fields (or, ``method`` and ``preset``, read before the config is built)."""


def config_fields() -> dict[str, dataclasses.Field]:
    """Every field of the distillation and SFT configs, each once (the common ones first), by name."""
    fields: dict[str, dataclasses.Field] = {}
    for cls in (DistillConfig, SFTConfig):
        for field in dataclasses.fields(cls):
            fields.setdefault(field.name, field)
    return fields


def _flag_type(field: dataclasses.Field):
    """The argparse type of a field's flag, from its annotation (``int | None`` -> int)."""
    kind = str(field.type).replace(" | None", "")
    return {"int": int, "float": float, "str": str, "bool": bool, "tuple[int, ...]": int}[kind]


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per config field, ``--field-name``, from the field's type, default and help (its metadata), in a
    group per kind of run that reads it: bools take ``on`` / ``off``, tuples one or more values; every default is
    None, so only the flags given override the config (a config file, the method's and the preset's values come
    first)."""
    groups = {owner: parser.add_argument_group(title) for owner, title in (
        ("every run", "config of every run"), ("a distillation", "config of a distillation run"),
        ("an SFT", "config of an SFT run (--method sft)"))}
    for name, field in config_fields().items():
        if name in ("method", "preset"):
            continue
        kind = _flag_type(field)
        default = field.default
        shown = ("on" if default else "off") if kind is bool else (
            " ".join(map(str, default)) if isinstance(default, tuple) else default)
        text = field.metadata.get("help", "") + ("" if default is None else f" (default {shown})")
        kwargs: dict[str, Any] = {"default": None, "help": text.replace("%", "%%")}
        if kind is bool:
            kwargs["choices"] = ("on", "off")
        else:
            kwargs["type"] = kind
            if "choices" in field.metadata:
                kwargs["choices"] = field.metadata["choices"]
            if "metavar" in field.metadata:
                kwargs["metavar"] = field.metadata["metavar"]
            if isinstance(default, tuple):
                kwargs["nargs"] = "+"
        groups[field_owner(name)].add_argument("--" + name.replace("_", "-"), **kwargs)


def build_parser() -> argparse.ArgumentParser:
    p = cli.Parser(prog="python -m experiments.train", description=__doc__.split("\n\n")[0],
                   epilog="The defaults shown are the papers' shared settings; the method's paper, the preset and "
                          "--config change them, and a run prints and saves the config it resolved to.")
    p.add_argument("--config", default=None, metavar="FILE",
                   help="a TOML, YAML or JSON file of config fields (method and preset included; a run's own "
                        "config.json is one); the flags given override it")
    p.add_argument("--method", default=None, choices=METHODS, help="required, here or in --config")
    p.add_argument("--preset", default=None, choices=PRESETS, help="machine sizing (default cpu)")
    p.add_argument("--out", required=True, help="run folder (resumed when it holds checkpoints)")
    p.add_argument("--export", default=None, help="write the trained student here as a Hugging Face folder")
    p.add_argument("--steps", type=int, default=None, help="SFT steps (default: --sft-epochs over the data)")
    p.add_argument("--export-at", nargs=2, action="append", default=None, metavar=("STEP", "DIR"),
                   help="SFT: also write the model of step STEP as a Hugging Face folder DIR when the run passes it "
                        "(a weaker student from the teacher's own run; repeatable)")
    p.add_argument("--no-eval", action="store_true", help="skip evaluation")
    p.add_argument("--first-eval-from", default=None, metavar="RUN",
                   help="take the evaluation of update 0 (the untrained student) from the run folder RUN instead of "
                        "repeating it; RUN must agree with this run in every setting that evaluation depends on")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--num-processes", type=int, default=1, metavar="N",
                   help="run as N local processes of one JAX cluster (CPU collectives; for trying and testing a "
                        "multi-process run on one machine: synchronous rollouts, evaluation after training)")
    p.add_argument("--phase-log", default=None, metavar="FILE",
                   help="append one line 'PHASE UPDATE UNIX_TIME' whenever the loop enters rollout, step, checkpoint "
                        "or saved (for watchdogs; the kill-and-resume tests use it)")
    add_config_flags(p)
    return p


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """The run's config from the flags, and every check of it that needs no model, no games built and no folder
    written (``UsageError``): the config's own (``RunConfig``), flags that do nothing for the method, the task
    source ($ALFWORLD_DATA's games, --train-tasks against the tasks there are), --exact-top-k against the student's
    vocabulary, and the prompt limits against the benchmark's system prompt. A ``--config`` file's fields come
    first; the flags given override them."""
    from jaxopd.methods.config import check_exact_top_k, check_prompt_fits, check_task_source, read_config_file

    from_file: dict[str, Any] = {}
    if getattr(args, "config", None):
        with cli.usage_errors(ValueError):
            from_file = read_config_file(args.config)
    file_method, file_preset = from_file.pop("method", None), from_file.pop("preset", None)
    method = args.method or file_method
    preset = args.preset or file_preset or "cpu"
    if method is None:
        raise UsageError("--method is required (or `method` in the --config file)")
    args.method, args.preset = method, preset
    flags = {name: getattr(args, name, None) for name in config_fields() if name not in ("method", "preset")}
    for name, value in flags.items():
        if isinstance(value, str) and _flag_type(config_fields()[name]) is bool:
            flags[name] = value == "on"
        elif isinstance(value, list):
            flags[name] = tuple(value)
    overrides = {**from_file, **{k: v for k, v in flags.items() if v is not None}}
    if getattr(args, "export_at", None) and args.method != "sft":
        raise UsageError("--export-at writes intermediate SFT models; distillation runs export with --export")
    if getattr(args, "phase_log", None) and args.method == "sft":
        raise UsageError("--phase-log reports the phases of the distillation loop (rollout, step, checkpoint); "
                         "--method sft never enters them")
    if getattr(args, "first_eval_from", None) and (args.method == "sft" or getattr(args, "no_eval", False)
                                                   or multiprocess_run(args)):
        raise UsageError("--first-eval-from stands in for a distillation run's evaluation of update 0; this run makes "
                         "none (--method sft, --no-eval or --num-processes)")
    if args.method == "sft" and args.steps is not None:
        overrides["updates"] = args.steps
    if multiprocess_run(args) and args.method == "sft":
        raise UsageError("--method sft runs in one process; --num-processes is for the distillation methods")
    if args.method != "sft" and getattr(args, "steps", None) is not None:
        raise UsageError("--steps counts SFT steps; a distillation run's length is --updates")
    with cli.usage_errors(ValueError):
        config = build_config(args.method, preset=args.preset, **overrides)
        asynchronous = getattr(config, "rollout_mode", "sync") != "sync" and config.method != "actionopd"
        if multiprocess_run(args) and asynchronous:
            raise UsageError("a multi-process run plays synchronous waves: add --rollout-mode sync (asynchronous "
                             "runners are single-process for now)")
        evaluate = not getattr(args, "no_eval", False) and not multiprocess_run(args)
        check_task_source(config, evaluate=evaluate)
        student_config = None if config.student is None else Path(config.student).expanduser() / "config.json"
        top_k = getattr(config, "exact_top_k", None)          # distillation only
        if top_k is not None and student_config is not None and student_config.is_file():
            check_exact_top_k(top_k, cli.checkpoint_vocab_size("--student", config.student),
                              f"the --student {config.student!r}")
        if config.student is None or (student_config is not None and student_config.is_file()):
            from jaxopd.models.folders import load_folder_tokenizer  # a missing --student folder: check_paths'
            try:
                tokenizer = load_folder_tokenizer(config.student)
            except ValueError as error:
                raise UsageError(f"--student {config.student!r}: {error}") from None
            check_prompt_fits(config, tokenizer, evaluate=evaluate)
    return config


def training_counts(config: RunConfig) -> GeneratedCounts:
    """The generated ALFWorld games of a run: ``--generated-train-games`` train games and the default evaluation
    splits (what stays the same is said at ``RunConfig.generated_train_games``)."""
    return GeneratedCounts(train=config.generated_train_games)


def check_paths(config: RunConfig, args: argparse.Namespace) -> Path:
    for flag, folder in (("--student", config.student), ("--teacher", getattr(config, "teacher", None))):
        if folder is not None:
            cli.check_checkpoint_folder(flag, folder)
    if config.method != "sft" and config.student is not None and config.teacher is not None:
        cli.check_same_vocabulary(cli.checkpoint_vocab_size("--student", config.student),
                                  cli.checkpoint_vocab_size("--teacher", config.teacher),
                                  student=f"--student {config.student!r}", teacher=f"--teacher {config.teacher!r}")
    out = cli.check_out_dir("--out", args.out, create=False)      # created once every input has passed
    if args.export:
        export = cli.check_out_dir("--export", args.export, create=False)
        if export.resolve() == out.resolve():
            raise UsageError(f"--export {args.export!r} is the run folder --out: the model's config.json would "
                             f"replace the run's; export into a subfolder such as {str(out / 'student-hf')!r}")
    if args.phase_log:
        cli.check_out_file("--phase-log", args.phase_log, create=False)
    with cli.usage_errors(RunFolderError):
        check_resume(out, config)           # a run in the folder must be the same run, and not past --updates
    if config.student is None:              # random weights: the offline Qwen3 tokenizer's ids must fit the preset
        cli.check_random_preset("--student-model-preset", config.student_model_preset)
    if config.method != "sft" and config.teacher is None:
        cli.check_model_preset("--teacher-model-preset", config.teacher_model_preset)
    return out


def load_models(config: RunConfig):
    """The student and teacher (None for SFT) models, Qwen3 or Llama, and the tokenizer (the student folder's, or
    the offline Qwen3 one for a random-weight student)."""
    from jaxopd.models.folders import load_folder_tokenizer, load_or_init
    from jaxopd.models.weights import CheckpointError

    try:
        tokenizer = load_folder_tokenizer(config.student)
    except ValueError as error:
        raise UsageError(f"--student {config.student!r}: {error}") from None

    def load(folder: str | None, preset: str, seed: int, flag: str):
        try:
            return load_or_init(folder, preset, seed=seed)
        except (CheckpointError, OSError, ValueError) as error:
            raise UsageError(f"{flag} {folder!r}: {error}") from None

    student = load(config.student, config.student_model_preset, config.seed, "--student")
    if config.student_layers:
        from jaxopd.models.weights import cut_layers
        try:
            student = cut_layers(student, config.student_layers)
        except ValueError as error:
            raise UsageError(f"--student-layers: {error}") from None
    teacher = None
    if config.method != "sft":
        teacher = load(config.teacher, config.teacher_model_preset, config.seed + 1, "--teacher")
        if teacher.config.vocab_size != student.config.vocab_size:
            raise UsageError(f"the teacher's vocabulary ({teacher.config.vocab_size} tokens) differs from the "
                             f"student's ({student.config.vocab_size}); OPD needs one token space")
    if tokenizer.vocab_size > student.config.vocab_size:
        raise UsageError(f"the tokenizer's {tokenizer.vocab_size:,} token ids do not fit the student's "
                         f"{student.config.vocab_size:,}-token vocabulary ({student.config.model_type})")
    return student, teacher, tokenizer


def make_evaluator(config: RunConfig, source: Any, tokenizer: Any, out: Path, progress: bool, *,
                   divergence: Any = None):
    """``fn(engine, update)``: the student alone on ``eval_tasks`` tasks of the evaluation split, under the
    evaluation's own limits (``eval_max_turns``, ``eval_max_prompt_tokens``, the ``eval_*`` thinking budget); every
    seed at the start and the end, the first seed in between. Writes ``<out>/eval/update_<n>/``. ``divergence``: an
    optional ``fn() -> float``, the student's exact reverse KL to the teacher on held-out states, logged too."""
    from jaxopd.methods.evaluate import evaluate_policy, write_evaluation
    from jaxopd.rollout.strategies.base import RolloutConfig
    from jaxopd.rollout.thinking import ThinkingBudget

    split = config.resolved_eval_split
    tasks = subset(source.tasks(split), config.eval_tasks, seed=0)
    rollout = RolloutConfig(max_turns=config.eval_max_turns, max_prompt_tokens=config.eval_max_prompt_tokens,
                            thinking_budget=ThinkingBudget(config.eval_first_stage_tokens, config.eval_total_tokens,
                                                           config.second_stage_tokens),
                            temperature=config.eval_temperature)
    final_update = config.updates

    def evaluate(engine: Any, update: int) -> dict[str, Any]:
        seeds = config.eval_seeds if update in (0, final_update) else config.eval_seeds[:1]
        summary, records = evaluate_policy(engine, source, tokenizer, tasks, seeds=seeds, rollout_config=rollout,
                                           greedy=config.eval_greedy, progress=progress, slots=config.rollout_slots,
                                           benchmark=config.benchmark, split=split)
        write_evaluation(out / "eval" / f"update_{update:05d}", summary, records,
                         {"update": update, "method": config.method, "tasks": len(tasks), "seeds": list(seeds)})
        overall = summary["overall"]
        result = {"split": split, "tasks": len(tasks), "seeds": list(seeds),
                  "success_rate_mean": overall["success_rate"]["mean"],
                  "success_rate_std": overall["success_rate"]["std"] or 0.0}
        for name in ("mean_rounds", "mean_score"):
            if name in overall and overall[name]["mean"] is not None:
                result[f"{name}_mean"] = overall[name]["mean"]
        if divergence is not None:
            result["exact_reverse_kl"] = divergence()
        return result

    return evaluate


def reuse_first_evaluation(run: Path, config: RunConfig, out: Path, evaluate: Callable[[Any, int], dict[str, Any]]
                           ) -> Callable[[Any, int], dict[str, Any]]:
    """``--first-eval-from RUN``: ``evaluate`` with update 0 answered by RUN's own evaluation of update 0 (its
    ``eval.jsonl`` record, marked ``copied_from``, and its ``eval/update_00000`` episodes), so that methods trained
    from one student evaluate it once. Refused (``UsageError``) unless RUN holds that evaluation and agrees with
    ``config`` in every field of ``FIRST_EVALUATION_FIELDS``. Equal settings give the same episodes up to the float
    rounding of batched decoding."""
    from jaxopd.methods.run_folder import (FIRST_EVALUATION_FIELDS, config_defaults, config_differences,
                                           saved_run_config)

    flag = f"--first-eval-from {str(run)!r}"
    saved = saved_run_config(run)
    if saved is None or not (run / "eval.jsonl").is_file():
        raise cli.UsageError(f"{flag}: not a run folder with an evaluation (no {CONFIG_FILE} or eval.jsonl)")
    differ = config_differences(saved, config.to_dict(), config_defaults(config), only=FIRST_EVALUATION_FIELDS)
    if differ:
        raise cli.UsageError(f"{flag}: its evaluation of update 0 used other settings ({', '.join(differ)} differ)")
    first = next((r for r in read_jsonl(run / "eval.jsonl") if r.get("step") == 0), None)
    if first is None:
        raise cli.UsageError(f"{flag}: its eval.jsonl holds no evaluation of update 0")
    copied = {k: v for k, v in first.items() if k not in ("kind", "step", "time", "wall_s")}

    def evaluated(engine: Any, update: int) -> dict[str, Any]:
        if update != 0:
            return evaluate(engine, update)
        episodes = run / "eval" / "update_00000"
        if episodes.is_dir():
            shutil.copytree(episodes, out / "eval" / "update_00000", dirs_exist_ok=True)
        return {**copied, "copied_from": str(run)}

    return evaluated


def held_out_divergence(config: RunConfig, source: Any, tokenizer: Any, student: Any, teacher: Any, trainer: Any):
    """``fn() -> float``: the current student's exact reverse KL to the teacher on the walkthrough turns of the
    evaluation games (held-out states: no training task is among them), at the rollout temperature. The turns'
    answers think as ``config.sft_thinking`` says: a teacher SFT'd with state thinking is measured on answers in
    its own format."""
    from flax import nnx

    from experiments.divergence import held_out_samples
    from jaxopd.methods.divergence import exact_reverse_kl

    if config.benchmark != "alfworld":
        return None
    samples = held_out_samples(source, config.resolved_eval_split, tokenizer, tasks=config.eval_tasks, modes=["full"],
                               thinking=config.sft_thinking, max_prompt_tokens=config.max_prompt_tokens,
                               progress=False)["full"]
    student_graphdef, _ = nnx.split(student, nnx.Param)
    teacher_pair = nnx.split(teacher, nnx.Param)

    def divergence() -> float:
        return exact_reverse_kl((student_graphdef, trainer().learner.model_params()), teacher_pair, samples,
                                temperature=config.temperature or 1.0)

    return divergence


def phase_logger(path: str | None):
    """``on_phase`` for the Trainer: appends ``PHASE UPDATE UNIX_TIME`` lines to ``path`` (flushed at once)."""
    if path is None:
        return None
    handle = open(path, "a", buffering=1, encoding="utf-8")

    def on_phase(phase: str, update: int) -> None:
        handle.write(f"{phase} {update} {time.time():.6f}\n")
        handle.flush()

    return on_phase


def run(args: argparse.Namespace) -> dict[str, Any]:
    config = config_from_args(args)
    out = check_paths(config, args)
    progress = not args.no_progress
    try:
        source = resolve_source(config.benchmark, config.games, counts=training_counts(config), progress=progress)
    except BenchmarkError as error:
        raise UsageError(str(error)) from None
    if source.games == "official" and config.generated_train_games != GeneratedCounts.train:
        raise UsageError(f"--generated-train-games {config.generated_train_games} sizes generated games, but this run "
                         f"plays {source.describe()} ($ALFWORLD_DATA is set; --games generated uses generated ones)")
    student, teacher, tokenizer = load_models(config)
    with contextlib.ExitStack() as stack:
        with cli.usage_errors(RunFolderError):
            stack.enter_context(RunLock(out))       # one process per run folder: the second is refused here
        return _run_locked(config, args, out, source, student, teacher, tokenizer, progress)


def _run_locked(config: RunConfig, args: argparse.Namespace, out: Path, source: Any, student: Any, teacher: Any,
                tokenizer: Any, progress: bool) -> dict[str, Any]:
    started = time.time()
    print(f"task source: {source.describe()}", flush=True)
    if config.method == "sft":
        summary = run_sft(config, args, source, student, tokenizer, out, progress)
    else:
        from jaxopd.methods.loop import Trainer
        holder: dict[str, Any] = {}
        evaluator = None
        if multiprocess_run(args) and not args.no_eval:
            print("a multi-process run evaluates after training: python -m experiments.evaluate --student on its "
                  "--export", flush=True)
        elif not args.no_eval:
            divergence = held_out_divergence(config, source, tokenizer, student, teacher, lambda: holder["trainer"])
            evaluator = make_evaluator(config, source, tokenizer, out, progress, divergence=divergence)
            if args.first_eval_from:
                evaluator = reuse_first_evaluation(Path(args.first_eval_from), config, out, evaluator)
        trainer = Trainer(config, student=student, teacher=teacher, tokenizer=tokenizer, source=source, out_dir=out,
                          progress=progress, evaluate=evaluator, on_phase=phase_logger(args.phase_log))
        holder["trainer"] = trainer
        summary = trainer.run()
        if args.export:
            make_exporter(config, student, tokenizer)(trainer.learner, Path(args.export))
            summary["export"] = args.export
    if not distributed.is_primary():     # process 0 writes the run's files
        return summary
    summary.update({"command": " ".join([sys.executable.split("/")[-1], "-m", "experiments.train", *sys.argv[1:]]),
                    "config": config.to_dict(), "machine": machine_info(), "source": source.describe(),
                    "elapsed_s": time.time() - started})
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    plot_history(out)
    return summary


def run_sft(config: RunConfig, args: argparse.Namespace, source: Any, student: Any, tokenizer: Any, out: Path,
            progress: bool) -> dict[str, Any]:
    """Supervised fine-tuning on demonstrations of the training games (``--sft-demonstrations``: walkthroughs or the
    searching expert's won episodes), evaluated like a distilled student."""
    from jaxopd.methods.run_folder import check_and_save_config
    from jaxopd.methods.sft import sft_steps, train_sft
    from jaxopd.methods.sft_data import sft_corpus
    from jaxopd.sampler.engine import Engine, EngineConfig

    try:
        check_and_save_config(out, config)          # before the corpus: a resumed run keeps its settings
        corpus = sft_corpus(config, source, tokenizer, progress=progress)
    except ValueError as error:
        raise UsageError(str(error)) from None
    samples, stats, failures = corpus.samples, corpus.stats, corpus.failures
    print(f"run config (sft on {config.benchmark}, preset {config.preset}):\n{config.describe()}", flush=True)
    if failures:
        print(f"SFT demonstrations: the {config.sft_demonstrations} won {len(corpus.references)} of "
              f"{len(corpus.tasks)} training games within {config.max_turns} turns; the other {len(failures)} are "
              "left out", flush=True)
    steps = args.steps or sft_steps(len(samples), config.batch_size, config.sft_epochs)
    # project only the response positions: the longest walkthrough response, rounded up to 8
    supervised = -(-max(s.num_supervised for s in samples) // 8) * 8
    print(f"SFT data: {len(corpus.tasks)} games, {json.dumps(stats.as_dict())}; {steps} steps of {config.batch_size}",
          flush=True)
    evaluate = None
    if not args.no_eval:
        from types import SimpleNamespace

        from jaxopd.methods.loop import engine_config_for
        # the evaluations' engine, sized as vanilla OPD's: one think-then-act request per episode (no fast requests)
        sizing = SimpleNamespace(**{f.name: getattr(config, f.name) for f in dataclasses.fields(config)},
                                 fast_action_tokens=0)
        engine_config: EngineConfig = engine_config_for(sizing, SimpleNamespace(name="vanilla-opd"))
        engine_eval = make_evaluator(dataclasses.replace(config, updates=steps), source, tokenizer, out, progress)

        def evaluate(model, step):
            with Engine(model, engine_config, tokenizer=tokenizer) as engine:
                return engine_eval(engine, step)
    exports = export_steps(args, steps)
    if args.export:
        if steps in exports:
            raise UsageError(f"--export-at {steps} and --export both write the last step's model; give one of them")
        exports[steps] = args.export
    train_sft(student, samples, out, steps=steps, batch_size=config.batch_size,
              learning_rate=config.learning_rate, weight_decay=config.weight_decay,
              max_grad_norm=config.max_grad_norm, lr_schedule=config.lr_schedule, seed=config.seed,
              max_train_tokens=config.max_train_tokens,
              max_supervised_tokens=supervised,
              group_by_length=config.sft_group_by_length,
              checkpoint_every=config.checkpoint_every, keep_checkpoints=config.keep_checkpoints,
              eval_every=config.eval_every, evaluate=evaluate, exports=exports, lora=config.lora_config(),
              exporter=make_exporter(config, student, tokenizer), run_config=config.to_dict(),
              progress=progress)
    summary: dict[str, Any] = {"steps": steps, "samples": len(samples), "data": stats.as_dict(),
                               "demonstrations": {"kind": config.sft_demonstrations, "games": len(corpus.tasks),
                                                  "demonstrated": len(corpus.references), "failed": failures}}
    if args.export:
        summary["export"] = args.export
    return summary


def make_exporter(config: RunConfig, student: Any, tokenizer: Any):
    """``export(learner, folder)``: the trained student as a Hugging Face folder, or with ``--lora-rank`` as an
    adapter folder over ``--student`` (``jaxopd.models.folders.save_adapted``: a few MB, loaded by every command
    like a model folder, its tokenizer the base's); a whole model gets the tokenizer's files (a Llama folder's own)."""
    def export(learner: Any, folder: Path) -> None:
        from jaxopd.tokenizer import save_tokenizer
        if learner.lora is None:
            from jaxopd.methods.sft import save_whole_model
            save_whole_model(learner, folder)       # gathers the weights: every process of a multi-process run
            if distributed.is_primary():
                save_tokenizer(tokenizer, folder)
            return
        from jaxopd.models.folders import save_adapted
        adapters = learner.adapters()
        if not distributed.is_primary():
            return
        save_adapted(folder, adapters, learner.lora, base=config.student, model_config=student.config,
                     layers=config.student_layers or None)

    return export


def export_steps(args: argparse.Namespace, steps: int) -> dict[int, str]:
    """``--export-at STEP DIR`` pairs as ``{step: folder}``; a usage error for a step outside the run or a folder
    that cannot be written."""
    exports: dict[int, str] = {}
    for step_text, folder in getattr(args, "export_at", None) or ():
        try:
            step = int(step_text)
        except ValueError:
            raise UsageError(f"--export-at takes STEP DIR, and {step_text!r} is not a step") from None
        if not 1 <= step <= steps:
            raise UsageError(f"--export-at {step}: the run has steps 1 to {steps}")
        cli.check_out_dir("--export-at", folder)
        exports[step] = folder
    return exports


def plot_history(out: Path) -> None:
    """Success rate against update and wall-clock from ``eval.jsonl`` (when the run evaluated)."""
    from jaxopd.methods.evaluate import plot_learning_curves

    records = [r for r in read_jsonl(out / "eval.jsonl") if r.get("success_rate_mean") is not None]
    if records:
        config = json.loads((out / "config.json").read_text())
        history = [{"update": r["step"], "wall_s": r["wall_s"], "success_rate_mean": r["success_rate_mean"],
                    "success_rate_std": r.get("success_rate_std", 0.0), "label": config["method"]} for r in records]
        plot_learning_curves(history, out)


def multiprocess_run(args: argparse.Namespace) -> bool:
    """Whether this command runs as one of several processes (``--num-processes N > 1``, or ``JAXOPD_*`` set by a
    launcher or by the user on each host)."""
    return getattr(args, "num_processes", 1) > 1 or int(os.environ.get(distributed.ENV_NUM_PROCESSES, "1") or 1) > 1


EXIT_LOST_PEER = 75        # EX_TEMPFAIL: rerunning every process resumes the run


def lost_peer(error: BaseException) -> NoReturn:
    """A collective of a multi-process run failed (another process died or stopped answering): one line naming the
    lost processes as JAX's coordinator sees them after its heartbeat timeout, then exit at once. A normal exit would
    wait at JAX's shutdown barrier, which cannot pass without the lost process, and abort with a stack trace."""
    import jax
    count = jax.process_count()
    live = distributed.live_processes(distributed.heartbeat_timeout_s() + 15)
    if live is None:
        who = f"a process of the {count} was lost or is stuck (the coordinator did not answer)"
    else:
        lost = [p for p in range(count) if p not in live]
        who = (" and ".join(f"process {p} of {count}" for p in lost) + " was lost (no heartbeat)") if lost else \
            f"all {count} processes are alive but a collective failed"
    first = (str(error).strip().splitlines() or ["?"])[0][:300]
    print(f"{who}; stopping process {jax.process_index()} ({first}). Rerun every process with the same command to "
          "resume from the last checkpoint.", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(EXIT_LOST_PEER)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    argv = list(sys.argv[1:] if argv is None else argv)
    if args.num_processes < 1:
        return cli.report(f"--num-processes must be at least 1, got {args.num_processes}")
    if args.num_processes > 1 and not os.environ.get(distributed.ENV_NUM_PROCESSES):
        if args.method == "sft":
            return cli.report("--method sft runs in one process; --num-processes is for the distillation methods")
        from jaxopd.launch import launch_local
        return launch_local([sys.executable, "-m", "experiments.train", *argv], args.num_processes)
    try:
        distributed.initialize(distributed.DistributedConfig.from_env())     # before any other JAX call
    except ValueError as error:
        return cli.report(error)

    def body() -> int:
        try:
            summary = run(args)
        except Interrupted as stop:        # SIGINT / SIGTERM: the checkpoint is written; one line, 128 + signal
            print(str(stop), file=sys.stderr, flush=True)
            return stop.exit_code
        except Exception as error:
            import jax
            if distributed.is_multiprocess() and isinstance(error, jax.errors.JaxRuntimeError):
                lost_peer(error)
            raise
        print(json.dumps({k: v for k, v in summary.items() if k not in ("config", "machine")}, indent=2, default=str))
        return 0

    return cli.run_main(body)


if __name__ == "__main__":
    sys.exit(main())
