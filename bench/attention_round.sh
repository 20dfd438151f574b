#!/usr/bin/env bash
# One device round for the batch-1 kernel policies (bench/RESULTS.md, "Decode attention: the first
# tile before the PDL wait"): GPU tests, then graph_bench A/B of sides alternately, then a profile of
# one batch-1 FULL step. Writes one summary file (and the tests' log) to $OUT: the device returns few files.
# Sides: "old" = the wheel in $OLD_WHEEL; "new" = this tree at its defaults; "nofuse" =
# GRAPHSERVING_FUSE_ROPE_DECODE=0; "gemv64" = GRAPHSERVING_GEMV_MAX_WEIGHT_MIB=64.
# Usage (after `source bench/device_env.sh`): OLD_WHEEL=path bash bench/attention_round.sh
#   GPU_TESTS (default "tests/runtime/model tests/runtime/graphs"; empty: no tests), AB_SIDES,
#   AB_ROUNDS (2), AB_MODELS, AB_BATCHES (1,8,64), PROFILE_MODELS (empty: no profile).
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
SUMMARY=$OUT/summary.txt
: > "$SUMMARY"
TESTS=${GPU_TESTS-tests/runtime/model tests/runtime/graphs}
if [ -n "$TESTS" ]; then
  OUT=/tmp/attention-raw GPU_TESTS="$TESTS" bash bench/gpu_round.sh none tests
  cp /tmp/attention-raw/gpu-tests.txt "$OUT/"
  tail -3 /tmp/attention-raw/gpu-tests.txt >> "$SUMMARY"
  grep -E '^(FAILED|ERROR)' /tmp/attention-raw/gpu-tests.txt >> "$SUMMARY"
fi
[ -n "${OLD_WHEEL:-}" ] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-old "$OLD_WHEEL"
for round in $(seq ${AB_ROUNDS:-2}); do for side in ${AB_SIDES-old new nofuse}; do
  echo "== $side round $round" >> "$SUMMARY"
  case $side in
    old) env=(PYTHONPATH=/tmp/site-old:/tmp/site) ;;
    nofuse) env=(GRAPHSERVING_FUSE_ROPE_DECODE=0) ;;
    gemv64) env=(GRAPHSERVING_GEMV_MAX_WEIGHT_MIB=64) ;;
    *) env=() ;;
  esac
  env "${env[@]}" timeout 300 python3 bench/graph_bench.py \
    --models ${AB_MODELS:-smollm2-135m,llama-3.2-1b,llama-3-8b,qwen3-8b} --batch-sizes ${AB_BATCHES:-1,8,64} \
    2>&1 | grep -E '^## |^\| [0-9]' >> "$SUMMARY"
done; done
if [ -n "${PROFILE_MODELS-smollm2-135m,llama-3.2-1b}" ]; then
  echo "== profile" >> "$SUMMARY"
  timeout 200 python3 bench/graph_bench.py --models ${PROFILE_MODELS-smollm2-135m,llama-3.2-1b} --batch-sizes 1 \
    --profile-top 12 2>&1 | grep -E '^## |profile|^ +[0-9.]+ us' >> "$SUMMARY"
fi
cat "$SUMMARY"
