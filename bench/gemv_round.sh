#!/usr/bin/env bash
# The skinny GEMM's device policy (skinny_gemm.WIDE_HIDDEN_DEVICES) and its weight tiles in flight
# (GRAPHSERVING_GEMV_AHEAD), A/B on whatever GPU came, in one device call: the batch-1 replays of the
# hidden-4096 shapes and Llama-3.2-1B (bench/fold_round.sh) on these sides, alternately:
#   narrow  GRAPHSERVING_GEMV_MAX_HIDDEN=2048: every projection of a hidden-4096 model on cuBLAS (the
#           policy of devices not listed);
#   new     this tree's policy for this GPU;
#   listed  GRAPHSERVING_GEMV_WIDE_HIDDEN=4096: the listed devices' policy (O, gate/up, down and LM head
#           on the skinny GEMM, QKV on cuBLAS) whatever this GPU is; listeda2 the same with two weight
#           tiles in flight (GRAPHSERVING_GEMV_AHEAD=2);
#   wide    GRAPHSERVING_GEMV_MAX_HIDDEN=4096: QKV on the skinny GEMM too.
# Then, on an H100, the GPU tests of the skinny GEMM and the model paths. On an H200 the goal tables
# come first (bench/h200_round.sh without its tile grid), then new and listed (and listeda2) on the
# hidden-4096 shapes only, so the call stays under 600 s.
# Usage (after `source bench/device_env.sh`): bash bench/gemv_round.sh
set -u
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "GPU: $gpu"
N=narrow=GRAPHSERVING_GEMV_MAX_HIDDEN=2048
L=GRAPHSERVING_GEMV_WIDE_HIDDEN=4096
W=wide=GRAPHSERVING_GEMV_MAX_HIDDEN=4096
case "$gpu" in
  *H200*)
    H200_SKIP_GRID=1 bash bench/h200_round.sh
    FOLD_TESTS="" FOLD_MOE=0 FOLD_BATCHES=1 FOLD_MODELS=llama-3-8b,qwen3-8b \
      FOLD_SIDES="new listed=$L listeda2=$L,GRAPHSERVING_GEMV_AHEAD=2 new listed=$L" bash bench/fold_round.sh ;;
  *)
    FOLD_TESTS="" FOLD_MOE=0 FOLD_BATCHES=1 FOLD_MODELS=llama-3-8b,qwen3-8b,llama-3.2-1b \
      FOLD_SIDES="$N new listed=$L listeda2=$L,GRAPHSERVING_GEMV_AHEAD=2 $W $N listed=$L" bash bench/fold_round.sh
    timeout 300 python3 -m pytest tests/runtime/model/test_kernels.py -m gpu -p no:cacheprovider \
      --confcutdir=tests/runtime -q -k "skinny or gemv or fused_model or qwen3 or wide or policy" 2>&1 | tail -3 ;;
esac
