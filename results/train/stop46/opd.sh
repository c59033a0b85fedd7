#!/bin/bash
# stop 46: distil the one-sft student of step 1,600 (9.7 % on the 48 unseen games) from a later export of the same
# one-sft run, then play the result on the 48 games x seeds 42/43/44.
#   bash results/train/stop46/opd.sh METHOD TEACHER_DIR LR UPDATES NAME
set -e
m=$1; teacher=$2; lr=$3; updates=$4; name=$5
cd "$(dirname "$0")/../../.."
py=${PYTHON:-.venv/bin/python}
date
/usr/bin/time -v $py -m experiments.train --method $m --preset cpu --student runs/teacher-one1600-hf --teacher $teacher \
  --updates $updates --checkpoint-every 10 --learning-rate $lr --max-turns 30 --sft-thinking task-tool-act-here \
  --sft-action-format said --first-stage-tokens 96 --total-tokens 128 --max-supervised-tokens 128 \
  --no-eval --no-progress --out runs/opd46/$name --export runs/opd46/$name-hf
date
/usr/bin/time -v $py -m experiments.evaluate --student runs/opd46/$name-hf --split valid_unseen --seeds 42 43 44 \
  --max-turns 30 --max-prompt-tokens 1024 --think-tokens 96 128 --slots 8 --no-progress --out runs/eval/opd46-$name
date
