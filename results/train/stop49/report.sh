#!/bin/bash
# stop 49: copy the sub-vocabulary run's step-2,400 and step-2,800 evaluations into results/train/stop49, compare each
# paired with the full-vocabulary one-sft run at the same step (stop 45) and with the sub run's step 1,600 (stop 48),
# and keep the whole run's record (recipe stages, per-step losses, against the full run step for step).
#   bash results/train/stop49/report.sh
set -e
cd "$(dirname "$0")/../../.."
py=${PYTHON:-.venv/bin/python}
d=results/train/stop49
sub1600=results/train/stop48/eval-sub1600
evals="--eval sub-step1600=$sub1600"
for pair in sub2400-48:eval-sub2400:step2400=results/train/stop45/eval-teacher-one2400 \
            sub2800-48:eval-sub2800:step2800=results/train/stop45/eval-teacher-one2800; do
  IFS=: read -r name to full <<< "$pair"
  from=runs/eval/$name
  [ -f $from/evaluation.json ] || { echo "missing $from"; continue; }
  mkdir -p $d/$to && cp $from/evaluation.json $from/evaluation.md $from/episodes.csv $from/*.png $d/$to/
  step=${full%%=*}
  evals="$evals --eval sub-$step=$d/$to"
  $py -m experiments.compare_evals --eval full-$step=${full#*=} --eval sub-$step=$d/$to --out $d/paired-$step
  $py -m experiments.compare_evals --eval sub-step1600=$sub1600 --eval sub-$step=$d/$to --out $d/paired-$step-vs-1600
done
$py -m experiments.episode_report $evals --thinking task-tool-act-here --out $d/transcripts
mkdir -p $d/recipe
cp runs/teacher_recipe.json $d/recipe/
cp runs/sft-sub/config.json $d/recipe/sft-sub-config.json
cp runs/sft-sub/train.jsonl $d/recipe/sft-sub-train.jsonl
$py results/train/stop48/against_full.py runs/sft-sub/train.jsonl --out $d/against_full
