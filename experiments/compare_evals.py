"""Compare evaluations of several agents on the same episodes, paired (``jaxopd.methods.paired``).

    python -m experiments.compare_evals --eval student=runs/eval/student --eval actfirst=runs/eval/actfirst \\
        --eval vanilla=runs/eval/vanilla --out results/train/compare

Each ``--eval LABEL=PATH`` is an ``experiments.evaluate`` output folder (or its ``evaluation.json``); the first is
the baseline unless ``--baseline LABEL`` names another. All must have played the same tasks under the same seeds
(``--common`` compares the episodes they share and says how many were left out). Writes ``compare.json``,
``compare.md`` (success with its 95 % task-bootstrap interval, the difference from the baseline with its paired
interval, the episodes won by one agent only and McNemar's exact p) and ``compare.png``.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Sequence

from jaxopd.cli import Parser, UsageError, check_out_dir, command_line, run_main


def main(argv: Sequence[str] | None = None) -> int:
    parser = Parser(prog="python -m experiments.compare_evals", description=__doc__.split("\n\n")[0])
    parser.add_argument("--eval", required=True, action="append", metavar="LABEL=PATH",
                        help="an experiments.evaluate folder or its evaluation.json (repeat; at least two)")
    parser.add_argument("--baseline", default=None, metavar="LABEL", help="the label compared against (the first)")
    parser.add_argument("--common", action="store_true",
                        help="compare on the episodes every evaluation played (default: they must be the same)")
    parser.add_argument("--resamples", type=int, default=None, help="bootstrap resamples (10,000)")
    parser.add_argument("--out", required=True, help="output folder")
    args = parser.parse_args(argv)
    return run_main(lambda: run(args, argv))


def _pct(value: float) -> str:
    return f"{100 * value:.1f}"


def _p_value(p: float) -> str:
    return f"{p:.3f}" if p >= 0.001 else f"{p:.1e}"


def markdown(result: Mapping[str, Any]) -> str:
    seeds = result["seeds"]
    lines = [f"{result['episodes']} episodes ({result['tasks']} tasks × seeds {', '.join(map(str, seeds))}); "
             f"intervals: {100 * result['confidence']:.0f} % bootstrap over tasks ({result['resamples']:,} "
             f"resamples); baseline: {result['baseline']}", "",
             "| agent | won | success % [interval] | per seed % | − baseline, points [paired interval] | "
             "won by it only / by the baseline only | McNemar p |", "|---|---|---|---|---|---|---|"]
    for name, row in result["agents"].items():
        low, high = row["success_ci"]
        cells = [name, f"{row['successes']}/{result['episodes']}",
                 f"{_pct(row['success_rate'])} [{_pct(low)}, {_pct(high)}]",
                 ", ".join(_pct(row["per_seed"][str(s)]) for s in seeds)]
        if "difference" in row:
            dlow, dhigh = row["difference_ci"]
            cells += [f"{100 * row['difference']:+.1f} [{100 * dlow:+.1f}, {100 * dhigh:+.1f}]",
                      f"{row['only_this']} / {row['only_baseline']}", _p_value(row["mcnemar_p"])]
        else:
            cells += ["(baseline)", "—", "—"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(result: Mapping[str, Any], path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["agents"])
    rows = [result["agents"][n] for n in names]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    rates = [100 * r["success_rate"] for r in rows]
    errors = [[100 * (r["success_rate"] - r["success_ci"][0]) for r in rows],
              [100 * (r["success_ci"][1] - r["success_rate"]) for r in rows]]
    left.bar(range(len(names)), rates, yerr=errors, capsize=4, color="tab:blue")
    left.set_xticks(range(len(names)), names, fontsize=8, rotation=20)
    left.set_ylabel("success rate (%)")
    left.set_title("success, 95 % interval over tasks", fontsize=10)
    others = [(n, r) for n, r in zip(names, rows) if "difference" in r]
    diffs = [100 * r["difference"] for _, r in others]
    derr = [[100 * (r["difference"] - r["difference_ci"][0]) for _, r in others],
            [100 * (r["difference_ci"][1] - r["difference"]) for _, r in others]]
    right.bar(range(len(others)), diffs, yerr=derr, capsize=4, color="tab:orange")
    right.axhline(0, color="black", linewidth=0.8)
    right.set_xticks(range(len(others)), [n for n, _ in others], fontsize=8, rotation=20)
    right.set_ylabel(f"minus {result['baseline']} (points)")
    right.set_title("paired difference, 95 % interval", fontsize=10)
    fig.suptitle(f"{result['episodes']} episodes: {result['tasks']} tasks × {len(result['seeds'])} seeds",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def load_evaluation(spec: str) -> tuple[str, Path, list[dict]]:
    """``LABEL=PATH`` -> (label, the JSON file, its episode records)."""
    label, sep, path = spec.partition("=")
    if not sep or not label or not path:
        raise UsageError(f"--eval takes LABEL=PATH, got {spec!r}")
    file = Path(path)
    if file.is_dir():
        file = file / "evaluation.json"
    if not file.is_file():
        raise UsageError(f"--eval {label}: no evaluation file at {str(file)!r}")
    try:
        episodes = json.loads(file.read_text())["episodes"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise UsageError(f"--eval {label}: {str(file)!r} is not an experiments.evaluate result ({error})") from None
    return label, file, episodes


def run(args, argv) -> int:
    from jaxopd.methods.paired import BOOTSTRAP_RESAMPLES, outcomes_of, paired_comparison, restrict_to_common

    if len(args.eval) < 2:
        raise UsageError(f"--eval needs at least two evaluations to compare, got {len(args.eval)}")
    resamples = BOOTSTRAP_RESAMPLES if args.resamples is None else args.resamples
    if resamples < 1:
        raise UsageError(f"--resamples must be at least 1, got {resamples}")
    out = check_out_dir("--out", args.out)
    named, sources = {}, {}
    for spec in args.eval:
        label, file, episodes = load_evaluation(spec)
        if label in named:
            raise UsageError(f"--eval labels must differ, {label!r} is given twice")
        try:
            named[label] = outcomes_of(episodes)
        except ValueError as error:
            raise UsageError(f"--eval {label}: {error}") from None
        sources[label] = str(file)
    if args.baseline is not None and args.baseline not in named:
        raise UsageError(f"--baseline {args.baseline!r} is not one of the --eval labels {list(named)}")
    left_out = 0
    if args.common:
        named, left_out = restrict_to_common(named)
        if not next(iter(named.values())):
            raise UsageError("--common: the evaluations share no episode (task and seed)")
    try:
        result = paired_comparison(named, baseline=args.baseline, resamples=resamples)
    except ValueError as error:
        raise UsageError(str(error)) from None
    result = {"command": command_line("python -m experiments.compare_evals", argv), "sources": sources,
              "common_only": bool(args.common), "episodes_left_out": left_out, **result}
    table = markdown(result)
    if args.common:
        table += f"\n(--common: {left_out} episodes played by some evaluations only were left out.)\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "compare.md").write_text(table)
    plot(result, out / "compare.png")
    print(table)
    print(f"wrote {out / 'compare.json'}, {out / 'compare.md'} and {out / 'compare.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
