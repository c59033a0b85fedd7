#!/bin/bash
# stop 52: the held-out screen of this stop's distillation runs (stop 50's measure, two minutes a model): each
# student's exact reverse KL to the teacher (results/train/stop49/models/sub2800-hf) on the searching expert's 121
# teacher-forced turns of 10 generated valid_unseen games (no training game among them). The students: the step-800
# student and what 40 updates of STI-OPD, ActionOPD and ActFirst-OPD with the exact loss made of it.
#   bash results/train/stop52/heldout_kl.sh          -> results/train/stop52/heldout_kl.json/.md
cd "$(dirname "$0")/../../.."
RUNS="sti-from800 actionopd-from800 actfirst-exact-1e4-from800" OUT=results/train/stop52 \
  bash results/train/stop51/heldout_kl.sh
