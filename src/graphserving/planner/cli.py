"""``graphserving plan-buckets``: choose capture sizes from a batch-size histogram.

Exit status: 0 on success, 2 on bad input (one line on stderr naming the problem).
"""

from __future__ import annotations

import argparse
import json
import re
import sys

from graphserving.contract.graph_policy import GraphMode
from graphserving.planner.cost_model import AnalyticCostModel, CostModelError, MeasuredCostModel
from graphserving.planner.histogram import (
    BatchSizeHistogram,
    HistogramError,
    from_batch_sizes,
    load_csv,
    parse_prometheus_text,
    read_text,
    scrape_prometheus,
)
from graphserving.planner.optimize import Budget, PlanError, plan_capture_sizes
from graphserving.planner.report import BaselineError, baseline_sizes, format_table, plan_report, plot
from graphserving.planner.traces import TraceError, load_csv_trace, simulate_decode_batches

_BINARY_SUFFIXES = {"": 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}
_DECIMAL_SUFFIXES = {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


class UsageError(ValueError):
    """A command-line value the planner cannot use."""


def parse_bytes(text: str) -> float:
    """Bytes from a plain number or a Kubernetes-style quantity (``512Mi``, ``1.5Gi``, ``2G``).

    Raises:
        UsageError: not a non-negative quantity.
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]i|[kMGT])?\s*", text)
    if not match:
        raise UsageError(f"--max-graph-memory must be bytes or a quantity like 512Mi or 2Gi, got {text!r}")
    number, suffix = float(match.group(1)), match.group(2) or ""
    return number * (_BINARY_SUFFIXES.get(suffix) or _DECIMAL_SUFFIXES[suffix])


def add_plan_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``plan-buckets`` on the ``graphserving`` command."""
    parser = subparsers.add_parser(
        "plan-buckets",
        help="choose capture sizes from a batch-size histogram",
        description=(
            "Choose the capture-size list minimising expected step time plus lambda times graph "
            "memory (GiB), within a budget; always includes the maximum. Prints a table, or JSON."
        ),
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--histogram", metavar="FILE", help="CSV with header batch_size,count")
    source.add_argument(
        "--trace", metavar="FILE", help="CSV trace (timestamp,input_tokens,output_tokens); simulated into decode batches"
    )
    source.add_argument(
        "--prometheus", metavar="URL|FILE", help="a worker's /metrics URL, or a file of Prometheus text"
    )
    parser.add_argument("--metric", help="Prometheus histogram name (default: the one named *batch_size*)")
    parser.add_argument(
        "--label", action="append", default=[], metavar="KEY=VALUE", help="only Prometheus series with this label"
    )
    parser.add_argument("--max-graphs", type=int, metavar="N", help="most capture sizes (>= 1)")
    parser.add_argument("--max-graph-memory", metavar="BYTES", help="most summed graph memory (bytes, or 512Mi, 2Gi)")
    parser.add_argument("--max-capture-seconds", type=float, metavar="S", help="most summed capture time")
    parser.add_argument("--lambda", dest="lam", type=float, default=0.0, metavar="X",
                        help="weight of graph memory in GiB, in step-time units per GiB (default 0)")
    parser.add_argument("--maximum", type=int, metavar="M",
                        help="largest capture size, e.g. max_num_seqs (default: largest observed batch size)")
    parser.add_argument("--cost-model", metavar="FILE",
                        help="measured cost model JSON (schema graphserving.cost-model/v1); default: analytic")
    parser.add_argument("--baseline", action="append", metavar="vllm|sglang|LIST",
                        help="list to compare against; repeatable (default: vllm)")
    parser.add_argument("--plot", metavar="OUT.png", help="write a PNG of the histogram, buckets and padding")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.set_defaults(func=run_plan)
    return parser


def _histogram(args: argparse.Namespace) -> BatchSizeHistogram:
    labels = {}
    for item in args.label:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--label must be KEY=VALUE, got {item!r}")
        labels[key] = value
    if args.histogram:
        return load_csv(args.histogram)
    if args.trace:
        max_num_seqs = args.maximum or 256
        return from_batch_sizes(simulate_decode_batches(load_csv_trace(args.trace), max_num_seqs=max_num_seqs))
    if re.match(r"https?://", args.prometheus):
        return scrape_prometheus(args.prometheus, args.metric, labels)
    return parse_prometheus_text(read_text(args.prometheus, "Prometheus text file"), args.metric, labels)


def run_plan(args: argparse.Namespace) -> int:
    try:
        if args.max_graphs is not None and args.max_graphs < 1:
            raise UsageError(f"--max-graphs must be >= 1 (the maximum is always captured), got {args.max_graphs}")
        if args.maximum is not None and args.maximum < 1:
            raise UsageError(f"--maximum must be >= 1, got {args.maximum}")
        memory = parse_bytes(args.max_graph_memory) if args.max_graph_memory is not None else None
        histogram = _histogram(args)
        model = MeasuredCostModel.from_json(args.cost_model) if args.cost_model else AnalyticCostModel()
        budget = Budget(args.max_graphs, memory, args.max_capture_seconds)
        plan = plan_capture_sizes(histogram, model, budget=budget, lam=args.lam, maximum=args.maximum)
        baselines = [baseline_sizes(spec, plan.maximum) for spec in (args.baseline or ["vllm"])]
        report = plan_report(plan, histogram, model, baselines)
        if args.plot:
            try:
                plot(histogram, report, args.plot)
            except OSError as exc:
                raise UsageError(f"cannot write --plot {args.plot!r}: {exc.strerror or exc}") from None
    except (UsageError, HistogramError, CostModelError, PlanError, BaselineError, TraceError) as exc:
        print(f"plan-buckets: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_table(report))
    return 0


def add_replay_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``replay-trace`` on the ``graphserving`` command (see planner/replay.py)."""
    parser = subparsers.add_parser(
        "replay-trace",
        help="replay a request trace through the real scheduler and graph dispatcher (no model)",
        description=(
            "Replay a CSV request trace (timestamp,input_tokens,output_tokens) through the worker's "
            "scheduler, block manager and graph dispatch on a simulated clock costed by T(key). Reports "
            "bucket hits, padding, full/piecewise/eager shares with fallback reasons, graph memory, "
            "dispatch overhead, iteration time, TTFT and TPOT. Prints a table, or JSON."
        ),
    )
    parser.add_argument("--trace", required=True, metavar="FILE", help="CSV trace (see docs/planner.md)")
    sizes = parser.add_mutually_exclusive_group()
    sizes.add_argument("--capture-sizes", default="vllm", metavar="vllm|auto|LIST",
                       help="full-graph capture sizes: vllm (the default grid), auto (planned from this trace's "
                            "decode batch sizes at no more graphs and graph memory than vllm), or 1,2,4,...")
    sizes.add_argument("--compare", metavar="NAMES",
                       help="replay side by side with several lists, e.g. vllm,auto or vllm,auto,1,3,8")
    parser.add_argument("--piecewise-capture-sizes", default="default", metavar="default|LIST",
                        help="piecewise capture sizes in tokens (default: powers of two up to max-num-batched-tokens)")
    parser.add_argument("--mode", default=GraphMode.FULL_AND_PIECEWISE.value, choices=[m.value for m in GraphMode])
    parser.add_argument("--max-num-seqs", type=int, default=64, metavar="N", help="(default 64, as the worker)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048, metavar="N",
                        help="(default 2048, as the worker)")
    parser.add_argument("--num-kv-blocks", type=int, metavar="N",
                        help="KV-cache blocks (default: max-num-seqs of the longest request, so nothing is preempted)")
    parser.add_argument("--block-size", type=int, default=16, metavar="N", help="tokens per KV block (default 16)")
    parser.add_argument("--cost-model", metavar="FILE",
                        help="measured cost model JSON (graphserving.cost-model/v1); default: analytic, "
                             "8 ms + 20 us per computed row")
    parser.add_argument("--max-requests", type=int, metavar="N", help="replay only the first N requests")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.set_defaults(func=run_replay)
    return parser


def run_replay(args: argparse.Namespace) -> int:
    from graphserving.planner import replay

    try:
        trace = load_csv_trace(args.trace)
        if args.max_requests is not None:
            if args.max_requests < 1:
                raise UsageError(f"--max-requests must be >= 1, got {args.max_requests}")
            trace = trace[: args.max_requests]
        model = MeasuredCostModel.from_json(args.cost_model) if args.cost_model else replay.AnalyticStepCost()
        name = f"measured ({args.cost_model})" if args.cost_model else "analytic (8 ms + 20 us/row)"
        piecewise = (
            None if args.piecewise_capture_sizes.strip().lower() == "default"
            else replay.parse_sizes(args.piecewise_capture_sizes, "--piecewise-capture-sizes")
        )
        common = dict(mode=GraphMode(args.mode), piecewise_capture_sizes=piecewise, max_num_seqs=args.max_num_seqs,
                      max_num_batched_tokens=args.max_num_batched_tokens, num_kv_blocks=args.num_kv_blocks,
                      block_size=args.block_size)
        if args.compare:
            names = _split_compare(args.compare)
            if not names:
                raise UsageError(f"--compare needs at least one list (vllm, auto or 1,2,4,...), got {args.compare!r}")
            results = replay.compare(trace, names, model, cost_model_name=name, **common)
        else:
            spec = args.capture_sizes.strip().lower()
            if spec in ("vllm", "auto"):
                results = replay.compare(trace, [spec], model, cost_model_name=name, **common)
            else:
                sizes = replay.parse_sizes(args.capture_sizes, "--capture-sizes")
                cfg = replay.make_config(trace, capture_sizes=sizes, **common)
                results = {"replay": replay.replay_trace(trace, cfg, model, cost_model_name=name)}
    except (UsageError, TraceError, CostModelError, PlanError, replay.ReplayError) as exc:
        print(f"replay-trace: {exc}", file=sys.stderr)
        return 2
    reports = {n: r.to_json() for n, r in results.items()}
    if args.compare:
        out: dict = {"runs": reports, "comparison": _comparison(reports)}
        text = replay.format_comparison(reports)
    else:
        out = next(iter(reports.values()))
        text = replay.format_report(out)
    print(json.dumps(out, indent=2) if args.json else text)
    return 0


def _split_compare(text: str) -> list[str]:
    """``vllm,auto,1,2,8`` -> ``["vllm", "auto", "1,2,8"]``: names split on commas, a run of
    integers stays one explicit list."""
    names: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if part.isdigit() and names and names[-1].replace(",", "").isdigit():
            names[-1] += "," + part
        else:
            names.append(part)
    return names


def _comparison(reports: dict[str, dict]) -> dict:
    """Each run against the first: graphs, graph memory, padded rows of full graphs and their reduction."""
    first_name, first = next(iter(reports.items()))
    out = {"baseline": first_name}
    for name, r in reports.items():
        base_padded = first["padded_rows_by_mode"]["full"]
        padded = r["padded_rows_by_mode"]["full"]
        out[name] = {
            "num_full_graphs": r["config"]["num_full_graphs"],
            "full_graph_memory_bytes": r["graph_memory_bytes"]["full"],
            "full_padded_rows": padded,
            "full_padded_rows_reduction": (1 - padded / base_padded) if base_padded else None,
            "tpot_p50_ratio": (r["tpot_s"]["p50"] / first["tpot_s"]["p50"])
            if r["tpot_s"]["p50"] and first["tpot_s"]["p50"] else None,
        }
    return out
