#!/bin/bash
# stop 45: the one-sft run resumed from its step-2,800 checkpoint towards 3,200 steps (a fourth warm restart, a 3,200-step cosine)
date
.venv/bin/python -m experiments.train --method sft --preset cpu --sft-demonstrations searching-expert --sft-thinking task-tool-act-here --first-stage-tokens 96 --total-tokens 128 --max-supervised-tokens 120 --max-turns 30 --sft-context-weight 1.0 --sft-renamed-copies 1 --sft-take-copies 3 --sft-refused-copies 1 --sft-missing-copies 1 --sft-action-format said --sft-group-by-length 32 --lr-schedule cosine --batch-size 8 --steps 3200 --checkpoint-every 50 --keep-checkpoints 2 --no-eval --no-progress --out runs/sft-one-3200 --student runs/copy2-hf --export runs/teacher-one3200-hf
date
