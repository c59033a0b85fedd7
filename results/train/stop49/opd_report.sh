#!/bin/bash
# stop 49: copy the distilled students' evaluations into results/train/stop49/opd and compare them paired with the
# student (sub-vocabulary step 1,600, stop 48) and the teacher (step 2,800), then the runs' metrics and curves.
# The runs: bash results/train/stop48/opd.sh {actfirst,vanilla-opd} 3e-5 40 {actfirst-3e5,vanilla-3e5}
#   bash results/train/stop49/opd_report.sh
set -e
cd "$(dirname "$0")/../../.."
py=${PYTHON:-.venv/bin/python}
d=results/train/stop49
student=results/train/stop48/eval-sub1600
teacher=$d/eval-sub2800
mkdir -p $d/opd
for src in opd48-actfirst-3e5:opd/eval-actfirst opd48-vanilla-3e5:opd/eval-vanilla-opd; do
  from=runs/eval/${src%%:*}; to=$d/${src#*:}
  [ -f $from/evaluation.json ] || { echo "missing $from"; continue; }
  mkdir -p $to && cp $from/evaluation.json $from/evaluation.md $from/episodes.csv $from/*.png $to/
done
evals="--eval student1600=$student"
[ -d $d/opd/eval-actfirst ] && evals="$evals --eval actfirst40=$d/opd/eval-actfirst"
[ -d $d/opd/eval-vanilla-opd ] && evals="$evals --eval vanilla40=$d/opd/eval-vanilla-opd"
evals="$evals --eval teacher2800=$teacher"
$py -m experiments.compare_evals $evals --baseline student1600 --out $d/opd/paired
$py -m experiments.episode_report $evals --thinking task-tool-act-here --out $d/opd/transcripts
runs=""; ev=""
for m in actfirst-3e5:actfirst vanilla-3e5:vanilla-opd; do
  run=runs/opd48/${m%%:*}; [ -f $run/summary.json ] || continue
  runs="$runs $run"; name=${m%%:*}
  ev="$ev --evaluation $name 0 $student"
  [ -d $d/opd/eval-${m#*:} ] && ev="$ev --evaluation $name 40 $d/opd/eval-${m#*:}"
done
$py -m experiments.train_report $runs $ev --out $d/opd/runs
if [ -d $d/opd/eval-actfirst ] && [ -d $d/opd/eval-vanilla-opd ]; then
  $py -m experiments.compare_evals --eval vanilla40=$d/opd/eval-vanilla-opd --eval actfirst40=$d/opd/eval-actfirst \
    --out $d/opd/paired-actfirst-vs-vanilla
fi
$py results/train/stop46/actfirst_sources.py runs/opd48/actfirst-3e5/train.jsonl > $d/opd/actfirst_sources.txt || true
