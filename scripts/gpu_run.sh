#!/usr/bin/env bash
# Issue 55's measurements on a lent GPU as one prepared call of under 10 minutes, most
# important first, each step under its own time limit so that a hang costs only its share:
#   1. scripts/gpu_graphs.py: do the talker's decode steps and its code predictor's frames
#      capture as CUDA graphs at Qwen3-Omni's size, with the same codes as uncaptured?
#   2. Qwen3-Omni at its real size, the thinker's and talker's steps graphed, and eager (the
#      eager baseline again in the same call: earlier figures came from another card);
#   3. Qwen3-TTS 12Hz-1.7B-CustomVoice, graphed and eager;
#   4. `bench.step --sizes full`: the host's share of a step for every talker.
# Here, first: scripts/gpu_wheels.sh (the wheels the machine's image lacks, into .whl/).
# Then the device tool: `bash scripts/gpu_run.sh` with carry [".whl"]; what it writes under
# $OUT comes back (each step's JSON and log, rc.txt: each step's exit status, gpu.txt: the
# card). SIZES=tiny DEVICE=cpu runs them all at the demo's sizes on a CPU, the graphed steps at
# fixed shapes uncaptured (a check of this script; tests/unit/test_gpu_scripts.py runs the
# scripts so).
# STEPS names the steps to run (by default the first call's, above). A second call, on the
# same warm machine if the device time left allows (240 s): STEPS="q25_graphs q25_eager"
# (Qwen2.5-Omni-7B graphed and eager, the other pipeline issue 55 asks figures of), and
# qwen3_alone (Qwen3-Omni graphed, each prompt prefilled alone: the baseline of batched
# prefills) with more left.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-run}
SIZES=${SIZES:-full}
DEVICE=${DEVICE:-cuda}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:.:services/stage_worker
else
  export PYTHONPATH=.:services/stage_worker
fi
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1 || true

step() {  # step NAME SECONDS COMMAND...: the command under its limit, its output in NAME.log
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc $((SECONDS - t0)) s" | tee -a "$OUT/rc.txt"
  tail -n 8 "$OUT/$name.log"
}

STEPS=${STEPS:-graphs qwen3_graphs qwen3_eager tts_graphs tts_eager step}
want() { [[ " $STEPS " == *" $1 "* ]]; }

bench() {  # bench NAME SECONDS ARGS...: scripts/gpu_bench.py, no concurrency started past its share
  local name=$1 limit=$2
  shift 2
  want "$name" || return 0
  step "$name" "$limit" "$PY" scripts/gpu_bench.py "$OUT/$name.json" --sizes "$SIZES" --device "$DEVICE" \
    --budget-s $((limit / 2)) "$@"
}

# The first call's: 580 s in all, under the device tool's 600 s a call.
want graphs && step graphs 90 "$PY" scripts/gpu_graphs.py "$OUT/graphs.json" --batches 1 8 16 --frames 20 \
  --sizes "$SIZES" --device "$DEVICE"
bench qwen3_graphs 120 --pipeline qwen3-omni --cuda-graphs
bench qwen3_eager 120 --pipeline qwen3-omni
bench tts_graphs 70 --pipeline qwen3-tts --cuda-graphs --codes 50
bench tts_eager 70 --pipeline qwen3-tts --codes 50
want step && step step 110 "$PY" -m bench.step --sizes "$SIZES" --device "$DEVICE" --quick --json --out "$OUT"
# A second call's (see the top): 240 s, then 120 more. Qwen2.5-Omni's 400 codes a request took
# 45 s each at c8 eager on the H200: 100 codes (2 s of audio) keep c1 and c8 within the budget.
bench q25_graphs 120 --pipeline qwen2.5-omni --cuda-graphs --codes 100 --concurrency 1 8
bench q25_eager 120 --pipeline qwen2.5-omni --codes 100 --concurrency 1 8
bench qwen3_alone 120 --pipeline qwen3-omni --cuda-graphs --concurrency 8 --prefill-batch-tokens 0
