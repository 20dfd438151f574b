#!/usr/bin/env bash
# One device round for the batch-1 kernel policies (bench/RESULTS.md, "Decode attention: the first
# tile before the PDL wait"): bench/gpu_round.sh's stages tests, graphs-ab and profile-graphs (batch 1),
# their logs gathered into one summary file (the device returns few files), with the tests' log.
# Sides as in graphs-ab: "old" = the wheel in $OLD_WHEEL; "new" = this tree at its defaults;
# "nofuse" = GRAPHSERVING_FUSE_ROPE_DECODE=0; "gemv64" = GRAPHSERVING_GEMV_MAX_WEIGHT_MIB=64; ...
# Usage (after `source bench/device_env.sh`): OLD_WHEEL=path bash bench/attention_round.sh
#   GPU_TESTS (default "tests/runtime/model tests/runtime/graphs"; empty: no tests), AB_SIDES (default
#   "old new nofuse"; empty: no A/B), AB_ROUNDS (2), AB_MODELS, AB_BATCHES (1,8,64), PROFILE_MODELS
#   (default smollm2-135m,llama-3.2-1b; empty: no profile).
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
RAW=/tmp/attention-raw; rm -rf "$RAW"
TESTS=${GPU_TESTS-tests/runtime/model tests/runtime/graphs}
SIDES=${AB_SIDES-old new nofuse}
PROFILE=${PROFILE_MODELS-smollm2-135m,llama-3.2-1b}
ROUNDS=${AB_ROUNDS:-2}
stages=()
[ -n "$TESTS" ] && stages+=(tests)
[ -n "$SIDES" ] && stages+=(graphs-ab)
[ -n "$PROFILE" ] && stages+=(profile-graphs)
OUT=$RAW GPU_TESTS="$TESTS" AB_SIDES="$SIDES" AB_ROUNDS=$ROUNDS \
  AB_MODELS=${AB_MODELS:-smollm2-135m,llama-3.2-1b,llama-3-8b,qwen3-8b} AB_BATCHES=${AB_BATCHES:-1,8,64} \
  PROFILE_MODELS="$PROFILE" PROFILE_BATCHES=1 bash bench/gpu_round.sh none "${stages[@]}"
SUMMARY=$OUT/summary.txt
: > "$SUMMARY"
if [ -n "$TESTS" ]; then
  cp "$RAW/gpu-tests.txt" "$OUT/"
  tail -3 "$RAW/gpu-tests.txt" >> "$SUMMARY"
  grep -E '^(FAILED|ERROR)' "$RAW/gpu-tests.txt" >> "$SUMMARY"
fi
if [ -n "$SIDES" ]; then
  for round in $(seq "$ROUNDS"); do for side in $SIDES; do
    echo "== $side round $round" >> "$SUMMARY"
    grep -E '^## |^\| [0-9]' "$RAW/graph-bench-ab-$side-$round.txt" >> "$SUMMARY"
  done; done
fi
if [ -n "$PROFILE" ]; then
  echo "== profile" >> "$SUMMARY"
  grep -E '^## |profile|^ +[0-9.]+ us' "$RAW/graph-profile.txt" >> "$SUMMARY"
fi
cat "$SUMMARY"
