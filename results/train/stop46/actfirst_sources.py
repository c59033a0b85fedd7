"""Where the executed actions of ActFirst-OPD runs came from (stop 46): per run, the mean over its updates of the
share of executed actions that were reference-conditioned inverse-dynamics proposals or autonomous next-action
predictions (``action_source_*``), of the rollout episodes won, and of those with an unproductive repetition (App. C.5's Repeat,
``rollout_repeat_percent``; stop 50 corrected this label, first written "moves repeating the last"), read from the
``train.jsonl`` that ``experiments.train`` writes.

    python results/train/stop46/actfirst_sources.py $(find results/train runs/opd46 -path '*actfirst*' -name train.jsonl | sort)
"""
import json
import sys


def mean(rows, key):
    values = [row[key] for row in rows if row.get(key) is not None]
    return sum(values) / len(values) if values else None


def source_share(rows, key):
    """The share of all executed actions (weighted by each update's executed transitions) that came from ``key``;
    an update that logged other sources but not this one executed none from it (stop 47: stop 46's first version
    averaged over the updates that logged ``key`` only, which overstated the share of a source some updates lacked)."""
    rows = [row for row in rows if any(k.startswith("action_source_") for k in row)]
    weights = [row.get("rollout_num_transitions", 1.0) for row in rows]
    if not rows or sum(weights) == 0:
        return None
    return sum(w * row.get(key, 0.0) for w, row in zip(weights, rows)) / sum(weights)


def cell(value, scale=100.0):
    return "—" if value is None else f"{scale * value:.1f} %"


def main(paths):
    print("| run (train.jsonl) | updates | inverse dynamics executed | next-action prediction executed | rollout episodes "
          "won | episodes with an unproductive repetition |")
    print("|---|---|---|---|---|---|")
    for path in paths:
        with open(path) as handle:
            rows = [json.loads(line) for line in handle if '"kind": "train"' in line]
        repeat = mean(rows, "rollout_repeat_percent")
        print(f"| {path} | {len(rows)} | {cell(source_share(rows, 'action_source_inverse_dynamics'))} | "
              f"{cell(source_share(rows, 'action_source_next_action'))} | {cell(mean(rows, 'rollout_success_rate'))} | "
              f"{cell(repeat, 1.0)} |")


if __name__ == "__main__":
    main(sys.argv[1:])
