#!/bin/bash
# stop 48: distil the sub-vocabulary student (runs/sub1600-hf, step 1,600 of `teacher_recipe --recipe one-sft-sub`)
# from its teacher (runs/sub2800-hf, step 2,800 of the same run), 40 updates, then play the result on the 48 unseen
# games x seeds 42/43/44. The settings of stop 47's opd.sh.
#   bash results/train/stop48/opd.sh METHOD LR UPDATES NAME [extra experiments.train flags]
# (EVALUATE=0: train only; stop 50's queue.sh evaluates beside the next training)
set -e
m=$1; lr=$2; updates=$3; name=$4; shift 4
cd "$(dirname "$0")/../../.."
py=${PYTHON:-.venv/bin/python}
student=${STUDENT:-runs/sub1600-hf}
teacher=${TEACHER:-runs/sub2800-hf}
date
/usr/bin/time -v $py -m experiments.train --method $m --preset cpu --student $student --teacher $teacher \
  --updates $updates --checkpoint-every 10 --learning-rate $lr --max-turns 30 --sft-thinking task-tool-act-here \
  --sft-action-format said --first-stage-tokens 96 --total-tokens 128 --max-supervised-tokens 128 \
  --no-eval --no-progress --out runs/opd48/$name --export runs/opd48/$name-hf "$@"
date
[ "${EVALUATE:-1}" = 0 ] || bash results/train/stop48/evaluate.sh runs/opd48/$name-hf opd48-$name
