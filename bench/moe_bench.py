"""MoE layer micro-benchmark: the fused Triton path against the torch reference, and the floor.

One MoE layer's routed compute (``moe.route_topk`` + ``moe.moe_experts``) on random weights of
a real shape (default Qwen3-30B-A3B: E=128 experts, k=8, H=2048, I=768, bfloat16), timed as a
CUDA-graph replay pays it: ``--layers`` calls, each on its own copy of the expert weights (so the
weights come from HBM, not from the 60 MB L2, as in a decode step over 48 layers), are captured
into one graph, and the time per call is the replay time over the calls. ``eager us`` is the
same fused path without a graph (Python and launch overhead included).

``floor us`` is the bytes of the experts the routing actually chose (distinct experts x
3 * H * I * element size, plus the activations) at 4.8 TB/s, the H200's datasheet bandwidth:
no kernel can read them faster. At T=1, k=8 that is 8 experts, 75.5 MB: 15.7 us.

Usage (on a CUDA machine; a minute on an H200):
    python bench/moe_bench.py --batch-sizes 1,8,64,512 --json-out moe_bench.json
    python bench/moe_bench.py --batch-sizes 1,64 --breakdown  # also each kernel's device time
    python bench/moe_bench.py --batch-sizes 1,64 --sweep      # also a coordinate sweep of MoEConfig
    python bench/moe_bench.py --batch-sizes 1 --grid          # also every combination of the direct tiles
From Python: ``from moe_bench import bench_moe; bench_moe(1)`` prints and returns one row.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from graphserving.runtime.model import kernels, moe
from graphserving.runtime.model.kernels import moe as km
from graphserving.runtime.model.kernels.moe import MoEConfig, choose_config, fused_moe, fused_route_topk

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_bench import graph_time_us as kernel_graph_time_us  # noqa: E402

HBM_BYTES_PER_S = 4.8e12
"""H200 HBM3e bandwidth (datasheet)."""


def graph_time_us(fn, calls: int, iters: int = 10) -> float:
    """Median microseconds per call of ``fn(i)``, ``i`` cycling over ``range(calls)`` (one weight
    copy each), replayed from one CUDA graph of ``calls`` calls (kernel_bench.graph_time_us)."""
    indices = itertools.cycle(range(calls))
    return kernel_graph_time_us(lambda: fn(next(indices)), calls, iters)


def eager_time_us(fn, calls: int, iters: int = 5) -> float:
    """Median wall microseconds per call of ``fn(i)`` run eagerly (launch overhead included)."""
    fn(0)
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        for i in range(calls):
            fn(i)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e6 / calls)
    return statistics.median(times)


def routing_logits(kind: str, num_tokens: int, num_experts: int, top_k: int, gen) -> torch.Tensor:
    """float32 router logits: ``random``, ``one_expert`` (every token the same k experts) or
    ``spread`` (token t the experts t*k .. t*k+k-1 mod E)."""
    logits = torch.randn(num_tokens, num_experts, device="cuda", generator=gen)
    if kind == "random":
        return logits
    chosen = torch.arange(top_k, device="cuda")[None, :].expand(num_tokens, top_k)
    if kind == "spread":
        chosen = (torch.arange(num_tokens, device="cuda")[:, None] * top_k + chosen) % num_experts
    return logits.scatter(1, chosen, 20.0 + torch.arange(top_k, 0, -1, device="cuda", dtype=torch.float32).expand(
        num_tokens, top_k))


def make_layer(num_tokens: int, num_experts: int = 128, top_k: int = 8, hidden: int = 2048, inter: int = 768,
               dtype: torch.dtype = torch.bfloat16, layers: int = 8, routing: str = "random", config=None) -> dict:
    """Random weights (``layers`` copies), inputs and the two paths as ``fn(i)`` (copy ``i % layers``)."""

    gen = torch.Generator(device="cuda").manual_seed(0)
    w_gate_up = [torch.randn(num_experts, 2 * inter, hidden, device="cuda", generator=gen, dtype=dtype) * hidden ** -0.5
                 for _ in range(layers)]
    w_down = [torch.randn(num_experts, hidden, inter, device="cuda", generator=gen, dtype=dtype) * inter ** -0.5
              for _ in range(layers)]
    x = torch.randn(num_tokens, hidden, device="cuda", generator=gen, dtype=dtype)
    logits = routing_logits(routing, num_tokens, num_experts, top_k, gen).to(dtype)
    cfg = config or choose_config(num_tokens, top_k, num_experts, hidden, inter, x.element_size())

    def fused(i, config=cfg):
        weights, ids = fused_route_topk(logits, top_k, True, None)
        return fused_moe(x, w_gate_up[i % layers], w_down[i % layers], weights, ids, config=config)

    def reference(i):
        weights, ids = moe.route_topk_reference(logits, top_k, True, None)
        return moe.moe_experts_reference(x, w_gate_up[i % layers], w_down[i % layers], weights, ids)

    _, ids = moe.route_topk_reference(logits, top_k, True, None)
    distinct = int(torch.unique(ids).numel())
    floor_bytes = distinct * 3 * hidden * inter * x.element_size() + 2 * x.numel() * x.element_size()
    row = dict(tokens=num_tokens, experts=num_experts, top_k=top_k, hidden=hidden, inter=inter, routing=routing,
               dtype=str(dtype).removeprefix("torch."), distinct_experts=distinct,
               floor_us=floor_bytes / HBM_BYTES_PER_S * 1e6, config=dataclasses.asdict(cfg))
    return dict(row=row, fused=fused, reference=reference, layers=layers,
                route=lambda i: fused_route_topk(logits, top_k, True, None))


def bench_moe(num_tokens: int, *, reference: bool = True, quiet: bool = False, **shape) -> dict:
    """Time one MoE layer of ``num_tokens`` tokens (``make_layer``'s keywords); print and return a
    row (microseconds per call)."""
    layer = make_layer(num_tokens, **shape)
    row, fused, calls = layer["row"], layer["fused"], layer["layers"]
    row["graph_us"] = graph_time_us(fused, calls)
    row["route_us"] = graph_time_us(layer["route"], calls)
    row["eager_us"] = eager_time_us(fused, calls)
    row["graph_over_floor"] = row["graph_us"] / row["floor_us"]
    if reference:
        row["reference_us"] = graph_time_us(layer["reference"], calls, iters=3)
        row["max_abs_diff"] = float((fused(0).float() - layer["reference"](0).float()).abs().max())
    if not quiet:
        print(format_row(row), flush=True)
    return row


def breakdown(num_tokens: int, **shape) -> dict[str, float]:
    """Device microseconds per call of each kernel of the fused path (torch.profiler, eager calls)."""
    layer = make_layer(num_tokens, **shape)
    fused, calls = layer["fused"], layer["layers"]
    fused(0)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for i in range(calls):
            fused(i)
        torch.cuda.synchronize()
    times = {}
    for event in prof.key_averages():
        total = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if total > 0 and event.count:
            times[event.key] = total / calls
    print(f"T={num_tokens} kernels (us per call): "
          + ", ".join(f"{name.split('(')[0][:28]} {us:.1f}" for name, us in sorted(times.items(), key=lambda t: -t[1])),
          flush=True)
    return times


def format_row(row: dict) -> str:
    ref = f"{row['reference_us']:9.1f}" if "reference_us" in row else "        -"
    c = row["config"]
    cfg = (f"{'direct' if c.get('direct') else 'm' + str(c['block_m'])} gu{c['gate_up_block_n']}x{c['gate_up_block_k']}"
           f" d{c['down_block_n']}x{c['down_block_k']} w{c['num_warps']} s{c['num_stages']}")
    return (f"T={row['tokens']:5d} {row['routing']:10s} experts read {row['distinct_experts']:4d}  "
            f"graph {row['graph_us']:8.1f} us (route {row['route_us']:5.1f})  eager {row['eager_us']:8.1f} us  "
            f"reference {ref} us  floor {row['floor_us']:7.1f} us  graph/floor {row['graph_over_floor']:5.2f}  {cfg}")


def sweep(num_tokens: int, **shape) -> list[dict]:
    """Coordinate descent over ``MoEConfig`` from ``choose_config``'s choice: each field in turn
    takes the value that times best (graph replay), the others held. Returns one row per config."""
    layer = make_layer(num_tokens, **shape)
    fused, calls = layer["fused"], layer["layers"]
    best = MoEConfig(**layer["row"]["config"])
    if best.direct:  # matrix-vector tiles; block_m is unused
        choices = dict(gate_up_block_n=(2, 4, 8, 16, 32), gate_up_block_k=(128, 256, 512, 1024, 2048),
                       down_block_n=(1, 2, 4, 8), down_block_k=(128, 256, 512, 1024), num_warps=(2, 4, 8, 16),
                       num_stages=(1, 2, 3, 4))
    else:
        choices = dict(direct=(True,), block_m=(16, 32, 64, 128), gate_up_block_n=(16, 32, 64, 128),
                       gate_up_block_k=(32, 64, 128, 256), down_block_n=(32, 64, 128, 256),
                       down_block_k=(32, 64, 128, 256), num_warps=(4, 8), num_stages=(2, 3, 4, 5))
    best_us = graph_time_us(lambda i: fused(i, best), calls)
    rows = [dict(tokens=num_tokens, config=dataclasses.asdict(best), graph_us=best_us, chosen=True)]
    for field, values in choices.items():
        for value in values:
            cfg = dataclasses.replace(best, **{field: value})
            if cfg == best:
                continue
            try:
                us = graph_time_us(lambda i: fused(i, cfg), calls)
            except Exception as exc:  # e.g. out of shared memory for a large tile
                print(f"  T={num_tokens} {field}={value}: {type(exc).__name__}", flush=True)
                torch.cuda.synchronize()
                continue
            rows.append(dict(tokens=num_tokens, config=dataclasses.asdict(cfg), graph_us=us))
            if us < best_us:
                best, best_us = cfg, us
    if rows[0]["config"]["direct"]:  # against the aligned path with its own decode tiles
        r = layer["row"]
        first_aligned = choose_config(km.DIRECT_MAX_PAIRS // r["top_k"] + 1, r["top_k"], r["experts"], r["hidden"],
                                      r["inter"])
        us = graph_time_us(lambda i: fused(i, first_aligned), calls)
        rows.append(dict(tokens=num_tokens, config=dataclasses.asdict(first_aligned), graph_us=us))
        print(f"  T={num_tokens} aligned path {us:.1f} us with {first_aligned}", flush=True)
    print(f"sweep T={num_tokens}: chosen {rows[0]['graph_us']:.1f} us, best {best_us:.1f} us with {best}", flush=True)
    return rows


GRID = dict(gate_up_block_n=(2,), gate_up_block_k=(2048,), down_block_n=(1, 2, 4, 8), down_block_k=(256, 512, 1024),
            num_warps=(4, 8))
"""The direct path's tiles that ``--grid`` times in every combination: the down kernel's rows and K tile
(1024 holds the Qwen3-30B-A3B expert width 768 in one round; 256 walks it in three) with the gate/up
tile the last full grid chose (2 x 2048, best of 2-16 rows x 256-2048 columns; bench/RESULTS.md)."""


def grid(num_tokens: int, top: int = 12, **shape) -> list[dict]:
    """Every combination of :data:`GRID` on the direct path (graph replay, as :func:`sweep`), where
    a coordinate sweep can miss pairs that only pay together (narrow rows with a whole-K tile).
    Prints the ``top`` fastest; returns one row per config that ran."""
    layer = make_layer(num_tokens, **shape)
    fused, calls = layer["fused"], layer["layers"]
    base = MoEConfig(**layer["row"]["config"])
    rows = []
    for values in itertools.product(*GRID.values()):
        cfg = dataclasses.replace(base, direct=True, num_stages=1, **dict(zip(GRID, values)))
        try:
            us = graph_time_us(lambda i: fused(i, cfg), calls)
        except Exception as exc:  # e.g. out of registers or shared memory for a large tile
            print(f"  T={num_tokens} {values}: {type(exc).__name__}", flush=True)
            torch.cuda.synchronize()
            continue
        rows.append(dict(tokens=num_tokens, config=dataclasses.asdict(cfg), graph_us=us))
    rows.sort(key=lambda r: r["graph_us"])
    for r in rows[:top]:
        c = r["config"]
        print(f"  grid T={num_tokens}: {r['graph_us']:7.1f} us  gu{c['gate_up_block_n']}x{c['gate_up_block_k']} "
              f"d{c['down_block_n']}x{c['down_block_k']} w{c['num_warps']}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="1,8,64,512")
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inter", type=int, default=768)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--layers", type=int, default=8, help="distinct weight copies (calls per graph)")
    parser.add_argument("--routings", default="random", help="comma-separated: random, one_expert, spread")
    parser.add_argument("--no-reference", action="store_true", help="skip the (slow) torch reference")
    parser.add_argument("--sweep", action="store_true", help="also sweep MoEConfig per batch size")
    parser.add_argument("--breakdown", action="store_true", help="also print each kernel's device time")
    parser.add_argument("--grid", action="store_true", help="also time every combination of the direct tiles (GRID)")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or not kernels.triton_importable():
        print("moe_bench needs CUDA and triton", file=sys.stderr)
        return 2
    shape = dict(num_experts=args.experts, top_k=args.top_k, hidden=args.hidden, inter=args.inter,
                 dtype=getattr(torch, args.dtype), layers=args.layers)
    rows = []
    with torch.inference_mode():
        for num_tokens in (int(b) for b in args.batch_sizes.split(",")):
            for routing in args.routings.split(","):
                rows.append(bench_moe(num_tokens, routing=routing, reference=not args.no_reference, **shape))
            if args.breakdown:
                breakdown(num_tokens, **shape)
            if args.sweep:
                rows += sweep(num_tokens, **shape)
            if args.grid:
                rows += grid(num_tokens, **shape)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rows, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
