#!/usr/bin/env bash
# One prepared run of every GPU check and measurement, for a lent accelerator machine (one H200 here).
# Writes logs and JSON into $OUT (default results/bench/h200-run); each part has its own time limit so a slow
# part cannot starve the others, and partial JSON is written as it goes.
#
#   OUT=results/bench/h200 bash bench/device_suite.sh
#   PARTS="mixed mainjob" OUT=results/bench/h200 bash bench/device_suite.sh     # some parts only
#
# Parts (PARTS, default "throughput overhead tests mixed"): the machine, always; "throughput": Qwen3-1.7B bf16
# decode against the memory roofline with the device-idle share (issues 12 and 16): pallas-gpu attention at
# batch 256, 64 and 1, the reference gather at 256; "overhead": the engine's host overhead with a negligible
# model (issue 16); "tests": the kernel and mixed-step tests compiled for the GPU (issue 12); "mixed": mixed
# prefill + decode steps against separate steps on Qwen3-1.7B bf16 (issue 12, item 5); "mainjob": the main
# job's gpu-quick preset with fifo and fast-first, prefix sharing on and off (issue 12, item 6; long: run it
# as its own call).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/bench/h200-run}
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
T_THROUGHPUT=${T_THROUGHPUT:-170}
T_OVERHEAD=${T_OVERHEAD:-80}
T_TESTS=${T_TESTS:-80}
T_REFERENCE=${T_REFERENCE:-90}
MODEL=${MODEL:-qwen3-1.7b}
BATCHES=${BATCHES:-256 64 1}
T_MIXED=${T_MIXED:-120}
T_MAINJOB=${T_MAINJOB:-270}
PARTS=${PARTS:-throughput overhead tests mixed}
part() { [[ " $PARTS " == *" $1 "* ]]; }

{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc;
  python3 -c "import jax; print('jax', jax.__version__, jax.devices())"; } > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

if part throughput; then
echo "== $MODEL bf16 decode vs roofline"
# prompt 190 + 64 new tokens stay within 16 pages: one decode shape per batch size, so few compilations
for spec in "pallas-gpu:$BATCHES:$T_THROUGHPUT" "reference:256:$T_REFERENCE"; do
  IFS=: read -r backend batches limit <<<"$spec"
  timeout "$limit" python3 bench/sampler_throughput.py --model "$MODEL" --random-init --dtype bfloat16 \
    --batches $batches --prompt-len 190 --new-tokens 64 --repeats 2 --no-warmup --backend "$backend" \
    --out "$OUT/sampler_throughput_${MODEL}_$backend.json" 2>&1 | tee "$OUT/sampler_throughput_$backend.log" \
    | grep -v -i warning | tail -8
done
fi

if part overhead; then
echo "== engine host overhead, negligible model"
timeout "$T_OVERHEAD" python3 bench/engine_overhead.py --label after-h200 \
  --out "$OUT/engine_overhead.json" 2>&1 | tee "$OUT/engine_overhead.log" | tail -12
fi

if part tests; then
echo "== kernel and mixed-step tests on the GPU"
timeout "$T_TESTS" python3 -m pytest -q -p no:cacheprovider tests/test_kernels_pallas.py tests/test_kernels.py \
  tests/test_mixed_steps.py 2>&1 | tee "$OUT/test_kernels.log" | tail -5
fi

if part mixed; then
echo "== mixed prefill + decode steps vs separate steps, $MODEL bf16"
timeout "$T_MIXED" python3 -m bench.mixed_steps --model "$MODEL" --backend pallas-gpu --slots 64 --requests 192 \
  --prompt-len 256 --new-tokens 128 --repeats 2 --out "$OUT/mixed_steps_$MODEL.json" 2>&1 \
  | tee "$OUT/mixed_steps.log" | grep -v -i warning | tail -10
fi

if part mainjob; then
echo "== main job, gpu-quick preset: fifo and fast-first, prefix sharing on and off"
for sharing in on off; do
  timeout "$T_MAINJOB" python3 -m experiments.actfirst_alfworld --preset gpu-quick --policy both \
    --prefix-sharing "$sharing" --no-progress --out "$OUT/actfirst_alfworld_gpu_quick_sharing_$sharing" 2>&1 \
    | tee "$OUT/actfirst_alfworld_sharing_$sharing.log" | tail -6
done
fi
ls -la "$OUT"
