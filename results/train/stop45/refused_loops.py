"""Episodes stuck repeating one refused action (stop 45): of each evaluation's episodes, those with a run of at
least ``--run`` identical actions in a row each answered "Nothing happens." (the engine's refusal), and the rounds
spent in such runs. Reads the ``episodes`` of ``evaluation.json`` files written by ``experiments.evaluate``.

    python results/train/stop45/refused_loops.py step1600=results/train/stop43/eval-teacher-one1600 \
        step2400=results/train/stop45/eval-teacher-one2400
"""
import argparse
import json
import os

from jaxopd.methods.transcripts import refused_runs      # moved there in stop 46


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("evals", nargs="+", help="NAME=DIR of an evaluation")
    p.add_argument("--run", type=int, default=5)
    args = p.parse_args()
    print(f"| evaluation | episodes | with {args.run}+ identical refused actions in a row | of them won "
          "| rounds in such runs |")
    print("|---|---|---|---|---|")
    for spec in args.evals:
        name, folder = spec.split("=", 1)
        with open(os.path.join(folder, "evaluation.json")) as f:
            episodes = json.load(f)["episodes"]
        stuck = [e for e in episodes if max(refused_runs(e["actions"], e["feedback"]), default=0) >= args.run]
        rounds = sum(r for e in episodes for r in refused_runs(e["actions"], e["feedback"]) if r >= args.run)
        total = sum(len(e["actions"]) for e in episodes)
        print(f"| {name} | {len(episodes)} | {len(stuck)} | {sum(e['won'] for e in stuck)} | {rounds}/{total} |")


if __name__ == "__main__":
    main()
