#!/usr/bin/env bash
# The H200 measurements issues 14 and 16 wait on, in one device call (under 600 s), the most
# important first: the goal tables (graph_bench's FULL graph step, batch 1 and 64, of the three
# issue-14 shapes and Qwen3-30B-A3B), then a staged variant of the MoE layer against this tree
# alternately (bench/fold_round.sh), then every direct MoE tile on this GPU (bench/moe_bench.py --grid).
# On any other GPU it runs nothing and exits with status 3, so a call that brought another kind of
# GPU costs only its start.
# Usage (after `source bench/device_env.sh`): bash bench/h200_round.sh
#   VARIANT_WHEEL (optional): a wheel of a staged variant (e.g. this tree with
#   bench/staged/moe-down-one-sum.patch applied and DIRECT_DOWN_TILE = (2, 256)), folded against this
#   tree as side "variant"; H200_SKIP_GRID=1 skips the tile grid.
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "GPU: $gpu"
case "$gpu" in *H200*) ;; *) echo "not an H200: nothing run"; exit 3 ;; esac
GOAL_SERVE="" GOAL_MODELS=smollm2-135m,llama-3.2-1b,llama-3-8b,qwen3-30b-a3b GOAL_BATCHES=1,64 bash bench/goal_round.sh
if [ -n "${VARIANT_WHEEL:-}" ]; then
  FOLD_WHEELS="variant=$VARIANT_WHEEL" FOLD_TESTS="" FOLD_MOE=1 FOLD_BATCHES=1 FOLD_SIDES="new variant new variant" \
    FOLD_MODELS=qwen3-30b-a3b bash bench/fold_round.sh
fi
if [ "${H200_SKIP_GRID:-0}" != 1 ]; then
  echo "== direct MoE tiles, this tree"
  timeout 110 python3 bench/moe_bench.py --batch-sizes 1 --no-reference --grid 2>&1 | grep -E '^  grid T|^T=' | head -8
fi
