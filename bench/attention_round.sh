#!/usr/bin/env bash
# One device round for the decode-attention policies (bench/RESULTS.md, "Decode attention: the first
# tile before the PDL wait"): GPU tests, then graph_bench A/B of the wheel in $OLD_WHEEL ("old") against
# this tree at its defaults ("new") and with the fused RoPE kernel forced off ("nofuse"), then a profile
# of one batch-1 FULL step. Writes one summary file to $OUT (the device returns few files).
# Usage (after `source bench/device_env.sh`): OLD_WHEEL=path bash bench/attention_round.sh
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
SUMMARY=$OUT/summary.txt
OUT=/tmp/attention-raw GPU_TESTS=${GPU_TESTS:-tests/runtime/model tests/runtime/graphs} bash bench/gpu_round.sh none tests
cp /tmp/attention-raw/gpu-tests.txt "$OUT/"
tail -3 /tmp/attention-raw/gpu-tests.txt > "$SUMMARY"
grep -E '^(FAILED|ERROR)' /tmp/attention-raw/gpu-tests.txt >> "$SUMMARY"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-old "$OLD_WHEEL"
for round in $(seq ${AB_ROUNDS:-2}); do for side in ${AB_SIDES:-old new nofuse}; do
  echo "== $side round $round" >> "$SUMMARY"
  env PYTHONPATH=$([ $side = old ] && echo /tmp/site-old:)/tmp/site \
    GRAPHSERVING_FUSE_ROPE_DECODE=$([ $side = nofuse ] && echo 0 || echo auto) \
    timeout 300 python3 bench/graph_bench.py --models ${AB_MODELS:-smollm2-135m,llama-3.2-1b,llama-3-8b,qwen3-8b} \
    --batch-sizes ${AB_BATCHES:-1,8,64} 2>&1 | grep -E '^## |^\| [0-9]' >> "$SUMMARY"
done; done
for side in ${PROFILE_SIDES:-new}; do
  echo "== profile $side" >> "$SUMMARY"
  timeout 200 python3 bench/graph_bench.py --models ${PROFILE_MODELS:-smollm2-135m,llama-3.2-1b} --batch-sizes 1 \
    --profile-top 12 2>&1 | grep -E '^## |profile|^ +[0-9.]+ us' >> "$SUMMARY"
done
cat "$SUMMARY"
