#!/bin/bash
# stop 50: copy the evaluations of the students distilled from the 2.8 % step-800 student (stop48/opd.sh for vanilla,
# stop50/queue.sh for the others) into results/train/stop50/, compare them paired with the student
# (results/train/stop48/eval-sub800) and the teacher (results/train/stop49/eval-sub2800), then the runs' metrics and
# ActFirst's action sources.
#   bash results/train/stop50/report.sh
# Later stops' runs from the same pair: OUT=results/train/stopNN SPECS="RUN:LABEL:UPDATES ..." bash .../report.sh
set -e
cd "$(dirname "$0")/../../.."
py=${PYTHON:-.venv/bin/python}
d=${OUT:-results/train/stop50}
student=results/train/stop48/eval-sub800
teacher=results/train/stop49/eval-sub2800
# RUN:LABEL:UPDATES, RUN under runs/opd48, its evaluation copied to $d/eval-LABEL
specs=${SPECS:-"vanilla-from800:vanilla-opd:40 actfirst-from800:actfirst:40 vanilla-t04-from800:vanilla-t04:40"}
evals="--eval student800=$student"; runs=""; ev=""
for spec in $specs; do
  name=${spec%%:*}; rest=${spec#*:}; m=${rest%%:*}; updates=${rest#*:}
  from=runs/eval/opd48-$name; to=$d/eval-$m
  if [ -f $from/evaluation.json ]; then
    mkdir -p $to && cp $from/evaluation.json $from/evaluation.md $from/episodes.csv $from/*.png $to/
  fi
  [ -d $to ] && evals="$evals --eval $m-$updates=$to"
  run=runs/opd48/$name; [ -f $run/summary.json ] || continue
  runs="$runs $run"; ev="$ev --evaluation $name 0 $student"
  [ -d $to ] && ev="$ev --evaluation $name $updates $to"
done
evals="$evals --eval teacher2800=$teacher"
$py -m experiments.compare_evals $evals --baseline student800 --out $d/paired
$py -m experiments.episode_report $evals --thinking task-tool-act-here --out $d/transcripts
[ -n "$runs" ] && $py -m experiments.train_report $runs $ev --out $d/runs
if [ -d $d/eval-actfirst ] && [ -d $d/eval-vanilla-opd ]; then
  $py -m experiments.compare_evals --eval vanilla40=$d/eval-vanilla-opd --eval actfirst40=$d/eval-actfirst \
    --out $d/paired-actfirst-vs-vanilla
fi
for spec in $specs; do    # ActFirst's action sources, for the ActFirst runs among them
  name=${spec%%:*}; rest=${spec#*:}
  label=${rest%%:*}
  case $label in actfirst*) [ -f runs/opd48/$name/train.jsonl ] || continue
    # one file per stop when its label is actfirst (stops 50-51), else one per run
    file=$d/actfirst_sources.txt; [ $label = actfirst ] || file=$d/actfirst_sources-$label.txt
    $py results/train/stop46/actfirst_sources.py runs/opd48/$name/train.jsonl > $file ;;
  esac
done
