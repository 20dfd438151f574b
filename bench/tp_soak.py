"""Soak a tensor-parallel worker: steady load for a while, then SIGTERM, and say whether it hung.

Starts ``graphserving-worker --tensor-parallel-size N`` (bench/serve.py's ``SpawnedWorker``), keeps
``--concurrency`` streams of completions going for ``--duration-s`` seconds, then sends SIGTERM and
times the exit. Prints one JSON object: requests finished and failed, tokens/s, the longest gap
between two finished requests (a hang shows as a gap as long as the run), the exit status and the
seconds from SIGTERM to exit. Exit status 0 only when no request failed, no gap exceeded
``--max-gap-s`` and the worker exited 0 within ``--exit-within-s``.

Usage:
    python bench/tp_soak.py --model preset:llama-3-8b --tensor-parallel-size 2 --duration-s 540
    python bench/tp_soak.py --model DIR --device cpu --duration-s 20   # the mechanics, on the CPU
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import SpawnedWorker  # noqa: E402  (bench/serve.py: the spawned worker and its readiness wait)


async def load(url: str, model: str, concurrency: int, duration_s: float, max_tokens: int) -> dict:
    """``concurrency`` loops of one completion after another until ``duration_s`` has passed."""
    finished: list[float] = []
    failures: list[str] = []
    tokens = 0
    deadline = time.monotonic() + duration_s

    async def one_loop(client: httpx.AsyncClient, i: int) -> None:
        nonlocal tokens
        n = 0
        while time.monotonic() < deadline:
            n += 1
            try:
                r = await client.post("/v1/completions", json={
                    "model": model, "prompt": f"request {i}-{n}: count on from {n},", "max_tokens": max_tokens,
                    "temperature": 0.7, "seed": i * 100003 + n, "ignore_eos": True})
            except httpx.HTTPError as exc:
                failures.append(f"{type(exc).__name__}: {exc}")
                continue
            if r.status_code != 200:
                failures.append(f"{r.status_code}: {r.text[:200]}")
                continue
            tokens += r.json()["usage"]["completion_tokens"]
            finished.append(time.monotonic())

    start = time.monotonic()
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(120.0)) as client:
        await asyncio.gather(*(one_loop(client, i) for i in range(concurrency)))
    elapsed = time.monotonic() - start
    marks = [start, *sorted(finished)]
    return dict(requests=len(finished), failed=len(failures), first_failures=failures[:5], tokens=tokens,
                seconds=elapsed, tokens_per_s=tokens / elapsed if elapsed else 0.0,
                longest_gap_s=max(b - a for a, b in zip(marks, marks[1:])) if finished else elapsed)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--tensor-parallel-size", type=int, default=2)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--duration-s", type=float, default=540.0)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-gap-s", type=float, default=30.0)
    p.add_argument("--exit-within-s", type=float, default=60.0)
    p.add_argument("--worker-arg", action="append", default=[], help="one more worker flag (repeatable)")
    p.add_argument("--log", default="tp-soak-worker.log")
    p.add_argument("--json-out")
    args = p.parse_args(argv)
    worker_args = ["--tensor-parallel-size", str(args.tensor_parallel_size), "--device", args.device,
                   "--served-model-name", "soak", "--allow-degraded", "--shutdown-delay-seconds", "0",
                   "--drain-seconds", "10", *[a for arg in args.worker_arg for a in arg.split()]]
    worker = SpawnedWorker(args.model, worker_args, Path(args.log), startup_timeout_s=900)
    with worker:
        result = asyncio.run(load(worker.url, "soak", args.concurrency, args.duration_s, args.max_tokens))
        stopped = time.monotonic()
        worker.proc.send_signal(signal.SIGTERM)
        try:
            code = worker.proc.wait(timeout=args.exit_within_s)
        except Exception:  # subprocess.TimeoutExpired: the hang this checks for
            code = None
        result.update(exit_status=code, exit_seconds=time.monotonic() - stopped,
                      tensor_parallel_size=args.tensor_parallel_size, startup_s=worker.ready_info.get("startup_s"))
    print(json.dumps(result, indent=2))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2))
    ok = result["failed"] == 0 and result["longest_gap_s"] <= args.max_gap_s and code == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
