"""What structured output costs in decode throughput, on the worker's engine (no HTTP).

One worker start-up in this process (bench/serve.py ``start_worker``: load, warmup, capture,
canary), then ``LLMEngine.generate`` of fixed prompts, greedy, every choice running to
``--new-tokens``: the grammar is a regular expression that never completes (``[a-z ,.]+``) and
``min_tokens`` holds the end of sequence back, so a constrained choice is as long as a free one.
Three batches at each concurrency, alternating run by run:

- ``free``: no grammar (multi-step decoding as configured);
- ``all``: every sequence constrained (one decode step per launch, every row's mask filled on the
  host while the device runs the forward pass: runtime/engine/model_runner.py ``with_grammar_mask``);
- ``one``: one constrained sequence among unconstrained ones (the whole batch steps singly).

Prints a table (median output tok/s, the drop against ``free``, ms per engine step) and, with
--json-out, JSON.

    python3 bench/structured_cost.py --model preset:smollm2-135m --concurrency 64,8,1
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve import fixed_prompts, start_worker  # noqa: E402

OPEN_ENDED = "[a-z ,.]+"


def batches(n: int, new_tokens: int) -> dict[str, list]:
    from graphserving.runtime.engine.sequence import SamplingParams, StructuredOutput

    free = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=new_tokens, min_tokens=new_tokens, temperature=0.0, ignore_eos=True,
                                 structured=StructuredOutput("regex", OPEN_ENDED))
    out = {"free": [free] * n, "all": [constrained] * n}
    if n > 1:
        out["one"] = [constrained] + [free] * (n - 1)
    return out


def measure(engine, n: int, args) -> list[dict]:
    prompts = fixed_prompts(n, args.prompt_tokens, args.seed)
    kinds = batches(n, args.new_tokens)
    runs: dict[str, list[tuple[float, int]]] = {k: [] for k in kinds}
    for params in kinds.values():
        engine.generate(prompts, params)  # warm-up (compiles the grammar once)
    for _ in range(args.repeats):
        for kind, params in kinds.items():
            start = time.perf_counter()
            tokens = sum(len(c[0].token_ids) for c in engine.generate(prompts, params))
            runs[kind].append((time.perf_counter() - start, tokens))
    base = statistics.median(t / s for s, t in runs["free"])
    rows = []
    for kind, r in runs.items():
        tok_s = statistics.median(t / s for s, t in r)
        step_ms = statistics.median(s / (t / n) for s, t in r) * 1e3  # one token per sequence per step
        rows.append({"sequences": n, "batch": kind, "tok_s_median": round(tok_s, 1),
                     "drop_vs_free": round(1 - tok_s / base, 4), "ms_per_token_step": round(step_ms, 3),
                     "runs": [round(t / s, 1) for s, t in r]})
    return rows


def profile(engine, n: int, args) -> int:
    import cProfile
    import pstats

    prompts = fixed_prompts(n, args.prompt_tokens, args.seed)
    params = batches(n, args.new_tokens)["all"]
    engine.generate(prompts, params)  # warm-up
    prof = cProfile.Profile()
    start = time.perf_counter()
    prof.enable()
    tokens = sum(len(c[0].token_ids) for c in engine.generate(prompts, params))
    prof.disable()
    print(f"{n} constrained sequences: {tokens / (time.perf_counter() - start):.1f} tok/s under the profiler")
    pstats.Stats(prof).sort_stats("tottime").print_stats(30)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="GGUF file or preset:NAME")
    p.add_argument("--concurrency", default="64,8,1")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--worker-arg", action="append", default=[], help="extra worker flags (split on spaces)")
    p.add_argument("--json-out")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="instead: profile the all-constrained batch of N sequences (cProfile, top 30 by own time)")
    args = p.parse_args()
    lifecycle = start_worker(args.model, [f for extra in args.worker_arg for f in extra.split()])
    if args.profile:
        return profile(lifecycle.engine, args.profile, args)
    rows = []
    for n in (int(x) for x in args.concurrency.split(",")):
        rows += measure(lifecycle.engine, n, args)
    print(f"{'seqs':>5} {'batch':>6} {'tok/s (median)':>15} {'drop':>7} {'ms/step':>8}")
    for r in rows:
        print(f"{r['sequences']:>5} {r['batch']:>6} {r['tok_s_median']:>15} {100 * r['drop_vs_free']:>6.1f}% "
              f"{r['ms_per_token_step']:>8}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"device": str(lifecycle.device), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
