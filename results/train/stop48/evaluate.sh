#!/bin/bash
# stop 48: play a model folder on the 48 generated valid_unseen games x seeds 42/43/44 (the evaluation of stops 35-47)
#   bash results/train/stop48/evaluate.sh MODEL_DIR NAME      -> runs/eval/NAME
set -e
model=$1; name=$2
cd "$(dirname "$0")/../../.."
py=${PYTHON:-.venv/bin/python}
date
/usr/bin/time -v $py -m experiments.evaluate --student $model --split valid_unseen --seeds 42 43 44 --max-turns 30 \
  --max-prompt-tokens 1024 --think-tokens 96 128 --slots 8 --no-progress --out runs/eval/$name
date
