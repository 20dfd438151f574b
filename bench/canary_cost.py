"""What the online canary costs in decode throughput (issue 19: goal <= 1% at the default rate).

One worker start-up in this process (bench/serve.py ``start_worker``: load, warmup, capture, canary),
then ``LLMEngine.generate`` of fixed greedy prompts at each sample rate, the rates alternating
run by run on the same engine and graphs (only ``OnlineCanary.rate`` changes), so drift of the
machine hits every rate alike. Prints a table and, with --json-out, JSON.

    python3 bench/canary_cost.py --model SmolLM2.gguf --rates 0,0.0005,0.01,0.1 --concurrency 64,1
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


def projected_drop(rate: float, replays_per_s: float, comparison_s: float) -> float:
    """The throughput drop of sample rate ``rate``: each second of replays gains
    x = rate * replays_per_s * comparison_s seconds of comparisons, so throughput falls by x / (1 + x)."""
    added = rate * replays_per_s * comparison_s
    return added / (1 + added)


def measure(engine, runner, rates: list[float], concurrency: int, args) -> list[dict]:
    """Throughput at each rate (alternating), and what one comparison costs.

    The cost of one comparison is derived from the runs at the largest rate: (their wall seconds -
    the baseline's for as many tokens) / comparisons; the projected cost of a rate r
    (:func:`projected_drop`) resolves rates whose direct difference is within the run-to-run noise."""
    from graphserving.runtime.engine.sequence import SamplingParams

    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    prompts = fixed_prompts(concurrency, args.prompt_tokens, args.seed)
    canary = runner.online_canary
    canary.rate = 0.0
    engine.generate(prompts, params)  # warm-up
    runs: dict[float, list[float]] = {r: [] for r in rates}
    totals = {r: {"seconds": 0.0, "tokens": 0, "comparisons": 0, "replays": 0} for r in rates}
    for _ in range(args.repeats):
        for rate in rates:
            canary.rate = rate
            compared, replayed = canary.comparisons, sum(runner.stats.replays.values())
            start = time.perf_counter()
            tokens = sum(len(c[0].token_ids) for c in engine.generate(prompts, params))
            seconds = time.perf_counter() - start
            runs[rate].append(tokens / seconds)
            t = totals[rate]
            t["seconds"] += seconds
            t["tokens"] += tokens
            t["comparisons"] += canary.comparisons - compared
            t["replays"] += sum(runner.stats.replays.values()) - replayed
    base, top = totals[rates[0]], totals[max(rates)]
    per_token = base["seconds"] / base["tokens"]
    extra = top["seconds"] - per_token * top["tokens"]
    per_comparison = extra / top["comparisons"] if top["comparisons"] else None
    replays_per_s = base["replays"] / base["seconds"]
    rows = []
    for rate in rates:
        med = statistics.median(runs[rate])
        rows.append({
            "sequences": concurrency, "sample_rate": rate, "tok_s_median": round(med, 1),
            "tok_s_runs": [round(x, 1) for x in runs[rate]], "comparisons": totals[rate]["comparisons"],
            "measured_cost": round(1 - med / statistics.median(runs[rates[0]]), 4),
            "projected_cost": round(projected_drop(rate, replays_per_s, per_comparison), 4) if per_comparison else None,
            "comparison_ms": round(1e3 * per_comparison, 2) if per_comparison else None,
            "replay_step_ms": round(1e3 / replays_per_s, 3),
            "diverged": sorted(k.label() for k in runner.diverged),
        })
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="GGUF file or preset:NAME")
    p.add_argument("--rates", default="0,0.0005,0.01,0.1",
                   help="sample rates, the first is the baseline; the largest measures one comparison's cost")
    p.add_argument("--concurrency", default="64,1")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--worker-arg", action="append", default=[], help="extra worker flags (split on spaces)")
    p.add_argument("--json-out")
    args = p.parse_args()
    lifecycle = start_worker(args.model, [f for extra in args.worker_arg for f in extra.split()])
    runner = lifecycle.runner
    if runner is None or runner.online_canary is None or not runner.graphs:
        print(f"no graphs to measure: {lifecycle.readiness.reason}")
        return 1
    rates = [float(x) for x in args.rates.split(",")]
    rows = []
    for n in (int(x) for x in args.concurrency.split(",")):
        rows += measure(lifecycle.engine, runner, rates, n, args)
    print(f"{'seqs':>5} {'rate':>7} {'tok/s (median)':>15} {'measured':>9} {'projected':>9} {'compared':>9} "
          f"{'ms/compare':>10} {'ms/replay':>9}  diverged keys")
    for r in rows:
        projected = f"{100 * r['projected_cost']:.2f}%" if r["projected_cost"] is not None else "-"
        print(f"{r['sequences']:>5} {r['sample_rate']:>7} {r['tok_s_median']:>15} {100 * r['measured_cost']:>8.2f}% "
              f"{projected:>9} {r['comparisons']:>9} {r['comparison_ms'] or '-':>10} {r['replay_step_ms']:>9}  "
              f"{','.join(r['diverged']) or '-'}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"device": str(lifecycle.device), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
