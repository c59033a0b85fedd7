#!/bin/bash
# stop 47: copy the evaluations into results/train/stop47 and compare them (the commands of the write-up)
set -e
cd "$(dirname "$0")/../../.."
py=${PYTHON:-.venv/bin/python}
d=results/train/stop47
mkdir -p $d/opd
for src in student-fast-48:eval-student-fast opd47-actfirst-3e5:opd/eval-actfirst opd47-vanilla-3e5:opd/eval-vanilla-opd; do
  from=runs/eval/${src%%:*}; to=$d/${src#*:}
  [ -f $from/evaluation.json ] || { echo "missing $from"; continue; }
  mkdir -p $to && cp $from/evaluation.json $from/evaluation.md $from/episodes.csv $from/*.png $to/
done
evals="--eval student1600=results/train/stop43/eval-teacher-one1600 --eval student-fast=$d/eval-student-fast"
[ -d $d/opd/eval-actfirst ] && evals="$evals --eval actfirst40=$d/opd/eval-actfirst"
[ -d $d/opd/eval-vanilla-opd ] && evals="$evals --eval vanilla40=$d/opd/eval-vanilla-opd"
evals="$evals --eval teacher2800=results/train/stop45/eval-teacher-one2800"
$py -m experiments.compare_evals $evals --baseline student-fast --out $d/opd/paired
$py -m experiments.episode_report $evals --thinking task-tool-act-here --out $d/opd/transcripts
runs=""; ev=""
for m in actfirst-3e5:actfirst vanilla-3e5:vanilla-opd; do
  run=runs/opd47/${m%%:*}; [ -f $run/summary.json ] || continue
  runs="$runs $run"; name=${m%%:*}
  ev="$ev --evaluation $name 0 $d/eval-student-fast"
  [ -d $d/opd/eval-${m#*:} ] && ev="$ev --evaluation $name 40 $d/opd/eval-${m#*:}"
done
$py -m experiments.train_report $runs $ev --out $d/opd/runs
if [ -d $d/opd/eval-actfirst ] && [ -d $d/opd/eval-vanilla-opd ]; then
  $py -m experiments.compare_evals --eval vanilla40=$d/opd/eval-vanilla-opd --eval actfirst40=$d/opd/eval-actfirst \
    --out $d/opd/paired-actfirst-vs-vanilla
fi
