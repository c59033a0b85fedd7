#!/bin/bash
# stop 52: distil the 2.8 % sub-vocabulary student (step 800 of `teacher_recipe --recipe one-sft-sub`,
# results/train/stop49/models/sub800-hf) from its 31.9 % teacher (step 2,800, results/train/stop49/models/sub2800-hf)
# through results/train/stop48/opd.sh (its settings: 96 + 32 tokens, 30 turns, rollouts at 1.0), then play each result
# on the 48 unseen games x seeds 42/43/44 (results/train/stop48/evaluate.sh). stop50/queue.sh with a rate per run:
# trainings run one after the other; each one's evaluation runs beside the next training, one evaluation at a time.
#   bash results/train/stop52/queue.sh NAME METHOD LR UPDATES "EXTRA FLAGS" [NAME METHOD LR UPDATES "EXTRA" ...]
#     -> runs/opd48/NAME, runs/opd48/NAME-hf, runs/eval/opd48-NAME; logs runs/opd52-NAME.log, runs/opd52-eval-NAME.log
# UPDATES 0: the export runs/opd48/NAME-hf exists or is being made by process TRAIN_WAIT_PID; only evaluate it.
# The first training starts when process TRAIN_WAIT_PID has ended, the first evaluation when WAIT_PID has.
# LOG (default opd52) names the logs; stop50/queue.sh calls this script with LOG=opd50 and its rate.
# The stop's runs (STI-OPD itself trained first through
# STUDENT=runs/sub800-hf EVALUATE=0 bash results/train/stop48/opd.sh sti 3e-5 40 sti-from800):
#   TRAIN_WAIT_PID=<sti's opd.sh> bash results/train/stop52/queue.sh sti-from800 sti 3e-5 0 "" \
#     actionopd-from800 actionopd 3e-5 40 "" actfirst-exact-1e4-from800 actfirst 1e-4 40 "--loss opd-exact"
# The last evaluation was started by hand beside ActionOPD's instead of after it (the same evaluate.sh command), to
# end within the session; its queued turn was stopped before it began.
cd "$(dirname "$0")/../../.."
models=results/train/stop49/models   # the same folders, committed; used where runs/ has none
student=${STUDENT:-runs/sub800-hf}; [ -n "$STUDENT" ] || [ -d $student ] || student=$models/sub800-hf
teacher=${TEACHER:-runs/sub2800-hf}; [ -n "$TEACHER" ] || [ -d $teacher ] || teacher=$models/sub2800-hf
wait_for() {  # until process $1 has ended
  [ -n "$1" ] && while kill -0 $1 2>/dev/null; do sleep 20; done
}
wait_for "$TRAIN_WAIT_PID"
prev=$WAIT_PID
log=${LOG:-opd52}
while [ $# -ge 5 ]; do
  name=$1; m=$2; lr=$3; updates=$4; extra=$5; shift 5
  if [ "$updates" != 0 ]; then
    echo "train $name: $(date)"
    STUDENT=$student TEACHER=$teacher EVALUATE=0 bash results/train/stop48/opd.sh $m $lr $updates $name $extra \
      > runs/$log-$name.log 2>&1
    echo "trained $name ($?): $(date)"
  fi
  ( wait_for $prev; echo "evaluate $name: $(date)"; bash results/train/stop48/evaluate.sh runs/opd48/$name-hf \
      opd48-$name > runs/$log-eval-$name.log 2>&1; echo "evaluated $name ($?): $(date)" ) &
  prev=$!
done
wait
