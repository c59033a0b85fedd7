#!/bin/bash
# stop 46 (left running at the session's end): a student that can serve ActFirst-OPD's fast requests. The one-sft
# student of step 1,600 fine-tuned 200 more steps at a constant 1e-4 on the one-sft corpus plus one renamed copy of
# every turn as a next-action and as an inverse-dynamics request (--sft-fast-copies 1). Its export is the student
# for the next ActFirst run; it needs its own baseline evaluation first (the full-mode turns train it too).
cd "$(dirname "$0")/../../.."
${PYTHON:-.venv/bin/python} -m experiments.train --method sft --preset cpu --sft-demonstrations searching-expert \
  --sft-thinking task-tool-act-here --first-stage-tokens 96 --total-tokens 128 --max-supervised-tokens 120 \
  --max-turns 30 --sft-context-weight 1.0 --sft-renamed-copies 1 --sft-take-copies 3 --sft-refused-copies 1 \
  --sft-missing-copies 1 --sft-fast-copies 1 --sft-action-format said --sft-group-by-length 32 --learning-rate 1e-4 \
  --batch-size 8 --steps 200 --checkpoint-every 50 --keep-checkpoints 2 --no-eval --no-progress \
  --out runs/sft-fast-200 --student runs/teacher-one1600-hf --export runs/student-fast-hf
