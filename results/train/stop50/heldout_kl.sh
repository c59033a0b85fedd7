#!/bin/bash
# stop 50: each student's exact reverse KL to the teacher (results/train/stop49/models/sub2800-hf) on held-out
# states: the searching expert's turns of 12 generated valid_unseen games (no training game among them), teacher-
# forced, with the fit to those turns (experiments.demo_fit). The students: steps 800 and 1,600 of the sub-vocabulary
# run and what 40 updates of OPD made of each (stop 49 from step 1,600, stop 50 from step 800).
#   bash results/train/stop50/heldout_kl.sh [KL_TEMPERATURE]     -> results/train/stop50/heldout_kl[-T].json/.md
set -e
cd "$(dirname "$0")/../../.."
py=${PYTHON:-.venv/bin/python}
t=${1:-1.0}; suffix=""; [ "$t" != 1.0 ] && suffix="-t$t"
models=""
for m in runs/sub800-hf runs/opd48/vanilla-from800-hf runs/opd48/actfirst-from800-hf runs/opd48/vanilla-t04-from800-hf \
         runs/sub1600-hf runs/opd48/vanilla-3e5-hf runs/opd48/actfirst-3e5-hf; do
  [ -f $m/model.safetensors ] && models="$models --model $m"
done
$py -m experiments.demo_fit $models --teacher ${TEACHER:-runs/sub2800-hf} --kl-temperature $t --split valid_unseen \
  --num-tasks 12 --demonstrations searching-expert --thinking task-tool-act-here --action-format said \
  --max-prompt-tokens 1024 --out results/train/stop50/heldout_kl$suffix.json
