#!/bin/bash
# stop 47: distil the fast-request student (runs/student-fast-hf, stop 46's fast_student.sh: the one-sft student of
# step 1,600 plus 200 SFT steps that include next-action and inverse-dynamics requests) from the 34 % teacher
# (one-sft step 2,800), then play the result on the 48 unseen games x seeds 42/43/44.
#   bash results/train/stop47/opd.sh METHOD LR UPDATES NAME [extra experiments.train flags]
set -e
m=$1; lr=$2; updates=$3; name=$4; shift 4
cd "$(dirname "$0")/../../.."
py=${PYTHON:-.venv/bin/python}
student=${STUDENT:-runs/student-fast-hf}
teacher=${TEACHER:-runs/teacher-one2800-hf}
date
/usr/bin/time -v $py -m experiments.train --method $m --preset cpu --student $student --teacher $teacher \
  --updates $updates --checkpoint-every 10 --learning-rate $lr --max-turns 30 --sft-thinking task-tool-act-here \
  --sft-action-format said --first-stage-tokens 96 --total-tokens 128 --max-supervised-tokens 128 \
  --no-eval --no-progress --out runs/opd47/$name --export runs/opd47/$name-hf "$@"
date
/usr/bin/time -v $py -m experiments.evaluate --student runs/opd47/$name-hf --split valid_unseen --seeds 42 43 44 \
  --max-turns 30 --max-prompt-tokens 1024 --think-tokens 96 128 --slots 8 --no-progress --out runs/eval/opd47-$name
date
