"""Graph-runner benchmark: eager vs CUDA-graph decode steps, capture time and graph memory.

Prints one table per model and writes JSON. For each batch size: eager step time, graph replay
time, static-buffer copy + padding time (host metadata padded into the static buffers, plus the
copy-out of the logits), speedup, capture time and graph memory
per key, and the HBM floor (weight bytes / measured device copy bandwidth, counting the bytes
read and written by a large device-to-device copy).

Models: ``smollm2-135m`` (the real GGUF weights when ``--gguf`` points at the file, otherwise
random weights of its shape), ``llama-3.2-1b``, ``llama-3-8b``, ``qwen3-8b`` and ``qwen3-30b-a3b``
shapes with random weights (timing only; any preset of runtime/model/presets.py).

For a mixture-of-experts model the floor of each batch counts the bytes of the experts that
batch's routing actually reads: every non-expert weight, plus, per MoE layer, the distinct experts
its top-k picks select (measured in one eager pass of the batch; ``experts_read`` in the JSON).

With ``--tensor-parallel-size N`` each model is split over N GPUs (one process each, NCCL,
runtime/model/parallel.py; multicast off as the worker sets it): every rank captures and replays
its share in lockstep, the floor is one rank's weight bytes (the per-GPU HBM floor), and each row
adds ``collective ms``: one replay of a graph holding only the step's collectives (two all-reduces
of [batch, hidden] per layer and the logits' all-gather), so that step / (floor + collective)
says how close the step is to both limits. Rank 0 prints and writes the JSON.

Usage (on a CUDA machine):
    python bench/graph_bench.py --json-out results.json
    python bench/graph_bench.py --models smollm2-135m --batch-sizes 1,8,64 --compile
    python bench/graph_bench.py --models llama-3-8b,llama-3-70b --batch-sizes 1,8,64 --tensor-parallel-size 2
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from graphserving.contract.graph_policy import GraphMode
from graphserving.runtime.model.forward_metadata import ForwardMetadata
from graphserving.runtime.graphs.key import GraphKeyContract, full_key
from graphserving.runtime.graphs.runner import GraphRunner
from graphserving.runtime.model.kv_cache import allocate_kv_cache
from graphserving.runtime.model.parallel import ParallelLayout, TensorParallel, shard_config
from graphserving.runtime.model.presets import preset_config, random_model

def decode_meta(batch: int, context: int, block_size: int, width: int) -> ForwardMetadata:
    """``batch`` decode rows, each at position ``context`` over its own contiguous blocks."""
    dev = "cuda"
    tables = torch.arange(1, 1 + batch * width, dtype=torch.int32, device=dev).view(batch, width)
    pos = torch.full((batch,), context, dtype=torch.int64, device=dev)
    blocks = tables[:, context // block_size].to(torch.int64)
    return ForwardMetadata(
        input_ids=torch.randint(0, 1000, (batch,), device=dev),
        positions=pos,
        seq_lens=torch.full((batch,), context + 1, dtype=torch.int32, device=dev),
        query_lens=torch.ones(batch, dtype=torch.int32, device=dev),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=dev),
        block_table=tables,
        slot_mapping=blocks * block_size + context % block_size,
        logits_indices=torch.arange(batch, device=dev),
        num_actual_tokens=batch, num_actual_reqs=batch, max_query_len=1,
    )


def time_cuda(fn, iters: int, warmup: int = 3) -> float:
    """Median seconds of ``fn`` over ``iters`` runs, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    seconds = time_cuda(lambda: dst.copy_(src), iters=10)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / seconds


def experts_read_per_layer(model, meta: ForwardMetadata, kv_caches: list[torch.Tensor]) -> list[int]:
    """Distinct experts each MoE layer's routing selects for the batch ``meta`` (one eager pass)."""
    from graphserving.runtime.model import llama

    counts: list[int] = []
    route = llama.route_topk

    def recording(*args, **kwargs):
        weights, ids = route(*args, **kwargs)
        experts = model.config.num_experts
        counts.append(int(torch.unique(ids[ids < experts]).numel()))
        return weights, ids

    llama.route_topk = recording
    try:
        model.forward(meta, kv_caches)
    finally:
        llama.route_topk = route
    return counts


def floor_bytes(model, experts_read: list[int]) -> int:
    """Weight bytes one decode step must read: all weights of a dense model; for a mixture of
    experts the non-expert weights plus ``experts_read[i]`` experts of the i-th MoE layer."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    moe_layers = [layer for layer in model.layers if layer.is_moe]
    if not moe_layers:
        return total
    for layer, read in zip(moe_layers, experts_read, strict=True):
        experts = layer.experts_gate_up.shape[0]
        per_expert = (layer.experts_gate_up.numel() + layer.experts_down.numel()) // experts
        total -= (experts - read) * per_expert * layer.experts_gate_up.element_size()
    return total


def collective_seconds(parallel: TensorParallel, config, batch: int, dtype: torch.dtype, iters: int) -> float:
    """Median seconds of one replay of a CUDA graph holding a decode step's collectives: two
    all-reduces of [batch, hidden] per layer, then the all-gather of [batch, vocab / N] float32 logits."""
    hidden = torch.zeros((batch, config.hidden_size), dtype=dtype, device="cuda")
    logits = torch.zeros((batch, config.vocab_size // parallel.layout.tensor_parallel_size), dtype=torch.float32,
                         device="cuda")

    def step() -> None:
        for _ in range(2 * config.num_hidden_layers):
            parallel.all_reduce(hidden)
        parallel.all_gather_vocab(logits)

    step()  # eagerly first: the communicator's lazy set-up stays outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    seconds = time_cuda(graph.replay, iters)
    del graph
    return seconds


def bench_model(name: str, args, bandwidth: float, parallel: TensorParallel | None = None) -> dict:
    dtype = getattr(torch, args.dtype)
    block_size = 16
    width = math.ceil((args.context + 1) / block_size)
    sizes = sorted(args.batch_sizes)
    real_weights = False
    if name == "smollm2-135m" and args.gguf:
        from graphserving.runtime.model.loader import load_model

        loaded = load_model(args.gguf, revision=None, dtype=dtype, device="cuda", parallel=parallel)
        model, config, real_weights = loaded.model, loaded.config, True
    else:
        config = preset_config(name)
        config = shard_config(config, parallel.layout) if parallel is not None else config
        model = random_model(config, dtype, "cuda", max_positions=args.context + 8, parallel=parallel)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kv = allocate_kv_cache(config, 1 + max(sizes) * width, block_size, dtype, "cuda")
    if args.compile:
        model.forward = torch.compile(model.forward, dynamic=False)
    runner = GraphRunner(model, kv, mode=GraphMode.FULL, full_sizes=sizes, piecewise_sizes=[],
                         contract=GraphKeyContract(model_revision="bench", dtype=args.dtype,
                                                   moe_layout=config.moe_layout,
                                                   parallel_layout=model.parallel_layout),
                         max_blocks_per_seq=width)
    torch.cuda.synchronize()
    mem_before = torch.cuda.mem_get_info()[1] - torch.cuda.mem_get_info()[0]
    start = time.perf_counter()
    with torch.inference_mode():
        captures = runner.capture_all()
    capture_total = time.perf_counter() - start
    mem_after = torch.cuda.mem_get_info()[1] - torch.cuda.mem_get_info()[0]
    failed = [c for c in captures if not c.ok]
    if failed:
        print(f"{name}: capture failed for {[(c.key.label(), c.error) for c in failed]}", file=sys.stderr)
    rows = []
    with torch.inference_mode():
        for b in sizes:
            meta = decode_meta(b, args.context, block_size, width)
            key = full_key(b, runner.contract)
            eager = time_cuda(lambda: runner.run_eager(meta), args.iters)
            graph = runner.graphs[key]
            # the batch's own rows in the static buffers: a replay over the capture's padding rows
            # would route every MoE token to no expert and time nothing
            runner.buffers.fill_full(meta, b)
            # cudaProfilerStart/Stop: with `ncu --profile-from-start off` only these launches are profiled
            with torch.cuda.profiler.profile() if args.cuda_profiler_range else contextlib.nullcontext():
                replay = time_cuda(graph.replay, args.iters)
            host = meta.to("cpu")  # as the model runner builds it
            total = time_cuda(lambda: runner.execute(host), args.iters)
            cap = runner.captures[key]
            profile = (profile_step(runner, host, key, args.profile_top, sequence=args.profile_sequence)
                       if args.profile_top else None)
            experts_read = experts_read_per_layer(model, meta, kv) if config.moe_layers else []
            collective = collective_seconds(parallel, config, b, dtype, args.iters) if parallel is not None else 0.0
            rows.append(dict(collective_ms=collective * 1e3, batch=b, eager_ms=eager * 1e3, replay_ms=replay * 1e3, graph_step_ms=total * 1e3,
                             copy_pad_ms=max(0.0, total - replay) * 1e3, speedup=eager / total,
                             capture_s=cap.capture_seconds, graph_mem_mib=cap.memory_bytes / 2**20,
                             tokens_per_s=b / total, experts_read=experts_read, profile=profile,
                             floor_ms=floor_bytes(model, experts_read) / bandwidth * 1e3))
    floor_ms = weight_bytes / bandwidth * 1e3
    result = dict(model=name, real_weights=real_weights, dtype=args.dtype, context=args.context,
                  tensor_parallel_size=parallel.layout.tensor_parallel_size if parallel is not None else 1,
                  compiled=args.compile, weight_bytes=weight_bytes, hbm_floor_ms=floor_ms,
                  capture_total_s=capture_total, graph_mem_total_mib=runner.graph_memory_bytes() / 2**20,
                  graph_mem_delta_mib=(mem_after - mem_before) / 2**20, rows=rows)
    del runner, model, kv
    torch.cuda.empty_cache()
    return result


def host_split_us(runner: GraphRunner, host: ForwardMetadata, key, iters: int = 50) -> dict[str, float]:
    """Median host microseconds of the graph step's parts, each on an idle device (synchronised
    before and after, so the host time alone is counted): plan (the dispatch decision), fill (the
    staging writes and the upload launch), replay launch, logits copy-out launch."""
    parts: dict[str, list[float]] = {"plan": [], "fill": [], "replay": [], "copy_out": []}
    graph = runner.graphs[key]
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        runner.plan(host)
        t1 = time.perf_counter()
        runner.buffers.fill_full(host, key.num_reqs, key.uniform_query_len)
        t2 = time.perf_counter()
        graph.replay()
        t3 = time.perf_counter()
        runner.logits_buf[: host.num_tokens].clone()
        t4 = time.perf_counter()
        for name, seconds in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            parts[name].append(seconds * 1e6)
    return {name: statistics.median(values) for name, values in parts.items()}


def profile_step(runner: GraphRunner, host: ForwardMetadata, key, top: int, steps: int = 10,
                 sequence: int = 0) -> dict:
    """Where a graph step's device time goes (torch.profiler over ``steps`` calls of
    ``runner.execute``): kernels per step, the sum of their durations (busy) against the step's
    wall time on the device (first kernel start to last kernel end, per step), and the ``top``
    kernels by time; plus :func:`host_split_us`. With ``sequence`` > 0, also the ``sequence``
    kernels from the middle of the last step in launch order (:func:`kernel_sequence`). Prints a
    summary and returns it."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        runner.execute(host)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            runner.execute(host)
            torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels.sort(key=lambda e: e.time_range.start)
    # the steps are separated by host synchronisation: split at the largest gaps
    gaps = sorted(range(1, len(kernels)), key=lambda i: kernels[i].time_range.start - kernels[i - 1].time_range.end)
    cuts = sorted(gaps[-(steps - 1):]) if steps > 1 and len(kernels) >= steps else []
    bounds = [0, *cuts, len(kernels)]
    spans, busy = [], []
    for lo, hi in zip(bounds, bounds[1:]):
        step = kernels[lo:hi]
        if step:
            spans.append(step[-1].time_range.end - step[0].time_range.start)
            busy.append(sum(e.time_range.elapsed_us() for e in step))
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name, []).append(e.time_range.elapsed_us())
    table = sorted(((name, len(ts) / steps, sum(ts) / steps) for name, ts in by_name.items()), key=lambda r: -r[2])
    result = dict(kernels_per_step=len(kernels) / steps, device_span_us=statistics.median(spans),
                  busy_us=statistics.median(busy), host_us=host_split_us(runner, host, key),
                  top=[dict(name=n[:90], per_step=c, us_per_step=t) for n, c, t in table[:top]])
    print(f"  profile {key.label()}: {result['kernels_per_step']:.0f} kernels/step, device span "
          f"{result['device_span_us']:.1f} us, kernels busy {result['busy_us']:.1f} us, idle between kernels "
          f"{result['device_span_us'] - result['busy_us']:.1f} us; host "
          + ", ".join(f"{k} {v:.1f}" for k, v in result["host_us"].items()) + " us", flush=True)
    for row in result["top"]:
        print(f"    {row['us_per_step']:8.1f} us  x{row['per_step']:5.1f}  {row['name']}", flush=True)
    if sequence:
        result["sequence"] = kernel_sequence(kernels[bounds[-2]:bounds[-1]], sequence)
    return result


def kernel_sequence(step: list, count: int) -> list[dict]:
    """``count`` kernels from the middle of one step (profiler events sorted by start), in launch
    order, each with its start, its duration and ``adds_us``: its end minus the latest end before it
    (what it added to the step: with programmatic dependent launch a kernel starts while the one
    before it drains and waits, so durations overlap; ``adds_us`` does not). Printed and returned."""
    mid = max(0, len(step) // 2 - count // 2)
    origin = step[mid].time_range.start if step else 0
    latest = max((e.time_range.end for e in step[:mid]), default=origin)
    rows = []
    print(f"    kernels {mid}..{mid + count - 1} of the step, us from the first: start, duration, adds", flush=True)
    for e in step[mid:mid + count]:
        adds = max(0.0, e.time_range.end - latest)
        latest = max(latest, e.time_range.end)
        rows.append(dict(name=e.name[:90], start_us=e.time_range.start - origin, us=e.time_range.elapsed_us(),
                         adds_us=adds))
        print(f"    {rows[-1]['start_us']:8.1f} {rows[-1]['us']:7.1f} {adds:7.1f}  {e.name[:70]}", flush=True)
    return rows


def print_table(result: dict) -> None:
    print(f"\n## {result['model']} ({'real' if result['real_weights'] else 'random'} weights, {result['dtype']}, "
          f"context {result['context']}{', torch.compile' if result['compiled'] else ''})")
    tp = result["tensor_parallel_size"]
    if tp > 1:
        print(f"tensor parallel over {tp} GPUs: weights, floor and graph memory are one rank's")
    print(f"weights {result['weight_bytes'] / 2**20:.0f} MiB, HBM floor (all weights) {result['hbm_floor_ms']:.3f} ms, "
          f"capture total {result['capture_total_s']:.2f} s, graph memory {result['graph_mem_total_mib']:.1f} MiB "
          f"(device delta {result['graph_mem_delta_mib']:.1f} MiB)")
    extra = " collective ms | step/(floor+collective) |" if tp > 1 else ""
    print("| batch | eager ms | replay ms | graph step ms | copy+pad ms | speedup | floor ms | step/floor | tok/s "
          f"| capture s | graph MiB |{extra}")
    print("|---:" * (11 + (2 if tp > 1 else 0)) + "|")
    for r in result["rows"]:
        both = (f" {r['collective_ms']:.3f} | {r['graph_step_ms'] / (r['floor_ms'] + r['collective_ms']):.2f} |"
                if tp > 1 else "")
        print(f"| {r['batch']} | {r['eager_ms']:.3f} | {r['replay_ms']:.3f} | {r['graph_step_ms']:.3f} | "
              f"{r['copy_pad_ms']:.3f} | {r['speedup']:.1f}x | {r['floor_ms']:.3f} | "
              f"{r['graph_step_ms'] / r['floor_ms']:.2f} | {r['tokens_per_s']:.0f} | {r['capture_s']:.3f} | "
              f"{r['graph_mem_mib']:.1f} |{both}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="smollm2-135m,llama-3.2-1b,llama-3-8b")
    parser.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")],
                        default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    parser.add_argument("--context", type=int, default=256, help="tokens already cached per sequence")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--gguf", help="SmolLM2 GGUF file: use its real weights")
    parser.add_argument("--compile", action="store_true", help="torch.compile the forward pass before capture")
    parser.add_argument("--profile-top", type=int, default=0,
                        help="also profile each FULL step (torch.profiler) and print its N slowest kernels")
    parser.add_argument("--profile-sequence", type=int, default=0,
                        help="with --profile-top: also print this many kernels of one step in launch order, with "
                             "what each adds to the step")
    parser.add_argument("--cuda-profiler-range", action="store_true",
                        help="start the CUDA profiler around the timed replays only (for `ncu --profile-from-start "
                             "off`: the capture's warm-up runs over padding rows, whose MoE tokens route nowhere)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="split each model over this many GPUs, one process each (NCCL)")
    parser.add_argument("--json-out")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("graph_bench needs a CUDA device", file=sys.stderr)
        return 2
    if args.tensor_parallel_size > 1:
        return run_parallel(args)
    bandwidth = copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    results = []
    for name in args.models.split(","):
        result = bench_model(name, args, bandwidth)
        print_table(result)
        results.append(result)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                           copy_bandwidth_bytes_per_s=bandwidth, results=results), f, indent=2)
    return 0


def run_parallel(args) -> int:
    """``--tensor-parallel-size N``: one process per GPU (spawned), rank 0 reporting."""
    import torch.multiprocessing as mp

    from graphserving.dev.ports import free_port
    from graphserving.runtime.lifecycle.ranks import MULTICAST_OFF

    n = args.tensor_parallel_size
    if torch.cuda.device_count() < n:
        print(f"--tensor-parallel-size {n} needs {n} GPUs; {torch.cuda.device_count()} visible", file=sys.stderr)
        return 2
    for variable, value in MULTICAST_OFF.items():
        os.environ.setdefault(variable, value)
    mp.start_processes(_rank_main, args=(n, free_port(), args), nprocs=n, join=True, start_method="spawn")
    return 0


def _rank_main(rank: int, n: int, port: int, args) -> None:
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n, device_id=device)
    parallel = TensorParallel(ParallelLayout(n, rank))
    bandwidth = copy_bandwidth()
    results = []
    for name in args.models.split(","):
        result = bench_model(name, args, bandwidth, parallel)
        if rank == 0:
            print_table(result)
        results.append(result)
    dist.barrier()
    if rank == 0:
        print(f"device {torch.cuda.get_device_name()} x{n}, torch {torch.__version__}, "
              f"copy bandwidth {bandwidth / 1e12:.2f} TB/s (rank 0)")
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump(dict(device=torch.cuda.get_device_name(), tensor_parallel_size=n, torch=torch.__version__,
                               copy_bandwidth_bytes_per_s=bandwidth, results=results), f, indent=2)
    # no destroy_process_group: the process's exit releases NCCL (destroying it after captured
    # graphs is the known hang, runtime/lifecycle/ranks.py)


if __name__ == "__main__":
    sys.exit(main())
