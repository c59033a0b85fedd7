#!/bin/bash
# stop 51: the screen of this stop's distillation runs, two minutes a model instead of a 20-minute evaluation:
# each student's exact reverse KL to the teacher (results/train/stop49/models/sub2800-hf) on held-out states, the
# searching expert's 121 turns of 10 generated valid_unseen games (no training game among them), teacher-forced
# (experiments.demo_fit, the measure of stop 50's heldout_kl.sh). The students: the step-800 student and what 40
# updates of each stop-51 run made of it.
#   bash results/train/stop51/heldout_kl.sh          -> results/train/stop51/heldout_kl.json/.md
# Later stops' runs: RUNS="NAME ..." (under runs/opd48, NAME-hf) OUT=results/train/stopNN bash .../heldout_kl.sh
set -e
cd "$(dirname "$0")/../../.."
py=${PYTHON:-.venv/bin/python}
models=results/train/stop49/models
student=runs/sub800-hf; [ -d $student ] || student=$models/sub800-hf
teacher=${TEACHER:-runs/sub2800-hf}; [ -d $teacher ] || teacher=$models/sub2800-hf
args="--model $student"
for m in ${RUNS:-vanilla-3e4-from800 exact-3e4-from800 exact-1e4-from800}; do
  [ -f runs/opd48/$m-hf/model.safetensors ] && args="$args --model runs/opd48/$m-hf"
done
$py -m experiments.demo_fit $args --teacher $teacher --kl-temperature 1.0 --split valid_unseen \
  --num-tasks 12 --demonstrations searching-expert --thinking task-tool-act-here --action-format said \
  --max-prompt-tokens 1024 --out ${OUT:-results/train/stop51}/heldout_kl.json
