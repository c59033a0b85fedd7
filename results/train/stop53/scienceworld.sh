#!/usr/bin/env bash
# Issue 11's ScienceWorld path end to end, from a clean checkout: every distillation method trains a few updates on
# ScienceWorld tasks (random-weight tiny student and teacher: no ScienceWorld teacher is made here), exports its
# student, and `experiments.evaluate` plays the ActFirst-OPD export on the `eval` split over seeds 42/43/44.
# A plumbing check, not a learning result; ActionOPD is expected to stop with its no-signal error. Usage: bash results/train/stop53/scienceworld.sh [RUNS] [OUT]
set -euo pipefail
RUNS=${1:-runs/sw53}
OUT=${2:-results/train/stop53/scienceworld}
PY=${PY:-.venv/bin/python}
mkdir -p "$RUNS" "$OUT"
for method in vanilla-opd actfirst sti actionopd; do
  start=$(date +%s)
  # ActionOPD trains only on states where the teacher's sample is a valid action and the student's candidates'
  # agreement rewards differ: random-weight models give none, and the run stops with that error (recorded here).
  rc=0
  $PY -m experiments.train --method "$method" --preset cpu --benchmark scienceworld --updates 2 --batch-size 4 \
    --collection-tasks 2 --max-turns 4 --checkpoint-every 1 --no-eval --no-progress \
    --out "$RUNS/$method" --export "$RUNS/$method-hf" > "$RUNS/$method.log" 2>&1 || rc=$?
  echo "$method: $(( $(date +%s) - start )) s, exit $rc" | tee -a "$OUT/times.txt"
  if [ "$rc" != 0 ]; then tail -n 1 "$RUNS/$method.log" | tee -a "$OUT/times.txt"; continue; fi
  cp "$RUNS/$method/train.jsonl" "$OUT/train-$method.jsonl"
  cp "$RUNS/$method/config.json" "$OUT/config-$method.json"
done
$PY -m experiments.evaluate --student "$RUNS/actfirst-hf" --benchmark scienceworld --split eval --num-tasks 4 \
  --seeds 42 43 44 --max-turns 6 --think-tokens 16 32 --slots 4 --no-progress --out "$RUNS/eval-actfirst"
cp "$RUNS"/eval-actfirst/*.{json,md,png,csv} "$OUT/" 2>/dev/null || true
ls "$OUT"
