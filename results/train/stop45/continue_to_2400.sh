#!/bin/bash
# stop 45: the one-sft run resumed again (from step 2,050) from its step-1,600 checkpoint towards 2,400 steps (a second warm restart)
date
.venv/bin/python -m experiments.train --method sft --preset cpu --sft-demonstrations searching-expert --sft-thinking task-tool-act-here --first-stage-tokens 96 --total-tokens 128 --max-supervised-tokens 120 --max-turns 30 --sft-context-weight 1.0 --sft-renamed-copies 1 --sft-take-copies 3 --sft-refused-copies 1 --sft-missing-copies 1 --sft-action-format said --sft-group-by-length 32 --lr-schedule cosine --batch-size 8 --steps 2400 --checkpoint-every 50 --keep-checkpoints 2 --no-eval --no-progress --out runs/sft-one-2400 --student runs/copy2-hf --export runs/teacher-one2400-hf --export-at 2000 runs/teacher-one2000-hf
date
