"""How far the agents of ALFWorld evaluations got and how they thought, side by side (``jaxopd.methods.transcripts``).

    python -m experiments.episode_report --eval copy=results/train/copy-warmup/eval-teacher \\
        --eval plan=results/train/plan/eval-teacher --thinking plan --out results/train/plan/transcripts

Each ``--eval LABEL=PATH`` is an ``experiments.evaluate`` output folder (or its ``evaluation.json``). Writes
``transcripts.json``, ``transcripts.md`` (one row per evaluation: won, the progress funnel, refused and repeated
moves, thinking fidelity, whether the thinking read the observation it answered) and ``funnel.png`` (the share of
episodes reaching each stage).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Sequence

from jaxopd.cli import Parser, UsageError, check_out_dir, command_line, run_main
from jaxopd.methods.config import SFT_THINKING

STAGES = ("held", "changed", "placed", "won")
STAGE_LABELS = {"held": "held a goal object", "changed": "changed it (clean/heat/cool tasks)",
                "placed": "put one in place", "won": "won"}


def main(argv: Sequence[str] | None = None) -> int:
    parser = Parser(prog="python -m experiments.episode_report", description=__doc__.split("\n\n")[0])
    parser.add_argument("--eval", required=True, action="append", metavar="LABEL=PATH",
                        help="an experiments.evaluate folder or its evaluation.json (repeat to compare)")
    parser.add_argument("--thinking", default="plan", choices=[t for t in SFT_THINKING if t != "none"],
                        help="the demonstrations' thinking rule that the rounds' thinking is compared with")
    parser.add_argument("--out", required=True, help="output folder")
    args = parser.parse_args(argv)
    return run_main(lambda: run(args, argv))


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


def _pct(value: Any) -> str:
    return "—" if value is None else f"{100 * value:.1f} %"


def _of(count: Mapping[str, Any]) -> str:
    return f"{count['rounds']}/{count['of']}"


def _stuck(stuck: Mapping[str, Any]) -> str:
    return f"{stuck['episodes']}/{stuck['of']} ({stuck['rounds']} rounds)"


def markdown(rows: Mapping[str, Mapping[str, Any]], thinking: str) -> str:
    head = ("| evaluation | episodes | held a goal object | changed it | put one in place | won | moves refused | "
            f"repeats | refused, given again | thinking = {thinking} rule | thinking names goal | named in view, "
            "taken | command said, "
            "done | change said, right | named in view, truly | listing copied | stuck on a refused command |")
    lines = [head, "|" + "---|" * 17]
    for label, row in rows.items():
        funnel = row["funnel"]
        cells = [f"{funnel[s]['episodes']}/{funnel[s]['of']}" for s in STAGES]
        lines.append(f"| {label} | {row['episodes']} | " + " | ".join(cells) + f" | {_pct(row['refused'])} | "
                     f"{_pct(row['repeated'])} | {_of(row['refusal_repeated'])} | {_pct(row['thinking_faithful'])} | "
                     f"{_pct(row['thinking_names_goal'])} | "
                     + " | ".join(_of(row[name]) for name in ("named_taken", "command_followed", "change_right",
                                                              "named_true", "listing_right"))
                     + f" | {_stuck(row['stuck'])} |")
    return "\n".join(lines) + "\n"


def plot_funnel(rows: Mapping[str, Mapping[str, Any]], path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    width = 0.8 / max(1, len(rows))
    for index, (label, row) in enumerate(rows.items()):
        shares = [100 * (row["funnel"][s]["share"] or 0.0) for s in STAGES]
        ax.bar([i + (index - (len(rows) - 1) / 2) * width for i in range(len(STAGES))], shares, width, label=label)
    ax.set_xticks(range(len(STAGES)), [STAGE_LABELS[s] for s in STAGES], fontsize=8)
    ax.set_ylabel("episodes reaching it (%)")
    ax.set_ylim(0, 100)
    ax.legend(fontsize=8)
    ax.set_title("ALFWorld episodes: how far the agent got", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def run(args, argv) -> int:
    from jaxopd.methods.transcripts import transcript_counts

    out = check_out_dir("--out", args.out)
    evaluations = [load_evaluation(spec) for spec in args.eval]
    labels = [label for label, _, _ in evaluations]
    if len(set(labels)) != len(labels):
        raise UsageError(f"--eval labels must differ, got {labels}")
    rows, sources = {}, {}
    for label, file, episodes in evaluations:
        try:
            rows[label] = transcript_counts(episodes, thinking=args.thinking)
        except ValueError as error:
            raise UsageError(f"--eval {label}: {error}") from None
        sources[label] = str(file)
    out.mkdir(parents=True, exist_ok=True)
    table = markdown(rows, args.thinking)
    (out / "transcripts.json").write_text(json.dumps(
        {"command": command_line("python -m experiments.episode_report", argv), "thinking": args.thinking,
         "sources": sources, "evaluations": rows}, indent=2) + "\n")
    (out / "transcripts.md").write_text(table)
    plot_funnel(rows, out / "funnel.png")
    print(table)
    print(f"wrote {out / 'transcripts.json'}, {out / 'transcripts.md'} and {out / 'funnel.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
