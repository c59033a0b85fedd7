"""Stop 48: the one-sft run over the corpus's sub-vocabulary against the same run over all 151,936 ids (stops 42-45),
step for step. Both runs see the same batches in the same order (seed 0, grouped by length, the same resumes), so
their per-step losses and step times compare directly.

    python results/train/stop48/against_full.py runs/sft-sub/train.jsonl --out results/train/stop48/against_full

Writes OUT.md (a table per 100-step window: mean response NLL, mean context NLL and median step time of each run)
and OUT.png (the response NLL of both runs, 50-step means, against the step).
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
# The full-vocabulary run's per-step records, by the steps each file holds (later files win on overlapping steps:
# stop 45 re-ran steps 2,051-2,064 from stop 44's step-2,050 checkpoint, bitwise the same losses).
FULL = ["results/train/stop43/sft-one-1600/train.jsonl", "results/train/stop44/sft-one-2400/train-1601-on.jsonl",
        "results/train/stop45/sft-one-2400/train-2051-on.jsonl", "results/train/stop45/sft-one-2800/train-2401-on.jsonl"]


def records(path: Path) -> dict[int, dict]:
    out = {}
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("kind") == "train":
            out[int(record["step"])] = record
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sub", help="the sub-vocabulary run's train.jsonl")
    parser.add_argument("--window", type=int, default=100)
    parser.add_argument("--out", default="results/train/stop48/against_full")
    args = parser.parse_args()
    full: dict[int, dict] = {}
    for name in FULL:
        full.update(records(REPO / name))
    sub = records(Path(args.sub))
    last = max(sub)
    lines = [f"One-sft run, sub-vocabulary (`{args.sub}`, steps 1-{last}) against the full vocabulary (stops 42-45, "
             "the same batches): means over each window of steps; step time as the median.", "",
             "| steps | response NLL, full | response NLL, sub | context NLL, full | context NLL, sub | "
             "step s, full | step s, sub | full / sub |", "|---|---|---|---|---|---|---|---|"]
    for start in range(1, last + 1, args.window):
        steps = [s for s in range(start, min(start + args.window, last + 1)) if s in sub and s in full]
        if not steps:
            continue

        def mean(run, key, steps=steps):
            return statistics.mean(run[s][key] for s in steps)

        def median_s(run, steps=steps):
            return statistics.median(run[s]["step_s"] for s in steps)

        lines.append(f"| {steps[0]}-{steps[-1]} | {mean(full, 'nll'):.3f} | {mean(sub, 'nll'):.3f} | "
                     f"{mean(full, 'context_nll'):.3f} | {mean(sub, 'context_nll'):.3f} | {median_s(full):.2f} | "
                     f"{median_s(sub):.2f} | {median_s(full) / median_s(sub):.2f} |")
    both = [s for s in sub if s in full]
    total_full = sum(full[s]["step_s"] for s in both)
    total_sub = sum(sub[s]["step_s"] for s in both)
    lines += ["", f"Steps 1-{last}: step time summed {total_full:,.0f} s (full) against {total_sub:,.0f} s (sub), "
              f"{total_full / total_sub:.2f}x; median {statistics.median(full[s]['step_s'] for s in both):.2f} s "
              f"against {statistics.median(sub[s]['step_s'] for s in both):.2f} s."]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, run in (("full vocabulary (stops 42-45)", full), ("sub-vocabulary (stop 48)", sub)):
        steps = sorted(s for s in run if s <= last)
        xs, ys = [], []
        for start in range(0, len(steps), 50):
            chunk = steps[start:start + 50]
            xs.append(chunk[-1])
            ys.append(statistics.mean(run[s]["nll"] for s in chunk))
        ax.plot(xs, ys, label=label)
    ax.set_yscale("log")
    ax.set_xlabel("SFT step")
    ax.set_ylabel("training response NLL (50-step mean)")
    ax.set_title("one-sft run: sub-vocabulary against full vocabulary")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    print(f"wrote {out.with_suffix('.md')} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
