#!/bin/bash
# stop 47 (left running at the session's end): more inverse-dynamics practice. The fast student
# (runs/student-fast-hf) fine-tuned 200 more steps at a constant 1e-4 on the one-sft corpus plus four renamed copies
# of every turn as a next-action and an inverse-dynamics request (--sft-fast-copies 4: about two thirds of the
# samples are fast requests), then probed as stop 47's fast_probe.py probes (does guidance have a chance?).
cd "$(dirname "$0")/../../.."
py=${PYTHON:-.venv/bin/python}
$py -m experiments.train --method sft --preset cpu --sft-demonstrations searching-expert \
  --sft-thinking task-tool-act-here --first-stage-tokens 96 --total-tokens 128 --max-supervised-tokens 120 \
  --max-turns 30 --sft-context-weight 1.0 --sft-renamed-copies 1 --sft-take-copies 3 --sft-refused-copies 1 \
  --sft-missing-copies 1 --sft-fast-copies 4 --sft-action-format said --sft-group-by-length 32 --learning-rate 1e-4 \
  --batch-size 8 --steps 200 --checkpoint-every 50 --keep-checkpoints 2 --no-eval --no-progress \
  --out runs/sft-fast4-200 --student runs/student-fast-hf --export runs/student-fast4-hf
$py results/train/stop47/fast_probe.py --model student-fast4=runs/student-fast4-hf --temperatures 0 1 \
  --out runs/probe-fast4
