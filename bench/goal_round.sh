#!/usr/bin/env bash
# Issue 14's goal table in one device call (bench/RESULTS.md): graph_bench's FULL graph step of the
# three shapes at batch 1 and 64, then serving (bench/serve.py, over HTTP and in process) SmolLM2
# at 64 and 1 sequences and the Llama-3-8B shape at 64 and 1. Random weights, bfloat16.
# Usage (after `source bench/device_env.sh`): bash bench/goal_round.sh
#   GOAL_TESTS (pytest paths run with -m gpu first; default none), GOAL_MODELS (graph_bench, default
#   smollm2-135m,llama-3.2-1b,llama-3-8b), GOAL_BATCHES (default 1,64), GOAL_PROFILE (N: also
#   profile each step, its N slowest kernels and 2N kernels of its middle in launch order; default
#   none), GOAL_SERVE (presets served, default "smollm2-135m llama-3-8b"; empty: none),
#   GOAL_CONCURRENCY (default 64).
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [ -n "${GOAL_TESTS:-}" ]; then
  timeout 300 python3 -m pytest $GOAL_TESTS -m gpu -p no:cacheprovider --confcutdir=tests/runtime -q 2>&1 | tail -4
fi
profile=()
[ -n "${GOAL_PROFILE:-}" ] && profile=(--profile-top "$GOAL_PROFILE" --profile-sequence $((2 * GOAL_PROFILE)))
if [ -n "${GOAL_MODELS-x}" ]; then
  timeout 300 python3 bench/graph_bench.py --models "${GOAL_MODELS:-smollm2-135m,llama-3.2-1b,llama-3-8b}" \
    --batch-sizes "${GOAL_BATCHES:-1,64}" "${profile[@]}" --json-out "$OUT/goal_graph.json" 2>&1 \
    | grep -E '^## |^\| [0-9]|^  profile|^    '
fi
for model in ${GOAL_SERVE-smollm2-135m llama-3-8b}; do
  timeout 280 python3 bench/serve.py --spawn --throughput --model "preset:$model" --concurrency "${GOAL_CONCURRENCY:-64}" \
    --prompt-tokens 32 --new-tokens 256 --in-process --max-num-seqs 64 --no-peer > "$OUT/goal_serve_$model.txt" 2>&1
  echo "== serve $model rc=$?"; grep -E 'output tok/s' "$OUT/goal_serve_$model.txt"
done
