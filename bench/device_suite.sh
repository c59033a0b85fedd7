#!/usr/bin/env bash
# One prepared run of the GPU checks and measurements, for a lent accelerator machine (one H200 or H100). Each part
# has its own time limit (T_<PART> seconds), so a slow part cannot starve the others, and writes its JSON as it goes.
# docs/gpu.md says what each part measures, the goals, how to read the profile, and the two planned device calls.
#
#   OUT=results/bench/h200-run bash bench/device_suite.sh                       # the default parts
#   PARTS="profile sweep" OUT=/tmp/out bash bench/device_suite.sh                # some parts only
#   BUNDLE=call1 PARTS="profile sweep" bash bench/device_suite.sh                # on the device machine ($OUT set)
#
# BUNDLE=NAME (for the device tool, which brings back at most 8 files from $OUT): the parts write into a scratch
# folder, and after every part $OUT holds NAME.tar.gz (everything but the traces), summary.txt (every part's key
# lines) and profile_<label>.tar.gz (the profile's traces and HLO), so a later time-out loses nothing written before.
#
# Parts (PARTS, default "profile sweep candidates"); the machine is always recorded:
#   profile     the decode step of $MODEL bf16 through the engine at batches $BATCHES: timed steps against the
#               memory roofline, a JAX profiler trace of 20 steady steps at $TRACE_BATCHES with its summary
#               (kernels per step, top kernels, gaps, host time), the optimised HLO (bench/profile_decode.py)
#   sweep       the pallas-gpu decode kernel alone over pages per block x stages x warps x k-splits at the decode
#               step's context (bench/decode_attention.py --sweep $SWEEP_ARGS)
#   candidates  the decode step with the executor alone (no engine host loop) at $BATCHES for each of $CANDIDATES:
#               baseline, scan (EngineConfig.scan_layers), scan-cb (scan + XLA command buffers for while loops and
#               conditionals, whole step as one CUDA graph), cb-off (command buffers off), best (the sweep's best
#               kernel point: $SWEEP_JSON, default this run's sweep); then one table of them all
#   mixed       mixed prefill + decode steps against separate steps, $MODEL bf16 (bench/mixed_steps.py)
#   train       a training smoke: experiments.train with the gpu preset where alfworld is installed, else the
#               train-step tests compiled for this device
#   mainjob     the main job's gpu-quick preset, policies $MAINJOB_POLICY, prefix sharing $MAINJOB_SHARING (long:
#               last of the planned parts, so a time-out costs nothing else)
#   throughput  bench/sampler_throughput.py: pallas-gpu at $BATCHES, the reference gather at 256 (the first run's)
#   overhead    the engine's host overhead with a negligible model (bench/engine_overhead.py)
#   tests       the kernel and mixed-step tests compiled for the GPU
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/bench/h200-run}
mkdir -p "$OUT"
if [[ -n "${BUNDLE:-}" ]]; then RUN=$(mktemp -d "/tmp/device_suite_$BUNDLE.XXXX"); else RUN=$OUT; fi
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
MODEL=${MODEL:-qwen3-1.7b}
BATCHES=${BATCHES:-1 64 256}
TRACE_BATCHES=${TRACE_BATCHES:-1 256}
CANDIDATES=${CANDIDATES:-baseline scan scan-cb best}
SWEEP_JSON=${SWEEP_JSON:-$RUN/decode_attention_sweep.json}
SWEEP_ARGS=${SWEEP_ARGS:---batches 256 64 1 --context 256 --repeats 10 --sweep-pages-per-block 2 4 8 --sweep-stages 1 2 --sweep-warps 4 8 --sweep-k-splits 0 1}
MAINJOB_POLICY=${MAINJOB_POLICY:-both}
MAINJOB_SHARING=${MAINJOB_SHARING:-on off}
CB_OFF="--xla_gpu_enable_command_buffer="
CB_MAX="--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL --xla_gpu_graph_min_graph_size=1"
T_PROFILE=${T_PROFILE:-190}
T_SWEEP=${T_SWEEP:-70}
T_CANDIDATE=${T_CANDIDATE:-65}
T_MIXED=${T_MIXED:-120}
T_MAINJOB=${T_MAINJOB:-270}
T_TRAIN=${T_TRAIN:-60}
T_THROUGHPUT=${T_THROUGHPUT:-170}
T_REFERENCE=${T_REFERENCE:-90}
T_OVERHEAD=${T_OVERHEAD:-80}
T_TESTS=${T_TESTS:-80}
PARTS=${PARTS:-profile sweep candidates}
part() { [[ " $PARTS " == *" $1 "* ]]; }
note() { echo "$*" | tee -a "$RUN/summary.txt"; }
bundle() {
  [[ -n "${BUNDLE:-}" ]] || return 0
  tar czf "$OUT/$BUNDLE.tar.gz" -C "$RUN" --exclude='./profile/*.tar.gz' . 2>/dev/null
  cp "$RUN/summary.txt" "$OUT/summary.txt" 2>/dev/null
  for f in "$RUN"/profile/*.tar.gz; do [[ -f "$f" ]] && cp "$f" "$OUT/profile_$(basename "$f")"; done
  return 0
}

{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc;
  python3 -c "import jax; print('jax', jax.__version__, jax.devices())"; echo "XLA_FLAGS=${XLA_FLAGS:-}";
  echo "PARTS=$PARTS"; } > "$RUN/machine.txt" 2>&1
cat "$RUN/machine.txt" | tee -a "$RUN/summary.txt"
bundle

if part profile; then
note "== profile: $MODEL decode step through the engine at batches $BATCHES, traced at $TRACE_BATCHES (limit ${T_PROFILE}s)"
timeout "$T_PROFILE" python3 bench/profile_decode.py --model "$MODEL" --backend pallas-gpu --batches $BATCHES \
  --trace-batches $TRACE_BATCHES --out "$RUN/profile" --label baseline 2>&1 | tee "$RUN/profile.log" \
  | grep -v -i warning | tail -60
cat "$RUN/profile/baseline.txt" >> "$RUN/summary.txt" 2>/dev/null || note "(profile: no summary; see profile.log)"
bundle
fi

if part sweep; then
note "== sweep: the pallas-gpu decode kernel alone: $SWEEP_ARGS (limit ${T_SWEEP}s)"
# largest batch first: a time-out keeps the batches that matter most; every row records its params
timeout "$T_SWEEP" python3 bench/decode_attention.py --backends reference-hnd pallas-gpu --sweep $SWEEP_ARGS \
  --out "$RUN/decode_attention_sweep.json" 2>&1 | tee "$RUN/sweep.log" \
  | grep -v -i warning | tail -80 | tee -a "$RUN/summary.txt" | tail -12
bundle
fi

if part candidates; then
note "== candidates: the decode step with the executor alone at batches $BATCHES: $CANDIDATES (limit ${T_CANDIDATE}s each)"
for candidate in $CANDIDATES; do
  flags=""; extra=()
  case "$candidate" in
    baseline) ;;
    scan) extra=(--scan-layers) ;;
    scan-cb) extra=(--scan-layers); flags=$CB_MAX ;;
    cb-off) flags=$CB_OFF ;;
    cb-max) flags=$CB_MAX ;;
    best) if [[ ! -f "$SWEEP_JSON" ]]; then note "best: no sweep result at $SWEEP_JSON, skipped"; continue; fi
          extra=(--from-sweep "$SWEEP_JSON") ;;
    *) note "unknown candidate $candidate, skipped"; continue ;;
  esac
  xla="${XLA_FLAGS:-}"; [[ -n "$flags" ]] && xla="${xla:+$xla }$flags"     # XLA refuses an XLA_FLAGS of blanks
  env ${xla:+XLA_FLAGS="$xla"} timeout "$T_CANDIDATE" python3 bench/profile_decode.py --driver executor \
    --model "$MODEL" --backend pallas-gpu --batches $BATCHES --no-trace "${extra[@]}" --out "$RUN/candidates" \
    --label "$candidate" 2>&1 | tee "$RUN/candidate_$candidate.log" | grep -E "^== batch|^error|Error" | tail -6
  bundle
done
results=(); for d in "$RUN/profile" "$RUN/candidates"; do [[ -d "$d" ]] && results+=("$d"); done
[[ ${#results[@]} -gt 0 ]] && python3 bench/profile_decode.py --compare "${results[@]}" 2>&1 | tee -a "$RUN/summary.txt"
bundle
fi

if part mixed; then
note "== mixed prefill + decode steps vs separate steps, $MODEL bf16 (limit ${T_MIXED}s)"
timeout "$T_MIXED" python3 -m bench.mixed_steps --model "$MODEL" --backend pallas-gpu --slots 64 --requests 192 \
  --prompt-len 256 --new-tokens 128 --repeats 2 --out "$RUN/mixed_steps_$MODEL.json" 2>&1 \
  | tee "$RUN/mixed_steps.log" | grep -v -i warning | tail -10 | tee -a "$RUN/summary.txt"
bundle
fi

if part train; then
if python3 -c "import alfworld, textworld" 2>/dev/null; then
  note "== training smoke: experiments.train, actfirst, gpu preset, 2 updates (limit ${T_TRAIN}s)"
  timeout "$T_TRAIN" python3 -m experiments.train --method actfirst --preset gpu --updates 2 --train-tasks 8 \
    --eval-tasks 2 --out "$RUN/train_smoke" 2>&1 | tee "$RUN/train_smoke.log" | tail -12 | tee -a "$RUN/summary.txt"
else
  note "== training smoke: no alfworld/textworld on this machine, so the train-step tests compiled for it (limit ${T_TRAIN}s)"
  timeout "$T_TRAIN" python3 -m pytest -q -p no:cacheprovider tests/train/test_train_step.py 2>&1 \
    | tee "$RUN/train_smoke.log" | tail -5 | tee -a "$RUN/summary.txt"
fi
bundle
fi

if part mainjob; then
for sharing in $MAINJOB_SHARING; do
  note "== main job, gpu-quick preset: policy $MAINJOB_POLICY, prefix sharing $sharing (limit ${T_MAINJOB}s)"
  # progress bars on: a run cut by its limit still shows the scan point it reached
  timeout "$T_MAINJOB" python3 -m experiments.actfirst_alfworld --preset gpu-quick --policy "$MAINJOB_POLICY" \
    --prefix-sharing "$sharing" --out "$RUN/actfirst_alfworld_gpu_quick_sharing_$sharing" 2>&1 \
    | tee "$RUN/actfirst_alfworld_sharing_$sharing.log" | tail -25 | tee -a "$RUN/summary.txt" | tail -8
  bundle
done
fi

if part throughput; then
note "== $MODEL bf16 decode vs roofline (bench/sampler_throughput.py)"
# prompt 190 + 64 new tokens stay within 16 pages: one decode shape per batch size, so few compilations
for spec in "pallas-gpu:$BATCHES:$T_THROUGHPUT" "reference:256:$T_REFERENCE"; do
  IFS=: read -r backend batches limit <<<"$spec"
  timeout "$limit" python3 bench/sampler_throughput.py --model "$MODEL" --random-init --dtype bfloat16 \
    --batches $batches --prompt-len 190 --new-tokens 64 --repeats 2 --no-warmup --backend "$backend" \
    --out "$RUN/sampler_throughput_${MODEL}_$backend.json" 2>&1 | tee "$RUN/sampler_throughput_$backend.log" \
    | grep -v -i warning | tail -8 | tee -a "$RUN/summary.txt"
done
bundle
fi

if part overhead; then
note "== engine host overhead, negligible model"
timeout "$T_OVERHEAD" python3 bench/engine_overhead.py --label device \
  --out "$RUN/engine_overhead.json" 2>&1 | tee "$RUN/engine_overhead.log" | tail -12 | tee -a "$RUN/summary.txt"
bundle
fi

if part tests; then
note "== kernel and mixed-step tests on the GPU"
timeout "$T_TESTS" python3 -m pytest -q -p no:cacheprovider tests/kernels/test_kernels_pallas.py tests/kernels/test_kernels.py \
  tests/sampler/test_mixed_steps.py tests/sampler/test_scan_layers.py 2>&1 | tee "$RUN/test_kernels.log" | tail -5 \
  | tee -a "$RUN/summary.txt"
bundle
fi
ls -la "$RUN" "$OUT"
