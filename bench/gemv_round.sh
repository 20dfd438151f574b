#!/usr/bin/env bash
# The skinny GEMM's device policy (skinny_gemm.WIDE_HIDDEN_DEVICES) and its K tiles in flight
# (GRAPHSERVING_GEMV_AHEAD) A/B on whatever GPU came, in one device call: the GPU tests of the skinny
# GEMM and the model paths, then the batch-1 replays of the hidden-4096 shapes and Llama-3.2-1B
# (bench/fold_round.sh) on these sides, alternately:
#   narrow  GRAPHSERVING_GEMV_MAX_HIDDEN=2048 (every projection of a hidden-4096 model on cuBLAS, the
#           policy of earlier sessions everywhere), new (this tree's policy for this GPU),
#   wide    GRAPHSERVING_GEMV_MAX_HIDDEN=4096 (QKV on the skinny GEMM too), and both with
#           GRAPHSERVING_GEMV_AHEAD=2 (two weight tiles in flight).
# On an H200 the goal tables run first (bench/h200_round.sh without its tile grid).
# Usage (after `source bench/device_env.sh`): bash bench/gemv_round.sh
set -u
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "GPU: $gpu"
case "$gpu" in *H200*) H200_SKIP_GRID=1 bash bench/h200_round.sh ;; esac
A=GRAPHSERVING_GEMV_AHEAD=2
N=narrow=GRAPHSERVING_GEMV_MAX_HIDDEN=2048
W=GRAPHSERVING_GEMV_MAX_HIDDEN=4096
FOLD_TESTS="tests/runtime/model/test_kernels.py" FOLD_SELECT="skinny or gemv or fused_model or qwen3" FOLD_MOE=0 \
  FOLD_BATCHES=1 FOLD_MODELS=llama-3-8b,qwen3-8b,llama-3.2-1b \
  FOLD_SIDES="$N new newa2=$A wide=$W widea2=$W,$A $N new" bash bench/fold_round.sh
