#!/usr/bin/env bash
# One short device round for the batch-1 folds (bench/RESULTS.md, "Fewer kernels per MoE layer"):
# the GPU tests of the changed kernels, then the MoE layer alone (bench/moe_bench.py) and the whole
# batch-1 step (bench/graph_bench.py) on the old wheel and on this tree, alternately.
# Usage (after `source bench/device_env.sh`): OLD_WHEEL=path bash bench/fold_round.sh
#   FOLD_TESTS (default: the kernel, MoE and static-buffer tests; empty: none), FOLD_MODELS
#   (default qwen3-30b-a3b,qwen3-8b,smollm2-135m), FOLD_BATCHES (default 1), FOLD_ROUNDS (default 1),
#   FOLD_SELECT (the tests' -k expression).
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
TESTS=${FOLD_TESTS-tests/runtime/model/test_kernels.py tests/runtime/model/test_moe_cuda.py tests/runtime/graphs/test_static_buffers.py}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-old "$OLD_WHEEL"
if [ -n "$TESTS" ]; then
  timeout 300 python3 -m pytest $TESTS -m gpu -p no:cacheprovider --confcutdir=tests/runtime -q \
    -k "${FOLD_SELECT:-rope or qk or skinny or normed or qwen3 or moe or host_fills}" > "$OUT/fold-tests.txt" 2>&1
  echo "[tests] rc=$?"; tail -2 "$OUT/fold-tests.txt"; grep -E '^(FAILED|ERROR)' "$OUT/fold-tests.txt"
fi
for round in $(seq "${FOLD_ROUNDS:-1}"); do for side in old new; do
  path=$([ $side = old ] && echo /tmp/site-old:)/tmp/site
  echo "== $side round $round"
  PYTHONPATH=$path timeout 120 python3 bench/moe_bench.py --batch-sizes 1,2 --no-reference 2>&1 | grep '^T='
  PYTHONPATH=$path timeout 240 python3 bench/graph_bench.py --models "${FOLD_MODELS:-qwen3-30b-a3b,qwen3-8b,smollm2-135m}" \
    --batch-sizes "${FOLD_BATCHES:-1}" --json-out "$OUT/fold_${side}_$round.json" 2>&1 | grep -E '^## |^\| [0-9]'
done; done
