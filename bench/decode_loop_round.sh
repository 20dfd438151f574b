#!/usr/bin/env bash
# One device round for the decode loop's host and device overheads (bench/RESULTS.md, "The decode
# loop between two replays"): GPU tests, then the old wheel and this tree alternately on the same
# warm machine: graph_bench's batch-1 step (replay + host fill + copy-out) and bench/serve.py's one
# and 64 sequences (multi-step decoding: the advance kernel and the uncopied logits).
# Usage (after `source bench/device_env.sh`): OLD_WHEEL=path bash bench/decode_loop_round.sh
#   LOOP_TESTS (pytest paths, -m gpu; empty: none), LOOP_ROUNDS (default 2), LOOP_MODELS (graph_bench,
#   default smollm2-135m,llama-3.2-1b), LOOP_BATCHES (default 1), LOOP_SERVE (concurrency, default 64;
#   serve.py measures it and one sequence; empty: no serving), LOOP_PROFILE (models profiled on this tree: kernels, host split).
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-old "$OLD_WHEEL"
TESTS=${LOOP_TESTS-tests/runtime/engine/test_decode_advance.py tests/runtime/graphs/test_static_buffers.py}
if [ -n "$TESTS" ]; then
  timeout 420 python3 -m pytest $TESTS -m gpu -p no:cacheprovider --confcutdir=tests/runtime -q > "$OUT/loop-tests.txt" 2>&1
  echo "[tests] rc=$?"; tail -2 "$OUT/loop-tests.txt"; grep -E '^(FAILED|ERROR)' "$OUT/loop-tests.txt"
fi
for round in $(seq "${LOOP_ROUNDS:-2}"); do for side in old new; do
  path=$([ $side = old ] && echo /tmp/site-old:)/tmp/site
  echo "== $side round $round"
  if [ -n "${LOOP_MODELS-smollm2-135m,llama-3.2-1b}" ]; then
    PYTHONPATH=$path timeout 240 python3 bench/graph_bench.py --models "${LOOP_MODELS-smollm2-135m,llama-3.2-1b}" \
      --batch-sizes "${LOOP_BATCHES:-1}" --json-out "$OUT/loop_${side}_$round.json" 2>&1 | grep -E '^## |^\| [0-9]'
  fi
  for c in ${LOOP_SERVE-64}; do
    PYTHONPATH=$path timeout 200 python3 bench/serve.py --spawn --throughput --model preset:smollm2-135m \
      --concurrency "$c" --prompt-tokens 32 --new-tokens 256 --in-process --max-num-seqs 64 --no-peer \
      > "$OUT/serve_${side}_${round}_c$c.txt" 2>&1
    echo "  c=$c rc=$?"; grep -E 'output tok/s' "$OUT/serve_${side}_${round}_c$c.txt"
  done
done; done
for model in ${LOOP_PROFILE:-}; do
  echo "== profile $model"
  timeout 180 python3 bench/graph_bench.py --models "$model" --batch-sizes 1 --profile-top 6 2>&1 | grep -A7 'profile '
done
