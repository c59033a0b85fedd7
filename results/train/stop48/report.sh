#!/bin/bash
# stop 48: copy the sub-vocabulary run's evaluations into results/train/stop48 and compare them paired with the
# full-vocabulary one-sft run's at the same steps (stop 42: step 800, stop 43: step 1,600)
set -e
cd "$(dirname "$0")/../../.."
py=${PYTHON:-.venv/bin/python}
d=results/train/stop48
evals=""
for pair in sub800-48:eval-sub800:step800=results/train/stop42/eval-teacher-one \
            sub1600-48:eval-sub1600:step1600=results/train/stop43/eval-teacher-one1600; do
  IFS=: read -r name to full <<< "$pair"
  from=runs/eval/$name
  [ -f $from/evaluation.json ] || { echo "missing $from"; continue; }
  mkdir -p $d/$to && cp $from/evaluation.json $from/evaluation.md $from/episodes.csv $from/*.png $d/$to/
  evals="$evals --eval full-${full%%=*}=${full#*=} --eval sub-${full%%=*}=$d/$to"
  $py -m experiments.compare_evals --eval full-${full%%=*}=${full#*=} --eval sub-${full%%=*}=$d/$to \
    --out $d/paired-${full%%=*}
done
[ -n "$evals" ] && $py -m experiments.episode_report $evals --thinking task-tool-act-here --out $d/transcripts
mkdir -p $d/recipe
cp runs/teacher_recipe.json $d/recipe/
cp runs/copy_probe/*.md $d/recipe/
cp runs/sft-sub/config.json $d/recipe/sft-sub-config.json
cp runs/sft-sub/train.jsonl $d/recipe/sft-sub-train.jsonl
$py $d/against_full.py runs/sft-sub/train.jsonl --out $d/against_full
