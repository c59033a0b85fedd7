"""Collect finished training runs into one report: a markdown table, learning curves and each run's files.

    python -m experiments.train_report runs/train/vanilla runs/train/actfirst --out results/train

For each run folder (written by ``python -m experiments.train``): the command, the first and last evaluation
(success rate mean ± std over seeds, rounds, the exact reverse KL to the teacher on held-out states), the
training wall-clock (evaluation excluded) and the mean seconds per update spent in rollout, scoring, step and
sync. Writes ``<out>/table.md``, ``<out>/runs.json``, ``success_vs_update.png`` /
``success_vs_wallclock.png`` over all runs, and copies each run's summary, metrics and evaluation tables into
``<out>/<run name>/`` (checkpoints and exported weights are not copied).

Runs trained with ``--no-eval`` are evaluated afterwards by ``python -m experiments.evaluate`` on their exported
students; ``--evaluation RUN UPDATE DIR`` joins such an evaluation (its ``evaluation.json``) to run ``RUN`` (a run
folder's name) at update ``UPDATE`` (0: the student the run started from), at the training wall-clock the run had
reached then, so the table and the learning curves hold it like an evaluation made during training:

    python -m experiments.train_report runs/a/actfirst --evaluation actfirst 0 runs/eval/student \
        --evaluation actfirst 80 runs/eval/actfirst --out results/train/a
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any, Sequence

from jaxopd import cli
from jaxopd.methods.evaluate import plot_learning_curves
from jaxopd.methods.metrics_log import read_jsonl

COPIED = ("summary.json", "config.json", "train.jsonl", "eval.jsonl", "success_vs_update.png",
          "success_vs_wallclock.png")


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def external_evaluation(train: Sequence[dict[str, Any]], update: int, folder: Path) -> dict[str, Any]:
    """An evaluation of ``python -m experiments.evaluate`` (its ``folder``) as the eval record of a run at
    ``update``: success and rounds over seeds from the first split's summary, and the training wall-clock of the
    run's update ``update`` in ``train`` (0 for update 0, the starting student). ``UsageError`` for a folder
    without ``evaluation.json`` or an update the run's metrics do not hold."""
    path = folder / "evaluation.json"
    if not path.is_file():
        raise cli.UsageError(f"--evaluation {str(folder)!r}: no evaluation.json (a python -m experiments.evaluate "
                             "output folder is needed)")
    if update == 0:
        wall_s = 0.0
    else:
        walls = [r["wall_s"] for r in train if r.get("step") == update and "wall_s" in r]
        if not walls:
            raise cli.UsageError(f"--evaluation at update {update}: the run's train.jsonl has no update {update} "
                                 f"(it ends at {train[-1]['step'] if train else 0})")
        wall_s = float(walls[-1])
    summary = json.loads(path.read_text())["summaries"][0]
    overall = summary["overall"]
    return {"step": update, "wall_s": wall_s, "success_rate_mean": overall["success_rate"]["mean"],
            "success_rate_std": overall["success_rate"]["std"], "mean_rounds_mean": overall["mean_rounds"]["mean"],
            "tasks": summary["num_tasks"], "seeds": summary["seeds"], "split": summary["split"],
            "evaluation": str(folder)}


def describe_run(folder: Path, evaluations: Sequence[tuple[int, Path]] = ()) -> dict[str, Any]:
    """The report row of run ``folder``; ``evaluations`` (update, evaluation folder) join its in-training ones
    (:func:`external_evaluation`; one at the same update replaces it)."""
    summary = json.loads((folder / "summary.json").read_text()) if (folder / "summary.json").is_file() else {}
    config = json.loads((folder / "config.json").read_text())
    train = read_jsonl(folder / "train.jsonl")
    evals = [r for r in read_jsonl(folder / "eval.jsonl") if r.get("success_rate_mean") is not None]
    joined = {update: external_evaluation(train, update, path) for update, path in evaluations}
    evals = sorted([r for r in evals if r["step"] not in joined] + list(joined.values()), key=lambda r: r["step"])
    row: dict[str, Any] = {"run": folder.name, "method": config["method"], "command": summary.get("command"),
                           "updates": train[-1]["step"] if train else 0,
                           "train_wall_s": train[-1]["wall_s"] if train else None}
    for name in ("rollout_s", "scoring_s", "step_s", "sync_s"):
        row[f"mean_{name}"] = _mean([r[name] for r in train if name in r])
    if evals:
        first, last = evals[0], evals[-1]
        row.update({"first_eval_update": first["step"], "last_eval_update": last["step"],
                    "success_first": first["success_rate_mean"], "success_first_std": first.get("success_rate_std"),
                    "success_last": last["success_rate_mean"], "success_last_std": last.get("success_rate_std"),
                    "rkl_first": first.get("exact_reverse_kl"), "rkl_last": last.get("exact_reverse_kl"),
                    "rounds_first": first.get("mean_rounds_mean"), "rounds_last": last.get("mean_rounds_mean"),
                    "eval_tasks": last.get("tasks"), "eval_seeds": last.get("seeds"), "eval_split": last.get("split")})
    row["history"] = [{"update": r["step"], "wall_s": r["wall_s"], "success_rate_mean": r["success_rate_mean"],
                       "success_rate_std": r.get("success_rate_std") or 0.0, "label": folder.name} for r in evals]
    return row


def _pct(value: Any, std: Any = None) -> str:
    if value is None:
        return "—"
    return f"{100 * value:.1f}" + (f" ± {100 * std:.1f}" if std is not None else "")


def _num(value: Any, digits: int = 3) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    lines = ["| run | method | updates | success first → last (%) | exact RKL first → last | rounds first → last | "
             "train wall-clock (s) | rollout / scoring / step / sync (s per update) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        success = (f"{_pct(r.get('success_first'), r.get('success_first_std'))} → "
                   f"{_pct(r.get('success_last'), r.get('success_last_std'))}")
        times = " / ".join(_num(r.get(f"mean_{name}_s"), 2 if name == "sync" else 1)
                           for name in ("rollout", "scoring", "step", "sync"))
        lines.append(f"| {r['run']} | {r['method']} | {r['updates']} | {success} | {_num(r.get('rkl_first'))} → "
                     f"{_num(r.get('rkl_last'))} | {_num(r.get('rounds_first'), 1)} → {_num(r.get('rounds_last'), 1)} "
                     f"| {_num(r.get('train_wall_s'), 0)} | {times} |")
    lines.append("")
    for r in rows:
        if r.get("command"):
            lines.append(f"- `{r['run']}`: `{r['command']}`")
    return "\n".join(lines) + "\n"


def plot_reverse_kl(folders: Sequence[Path], path: Path) -> bool:
    """The exact reverse KL to the teacher on held-out states at each evaluation, one line per run."""
    lines = []
    for folder in folders:
        points = [(r["step"], r["exact_reverse_kl"]) for r in read_jsonl(folder / "eval.jsonl")
                  if r.get("exact_reverse_kl") is not None]
        if points:
            lines.append((folder.name, points))
    if not lines:
        return False
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figure, axis = plt.subplots(figsize=(6.4, 4.0))
    for name, points in lines:
        axis.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
    axis.set_xlabel("update")
    axis.set_ylabel("exact KL(student || teacher), nats per token")
    axis.set_title("Reverse KL to the teacher on held-out states")
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True


def build_parser() -> argparse.ArgumentParser:
    parser = cli.Parser(prog="python -m experiments.train_report", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="run folders of python -m experiments.train")
    parser.add_argument("--evaluation", nargs=3, action="append", default=[], metavar=("RUN", "UPDATE", "DIR"),
                        help="join an evaluation folder of python -m experiments.evaluate to run RUN (a run "
                             "folder's name) at update UPDATE (0: the starting student); repeatable")
    parser.add_argument("--out", required=True)
    return parser


def _evaluations(folders: Sequence[Path], given: Sequence[Sequence[str]]) -> dict[str, list[tuple[int, Path]]]:
    names = {f.name for f in folders}
    joined: dict[str, list[tuple[int, Path]]] = {}
    for run, update, path in given:
        if run not in names:
            raise cli.UsageError(f"--evaluation {run!r}: not one of the runs ({', '.join(sorted(names))})")
        try:
            step = int(update)
        except ValueError:
            raise cli.UsageError(f"--evaluation {run} {update!r}: the update must be a whole number") from None
        if step < 0:
            raise cli.UsageError(f"--evaluation {run} {update}: the update must be >= 0")
        joined.setdefault(run, []).append((step, cli.check_input_folder("--evaluation", path)))
    return joined


def _copy_files(source: Path, destination: Path) -> None:
    destination.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        if item.is_file():
            shutil.copy2(item, destination / item.name)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return cli.run_main(lambda: _main(args))


def _main(args: argparse.Namespace) -> int:
    folders = [cli.check_input_folder("run folder", f) for f in args.runs]
    missing = [str(f) for f in folders if not (f / "config.json").is_file()]
    if missing:
        raise cli.UsageError(f"not a training run folder (no config.json): {', '.join(missing)}")
    evaluations = _evaluations(folders, args.evaluation)
    out = cli.check_out_dir("--out", args.out)
    rows = [describe_run(f, evaluations.get(f.name, ())) for f in folders]
    for folder in folders:
        target = out / folder.name
        if target.resolve() == folder.resolve():     # a report rebuilt from its own copies of the runs
            continue
        target.mkdir(exist_ok=True)
        for name in COPIED:
            if (folder / name).is_file():
                shutil.copy2(folder / name, target / name)
        if (folder / "eval").is_dir():
            for evaluation in sorted((folder / "eval").iterdir()):
                _copy_files(evaluation, target / "eval" / evaluation.name)
        for update, evaluation in evaluations.get(folder.name, ()):
            _copy_files(evaluation, target / "eval" / f"update_{update:05d}")
    history = [point for row in rows for point in row["history"]]
    if history:
        plot_learning_curves(history, out)
    plot_reverse_kl(folders, out / "reverse_kl_vs_update.png")
    (out / "runs.json").write_text(json.dumps(rows, indent=2) + "\n")
    (out / "table.md").write_text(markdown(rows))
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
