#!/bin/bash
# stop 51: the runs from the 2.8 % step-800 student through stop 50's report (paired tables against the student and
# the teacher, transcripts, the runs' metrics), into results/train/stop51/.
#   bash results/train/stop51/report.sh
cd "$(dirname "$0")/../../.."
OUT=results/train/stop51 \
SPECS="vanilla-3e4-from800:vanilla-3e4:40 exact-3e4-from800:exact-3e4:40 exact-1e4-from800:exact-1e4:40" \
  bash results/train/stop50/report.sh
