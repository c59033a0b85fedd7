#!/bin/bash
# stop 52: how much of the exact reverse KL the opd-exact loss's top-K form (--exact-top-k K: the teacher's K most
# probable ids and the mass of the rest) keeps, and how closely its gradient (w.r.t. the student's logits) points
# where the exact one's does, on the held-out states of stops 50-51's screen: the searching expert's 121
# teacher-forced turns of 10 generated valid_unseen games, both models at temperature 1. Students: the step-800
# (2.8 %) and step-1,600 (25.0 %) models of the sub-vocabulary recipe; teacher: its step 2,800 (31.9 %); 592 ids.
#   bash results/train/stop52/top_k.sh          -> results/train/stop52/top_k.json/.md
set -e
cd "$(dirname "$0")/../../.."
py=${PYTHON:-.venv/bin/python}
models=results/train/stop49/models
pick() { [ -d runs/$1 ] && echo runs/$1 || echo $models/$1; }
$py -m experiments.demo_fit --model $(pick sub800-hf) --model $(pick sub1600-hf) --teacher $(pick sub2800-hf) \
  --kl-temperature 1.0 --top-k 4 8 16 32 64 128 --split valid_unseen --num-tasks 12 \
  --demonstrations searching-expert --thinking task-tool-act-here --action-format said --max-prompt-tokens 1024 \
  --out results/train/stop52/top_k.json
