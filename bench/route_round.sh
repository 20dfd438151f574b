#!/usr/bin/env bash
# The MoE routing inside the router's kernel (GRAPHSERVING_MOE_ROUTE_IN_ROUTER=1, side "route") A/B
# on whatever GPU came, in one device call (under 600 s):
#   H200: with ROUTE_GOALS=1 issue 14 and 16's goal tables first (bench/goal_round.sh, no serving);
#         then Qwen3-30B-A3B at batch 1 on this tree, a staged variant wheel (VARIANT_WHEEL, side
#         "variant", if given) and side "route", alternately, then the MoE GPU tests;
#   else: the MoE GPU tests first, then this tree and side "route" alternately.
# Usage (after `source bench/device_env.sh`): [VARIANT_WHEEL=path] bash bench/route_round.sh
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "GPU: $gpu"
R=route=GRAPHSERVING_MOE_ROUTE_IN_ROUTER=1
tests() {
  timeout 150 python3 -m pytest tests/runtime/model/test_moe_cuda.py tests/runtime/lifecycle/test_lifecycle_moe_cuda.py \
    -m gpu -p no:cacheprovider --confcutdir=tests/runtime -q 2>&1 | tail -3
  GRAPHSERVING_MOE_ROUTE_IN_ROUTER=1 timeout 90 python3 -m pytest tests/runtime/lifecycle/test_lifecycle_moe_cuda.py \
    -m gpu -p no:cacheprovider --confcutdir=tests/runtime -q 2>&1 | tail -1
}
case "$gpu" in
  *H200*)
    [ "${ROUTE_GOALS:-0}" = 1 ] && GOAL_SERVE="" GOAL_MODELS=smollm2-135m,llama-3.2-1b,llama-3-8b,qwen3-30b-a3b \
      GOAL_BATCHES=1,64 bash bench/goal_round.sh
    sides="new $R new $R"
    [ -n "${VARIANT_WHEEL:-}" ] && sides="new variant $R new variant $R"
    FOLD_WHEELS=${VARIANT_WHEEL:+variant=$VARIANT_WHEEL} FOLD_TESTS="" FOLD_MOE=1 FOLD_BATCHES=1 \
      FOLD_MODELS=qwen3-30b-a3b FOLD_SIDES="$sides" bash bench/fold_round.sh
    tests ;;
  *)
    tests
    FOLD_TESTS="" FOLD_MOE=0 FOLD_BATCHES=1 FOLD_MODELS=qwen3-30b-a3b FOLD_SIDES="new $R new $R" \
      bash bench/fold_round.sh ;;
esac
