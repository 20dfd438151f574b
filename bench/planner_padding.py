"""Padded compute: the planner's capture sizes against vLLM's default list on the shipped traces.

    python3 bench/planner_padding.py [--maximum 256] [--json-out FILE]

For each histogram in bench/traces/*.hist.csv (written by bench/make_traces.py) the baseline is
vLLM's default grid up to the maximum (graph_policy.default_capture_sizes: [1, 2, 4], steps of 8
to 256, then 16). The planner gets the same maximum and a budget of no more graphs and no more
graph memory than the baseline (analytic memory model, 2 MiB per row) and lambda 0. Padded
compute is the padded rows summed over all decode steps (analytic T(B, C) = C). Prints a table,
then JSON. Goal (issue 8): at least 30% fewer padded rows than the baseline on every trace.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from graphserving.contract.graph_policy import default_capture_sizes
from graphserving.planner.cost_model import AnalyticCostModel
from graphserving.planner.histogram import load_csv
from graphserving.planner.optimize import Budget, plan_capture_sizes
from graphserving.planner.report import evaluate

GOAL = 0.30


def compare(path: Path, maximum: int) -> dict:
    model = AnalyticCostModel()
    histogram = load_csv(path)
    baseline_sizes = default_capture_sizes(maximum)
    baseline = evaluate(histogram, baseline_sizes, model)
    budget = Budget(max_graphs=baseline.num_graphs, max_graph_memory_bytes=baseline.graph_memory_bytes)
    plan = plan_capture_sizes(histogram, model, budget=budget, maximum=maximum)
    mine = evaluate(histogram, plan.capture_sizes, model)
    reduction = 1 - mine.padded_rows / baseline.padded_rows if baseline.padded_rows else 0.0
    return {
        "trace": path.name.removesuffix(".hist.csv"),
        "decode_steps": histogram.total,
        "maximum": maximum,
        "baseline": {"name": "vllm", "capture_sizes": baseline_sizes, "num_graphs": baseline.num_graphs,
                     "graph_memory_bytes": baseline.graph_memory_bytes, "padded_rows": baseline.padded_rows,
                     "padding_ratio": baseline.padding_ratio},
        "plan": {"capture_sizes": plan.capture_sizes, "num_graphs": mine.num_graphs, "method": plan.method,
                 "graph_memory_bytes": mine.graph_memory_bytes, "padded_rows": mine.padded_rows,
                 "padding_ratio": mine.padding_ratio},
        "padded_rows_reduction": reduction,
        "meets_goal": reduction >= GOAL
        and mine.num_graphs <= baseline.num_graphs
        and mine.graph_memory_bytes <= baseline.graph_memory_bytes * (1 + 1e-9),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", default=str(Path(__file__).parent / "traces"))
    parser.add_argument("--maximum", type=int, default=256, help="max_num_seqs (largest capture size)")
    parser.add_argument("--json-out", help="also write the JSON here")
    args = parser.parse_args()
    rows = [compare(p, args.maximum) for p in sorted(Path(args.traces).glob("*.hist.csv"))]
    print(f"{'trace':<10} {'steps':>7} {'graphs v/p':>10} {'graph MiB v/p':>15} "
          f"{'padded rows vllm':>16} {'padded rows plan':>16} {'ratio v/p':>15} {'reduction':>9}")
    for r in rows:
        b, p = r["baseline"], r["plan"]
        print(f"{r['trace']:<10} {int(r['decode_steps']):>7} {b['num_graphs']:>4}/{p['num_graphs']:<5} "
              f"{b['graph_memory_bytes'] / 2**20:>7.0f}/{p['graph_memory_bytes'] / 2**20:<7.0f} "
              f"{b['padded_rows']:>16.0f} {p['padded_rows']:>16.0f} "
              f"{b['padding_ratio']:>7.4f}/{p['padding_ratio']:<7.4f} {r['padded_rows_reduction']:>9.1%}")
    result = {"goal_reduction": GOAL, "all_meet_goal": all(r["meets_goal"] for r in rows), "traces": rows}
    text = json.dumps(result, indent=2)
    print(text)
    if args.json_out:
        Path(args.json_out).write_text(text)


if __name__ == "__main__":
    main()
