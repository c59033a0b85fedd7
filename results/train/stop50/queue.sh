#!/bin/bash
# stop 50: distil the 2.8 % sub-vocabulary student (step 800 of `teacher_recipe --recipe one-sft-sub`,
# results/train/stop49/models/sub800-hf) from its 31.9 % teacher (step 2,800, results/train/stop49/models/sub2800-hf)
# through results/train/stop48/opd.sh (its settings: lr 3e-5, 96 + 32 tokens, 30 turns), then play each result on the
# 48 unseen games x seeds 42/43/44 (results/train/stop48/evaluate.sh). Trainings run one after the other; each one's
# evaluation runs beside the next training, one evaluation at a time.
#   bash results/train/stop50/queue.sh NAME METHOD UPDATES "EXTRA FLAGS" [NAME METHOD UPDATES "EXTRA FLAGS" ...]
#     -> runs/opd48/NAME, runs/opd48/NAME-hf, runs/eval/opd48-NAME; logs runs/opd50-NAME.log, runs/opd50-eval-NAME.log
# UPDATES 0: the export runs/opd48/NAME-hf exists or is being made by process TRAIN_WAIT_PID; only evaluate it.
# The first training starts when process TRAIN_WAIT_PID has ended, the first evaluation when WAIT_PID has.
# The stop's runs (vanilla OPD itself ran through STUDENT=runs/sub800-hf bash results/train/stop48/opd.sh
# vanilla-opd 3e-5 40 vanilla-from800, which evaluates after training; the ActFirst training was started by an
# earlier form of this script, the same training command):
#   TRAIN_WAIT_PID=<actfirst training> WAIT_PID=<vanilla's opd.sh> bash results/train/stop50/queue.sh \
#     actfirst-from800 actfirst 0 "" vanilla-t04-from800 vanilla-opd 40 "--temperature 0.4" sti-from800 sti 20 ""
# STI-OPD was stopped 4 s into its start-up, before its first update, so that the evaluations had the cores by the
# session's end; it was not run this stop. The runs wrote this script's training command out in full, the same flags
# as opd.sh's (each run's exact command is in its summary.json); it now calls opd.sh with EVALUATE=0.
# The loop is stop52/queue.sh's (which takes a rate per run); this script gives each run stop 50's 3e-5.
cd "$(dirname "$0")/../../.."
runs=()
while [ $# -ge 4 ]; do runs+=("$1" "$2" 3e-5 "$3" "$4"); shift 4; done
LOG=opd50 exec bash results/train/stop52/queue.sh "${runs[@]}"
