#!/usr/bin/env bash
# One short device round for the batch-1 folds (bench/RESULTS.md, "Fewer kernels per MoE layer",
# "The decode loop between two replays"): the GPU tests of the changed kernels, then the MoE layer
# alone (bench/moe_bench.py), the whole step (bench/graph_bench.py) and serving (bench/serve.py) on the
# old wheel and on this tree, alternately.
# Usage (after `source bench/device_env.sh`): OLD_WHEEL=path bash bench/fold_round.sh (OLD_WHEEL: the side
# "old"; a side with neither a wheel nor variables other than "new" stops the round with status 2)
#   FOLD_TESTS (default: the kernel, MoE and static-buffer tests; empty: none), FOLD_MODELS
#   (default qwen3-30b-a3b,qwen3-8b,smollm2-135m), FOLD_BATCHES (default 1), FOLD_ROUNDS (default 1),
#   FOLD_SELECT (the tests' -k expression; empty: every test), FOLD_SIDES (default "old new";
#   "name=VAR=value,VAR2=value": this tree with those variables set; "nocombine" is
#   nocombine=GRAPHSERVING_COMBINE_IN_O_PROJ=0), FOLD_MOE (default 1: moe_bench too),
#   FOLD_PROFILE (models whose batch-1 step is profiled on this tree: kernels per step, device span),
#   FOLD_SERVE (a concurrency: serve.py on SmolLM2-135M, that many sequences then one, over HTTP
#   and in process; default none), FOLD_WHEELS ("name=path ...": more wheels, each a side of that
#   name, installed beside /tmp/site like the old wheel).
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
TESTS=${FOLD_TESTS-tests/runtime/model/test_kernels.py tests/runtime/model/test_moe_cuda.py tests/runtime/graphs/test_static_buffers.py}
for named in ${OLD_WHEEL:+"old=$OLD_WHEEL"} ${FOLD_WHEELS:-}; do
  python3 -m pip install -q --no-index --no-deps --no-compile --target "/tmp/site-${named%%=*}" "${named#*=}"
done
if [ -n "$TESTS" ]; then
  SELECT=${FOLD_SELECT-rope or qk or skinny or normed or qwen3 or moe or host_fills}
  timeout 420 python3 -m pytest $TESTS -m gpu -p no:cacheprovider --confcutdir=tests/runtime -q \
    ${SELECT:+-k "$SELECT"} > "$OUT/fold-tests.txt" 2>&1
  echo "[tests] rc=$?"; tail -2 "$OUT/fold-tests.txt"; grep -E '^(FAILED|ERROR)' "$OUT/fold-tests.txt"
fi
for round in $(seq "${FOLD_ROUNDS:-1}"); do for spec in ${FOLD_SIDES:-old new}; do
  [ "$spec" = nocombine ] && spec=nocombine=GRAPHSERVING_COMBINE_IN_O_PROJ=0
  side=${spec%%=*}; vars=""; [[ $spec == *=* ]] && vars=${spec#*=}
  if [ "$side" != new ] && [ -z "$vars" ] && [ ! -d "/tmp/site-$side" ]; then
    echo "side $side: no wheel installed for it (OLD_WHEEL for old, FOLD_WHEELS for the others)" >&2; exit 2
  fi
  path=$([ $side != new ] && [ -d "/tmp/site-$side" ] && echo "/tmp/site-$side:")/tmp/site
  echo "== $side round $round ${vars}"
  [ -n "$vars" ] && export ${vars//,/ }
  [ "${FOLD_MOE:-1}" = 1 ] && PYTHONPATH=$path timeout 120 python3 bench/moe_bench.py --batch-sizes 1,2 --no-reference 2>&1 | grep '^T='
  PYTHONPATH=$path timeout 240 python3 bench/graph_bench.py --models "${FOLD_MODELS:-qwen3-30b-a3b,qwen3-8b,smollm2-135m}" \
    --batch-sizes "${FOLD_BATCHES:-1}" --json-out "$OUT/fold_${side}_$round.json" 2>&1 | grep -E '^## |^\| [0-9]'
  for c in ${FOLD_SERVE:-}; do
    PYTHONPATH=$path timeout 200 python3 bench/serve.py --spawn --throughput --model preset:smollm2-135m \
      --concurrency "$c" --prompt-tokens 32 --new-tokens 256 --in-process --max-num-seqs 64 --no-peer \
      > "$OUT/serve_${side}_${round}_c$c.txt" 2>&1
    echo "  c=$c rc=$?"; grep -E 'output tok/s' "$OUT/serve_${side}_${round}_c$c.txt"
  done
  [ -n "$vars" ] && for v in ${vars//,/ }; do unset "${v%%=*}"; done
done; done
for model in ${FOLD_PROFILE:-}; do
  echo "== profile $model"
  timeout 180 python3 bench/graph_bench.py --models "$model" --batch-sizes 1 --profile-top 8 2>&1 | tail -14
done
