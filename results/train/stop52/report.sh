#!/bin/bash
# stop 52: the runs from the 2.8 % step-800 student through stop 50's report (paired tables against the student and
# the teacher, transcripts, the runs' metrics, ActFirst's action sources), into results/train/stop52/; then
# ActFirst-OPD with the exact loss against vanilla OPD with it (stop 51's exact-1e4 run, the same rate) and the held-out
# screen of the three runs.
#   bash results/train/stop52/report.sh
set -e
cd "$(dirname "$0")/../../.."
py=${PYTHON:-.venv/bin/python}
d=results/train/stop52
OUT=$d SPECS="sti-from800:sti:40 actionopd-from800:actionopd:40 actfirst-exact-1e4-from800:actfirst-exact-1e4:40" \
  bash results/train/stop50/report.sh
if [ -d $d/eval-actfirst-exact-1e4 ]; then
  $py -m experiments.compare_evals --eval vanilla-exact-1e4=results/train/stop51/eval-exact-1e4 \
    --eval actfirst-exact-1e4=$d/eval-actfirst-exact-1e4 --out $d/paired-actfirst-vs-vanilla
fi
