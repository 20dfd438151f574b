#!/usr/bin/env bash
# Nsight Compute on named kernels of a model's FULL graph replays at one batch size (bench/graph_bench.py):
# how close each comes to the memory system, how full the multiprocessors are and what its warps wait on
# (bench/RESULTS.md names the kernels worth it: the batch-64 decode attention, the MoE down kernel).
# Only the timed graph replays are profiled (graph_bench --cuda-profiler-range, ncu --profile-from-start
# off), over the batch's own rows: the capture's warm-up runs over padding rows, whose MoE tokens route
# nowhere, so profiling from the start measured kernels that read no weights. ncu runs each profiled
# kernel alone (no PDL overlap), with its caches flushed and the clocks as the GPU sets them
# (--clock-control none), so durations are for reading beside each other and beside the bytes, not
# for the step's time.
# Usage (after `source bench/device_env.sh`): NCU_MODEL=llama-3-8b NCU_BATCH=64 NCU_KERNELS='_paged_decode_kernel'
#   bash bench/ncu_round.sh   (NCU_KERNELS: a regular expression of kernel names; NCU_SKIP matching launches
#   of the replays skipped first, default 0; NCU_COUNT profiled, default 3; the CSV and a summary under $OUT)
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
NCU=${NCU:-$(command -v ncu || echo /usr/local/cuda/bin/ncu)}
model=${NCU_MODEL:-llama-3-8b}; batch=${NCU_BATCH:-64}
report=$OUT/ncu_${model}_b${batch}
timeout "${NCU_TIMEOUT:-420}" "$NCU" --target-processes all --graph-profiling node \
  --profile-from-start off --clock-control none --cache-control all \
  --kernel-name "regex:${NCU_KERNELS:-_paged_decode_kernel}" \
  --launch-skip "${NCU_SKIP:-0}" --launch-count "${NCU_COUNT:-3}" \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
  --section WarpStateStats --section ComputeWorkloadAnalysis --csv --page details \
  python3 bench/graph_bench.py --models "$model" --batch-sizes "$batch" --iters 2 --cuda-profiler-range > "$report.csv" 2> "$report.err"
echo "[ncu $model batch $batch] rc=$?"; grep -m3 -E "ERR|error" "$report.err"
python3 - "$report.csv" <<'PY' | tee "$report.summary.txt"
import csv, sys
from collections import defaultdict

WANTED = ("Duration", "SM Frequency", "DRAM Throughput", "L2 Hit Rate", "Memory Throughput", "Achieved Occupancy",
          "Theoretical Occupancy", "Registers Per Thread", "Dynamic Shared Memory Per Block", "Waves Per SM",
          "Grid Size", "Block Size", "Warp Cycles Per Issued Instruction", "Issue Slots Busy")
rows = defaultdict(dict)  # (launch id, kernel) -> metric -> "value unit"
with open(sys.argv[1], newline="") as f:
    lines = [line for line in f if line.startswith('"')]  # ncu's own messages are not CSV
for r in csv.DictReader(lines):
    if r.get("Metric Name") in WANTED:
        rows[(r["ID"], r["Kernel Name"][:60])][r["Metric Name"]] = f'{r["Metric Value"]} {r["Metric Unit"]}'.strip()
if not rows:
    print("no kernel profiled (see the .err file)")
for (launch, kernel), metrics in rows.items():
    print(f"launch {launch}: {kernel}")
    for name in WANTED:
        if name in metrics:
            print(f"  {name:<36}{metrics[name]}")
PY
