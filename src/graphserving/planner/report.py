"""What a capture-size list costs on a histogram: padding, bucket hits, step time, graph costs.

Definitions (per decode step, over the batches of the histogram):

- A batch of ``B`` requests with ``B <= max(S)`` replays the graph of ``C(B)``, the smallest
  capture size >= B; it computes ``C(B)`` rows of which ``C(B) - B`` are **padded rows**.
  Larger batches (and a Prometheus histogram's overflow) are **eager fallbacks**.
- **Padding ratio** = Σ count(B)·(C(B) − B) / Σ count(B)·B over graph-served batches: padded rows
  per real row (0 means no waste; 0.25 means a quarter more rows computed than needed).
- **Hit share** of a capture size = the share of all batches (fallbacks included) that replay it.
- **Expected step time** = J without the λ term (optimize module): Σ p(B)·T(B, C(B)) plus eager
  time for fallbacks, in the cost model's time unit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from graphserving.contract.graph_policy import default_capture_sizes
from graphserving.planner.cost_model import CostModel
from graphserving.planner.histogram import BatchSizeHistogram
from graphserving.planner.optimize import Plan, objective


class BaselineError(ValueError):
    """A baseline list that cannot be read."""


@dataclass(frozen=True)
class BucketHits:
    """One capture size's share of the traffic."""

    capture_size: int
    batches: float
    hit_share: float
    real_rows: float
    padded_rows: float


@dataclass(frozen=True)
class Evaluation:
    """A capture-size list measured against a histogram (definitions in the module docstring).

    Row and batch figures are totals over the histogram's batches; ``padded_rows_per_step`` is
    their mean per batch (the padded compute each step wastes on average).
    """

    capture_sizes: list[int]
    num_graphs: int
    total_batches: float
    fallback_batches: float
    fallback_share: float
    real_rows: float
    padded_rows: float
    padding_ratio: float
    padded_rows_per_step: float
    expected_step_time: float
    time_unit: str
    graph_memory_bytes: float
    capture_seconds: float
    buckets: list[BucketHits]


def evaluate(histogram: BatchSizeHistogram, capture_sizes: Sequence[int], cost_model: CostModel) -> Evaluation:
    """Measure ``capture_sizes`` (any order; the maximum is its largest) on ``histogram``.

    Raises:
        ValueError: ``capture_sizes`` is empty.
    """
    sizes = sorted(set(capture_sizes))
    if not sizes:
        raise ValueError("capture_sizes must not be empty")
    per_size = {c: [0.0, 0.0, 0.0] for c in sizes}  # batches, real rows, padded rows
    fallback = histogram.overflow
    j = 0
    for batch, count in histogram.items():
        while j < len(sizes) and sizes[j] < batch:
            j += 1
        if j == len(sizes):
            fallback += count
            continue
        cell = per_size[sizes[j]]
        cell[0] += count
        cell[1] += count * batch
        cell[2] += count * (sizes[j] - batch)
    total = histogram.total
    real = sum(v[1] for v in per_size.values())
    padded = sum(v[2] for v in per_size.values())
    graph_batches = total - fallback
    return Evaluation(
        capture_sizes=sizes,
        num_graphs=len(sizes),
        total_batches=total,
        fallback_batches=fallback,
        fallback_share=fallback / total if total else 0.0,
        real_rows=real,
        padded_rows=padded,
        padding_ratio=padded / real if real else 0.0,
        padded_rows_per_step=padded / graph_batches if graph_batches else 0.0,
        expected_step_time=objective(histogram, sizes, cost_model, 0.0),
        time_unit=cost_model.time_unit,
        graph_memory_bytes=sum(cost_model.graph_memory_bytes(c) for c in sizes),
        capture_seconds=sum(cost_model.capture_seconds(c) for c in sizes),
        buckets=[
            BucketHits(c, v[0], v[0] / total if total else 0.0, v[1], v[2]) for c, v in per_size.items()
        ],
    )


def sglang_default_sizes(maximum: int) -> list[int]:
    """SGLang's decode grid as of 0.5 (docs/architecture.md, "Public facts behind the defaults"):
    ``[1, 2, 4, 8, 12]``, steps of 8 from 16 to 256, steps of 16 from 272 to 496, cut at
    ``maximum``, which is appended. Beyond 496 the grid continues in steps of 16 (our choice: the
    notes do not record SGLang's grid there).
    """
    grid = [1, 2, 4, 8, 12, *range(16, 257, 8), *range(272, max(maximum, 272) + 1, 16)]
    sizes = [s for s in grid if s <= maximum]
    if not sizes or sizes[-1] != maximum:
        sizes.append(maximum)
    return sizes


def baseline_sizes(spec: str, maximum: int) -> tuple[str, list[int]]:
    """A named baseline list at ``maximum``: ``vllm``, ``sglang`` or comma-separated sizes.

    An explicit list is cut at ``maximum`` and ``maximum`` is appended, as a worker would capture
    it, so every list is compared at the same maximum.

    Returns:
        (name, sizes).

    Raises:
        BaselineError: an unknown name or a list entry that is not an integer >= 1.
    """
    key = spec.strip().lower()
    if key == "vllm":
        return "vllm", default_capture_sizes(maximum)
    if key == "sglang":
        return "sglang", sglang_default_sizes(maximum)
    try:
        sizes = sorted({int(part) for part in key.split(",") if part.strip()})
    except ValueError:
        raise BaselineError(
            f"baseline must be 'vllm', 'sglang' or comma-separated integers, got {spec!r}"
        ) from None
    if not sizes or sizes[0] < 1:
        raise BaselineError(f"baseline sizes must be integers >= 1, got {spec!r}")
    sizes = [s for s in sizes if s <= maximum]
    if not sizes or sizes[-1] != maximum:
        sizes.append(maximum)
    return spec.strip(), sizes


def plan_report(
    plan: Plan,
    histogram: BatchSizeHistogram,
    cost_model: CostModel,
    baselines: Sequence[tuple[str, Sequence[int]]] = (),
) -> dict:
    """The JSON object ``plan-buckets --json`` prints.

    Keys: ``capture_sizes`` (the plan), ``maximum``, ``lambda``, ``objective``, ``method``, every
    :class:`Evaluation` field of the plan (``buckets`` as a list of objects, plus ``hit_shares``
    keyed by capture size), and ``baselines``: per name, its evaluation plus
    ``padded_rows_reduction`` (1 − plan padded rows / baseline padded rows; None when the
    baseline pads nothing) and ``step_time_ratio`` (plan / baseline expected step time).
    """
    mine = evaluate(histogram, plan.capture_sizes, cost_model)
    out: dict = {
        "capture_sizes": list(plan.capture_sizes),
        "maximum": plan.maximum,
        "lambda": plan.lam,
        "objective": plan.objective,
        "method": plan.method,
        **_evaluation_json(mine),
        "baselines": {},
    }
    for name, sizes in baselines:
        theirs = evaluate(histogram, sizes, cost_model)
        out["baselines"][name] = {
            **_evaluation_json(theirs),
            "padded_rows_reduction": (1 - mine.padded_rows / theirs.padded_rows) if theirs.padded_rows else None,
            "step_time_ratio": (mine.expected_step_time / theirs.expected_step_time)
            if theirs.expected_step_time
            else None,
        }
    return out


def _evaluation_json(evaluation: Evaluation) -> dict:
    data = asdict(evaluation)
    data["hit_shares"] = {str(b.capture_size): b.hit_share for b in evaluation.buckets}
    return data


def format_table(report: dict) -> str:
    """Plain-text tables: the plan's buckets, then the plan against each baseline."""
    unit = report["time_unit"]
    lines = [
        f"capture sizes ({report['num_graphs']}): {report['capture_sizes']}",
        f"maximum {report['maximum']}, lambda {report['lambda']}, method {report['method']}",
        "",
        f"{'capture size':>12} {'hit share':>10} {'batches':>12} {'padded rows':>12}",
    ]
    for b in report["buckets"]:
        lines.append(
            f"{b['capture_size']:>12} {b['hit_share']:>10.2%} {b['batches']:>12.6g} {b['padded_rows']:>12.6g}"
        )
    lines.append(f"{'fallback':>12} {report['fallback_share']:>10.2%} {report['fallback_batches']:>12.6g}")
    lines.append("")
    header = (
        f"{'list':<12} {'graphs':>6} {'padding ratio':>13} {'padded rows/step':>16} "
        f"{'step time (' + unit + ')':>18} {'graph mem MiB':>13} {'capture s':>9} {'padded vs plan':>14}"
    )
    lines.append(header)
    rows = [("plan", report, None)] + [(n, b, b["padded_rows_reduction"]) for n, b in report["baselines"].items()]
    for name, r, reduction in rows:
        vs = "" if reduction is None else f"-{reduction:.1%}" if reduction >= 0 else f"+{-reduction:.1%}"
        lines.append(
            f"{name[:12]:<12} {r['num_graphs']:>6} {r['padding_ratio']:>13.4f} {r['padded_rows_per_step']:>16.4f} "
            f"{r['expected_step_time']:>18.6g} {r['graph_memory_bytes'] / 2**20:>13.1f} {r['capture_seconds']:>9.2f} {vs:>14}"
        )
    if report["baselines"]:
        lines.append("(padded vs plan: the plan's padded rows relative to that list's; '-30%' = 30% less)")
    return "\n".join(lines)


def plot(
    histogram: BatchSizeHistogram,
    report: dict,
    path: str | Path,
    *,
    title: str = "Batch-size histogram and capture sizes",
) -> None:
    """Write a PNG: the histogram with the chosen capture sizes marked (top) and the padded rows
    each batch size causes under the plan and under the first baseline, if any (bottom).

    Uses matplotlib's Agg backend (no display needed). The file is a PNG whatever its suffix
    (matplotlib would otherwise pick the format from the suffix and refuse unknown ones).

    Raises:
        OSError: ``path`` cannot be written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    items = histogram.items()
    xs = [b for b, _ in items]
    counts = [c for _, c in items]

    def padded(sizes: list[int]) -> list[float]:
        out, j = [], 0
        for b, c in items:
            while j < len(sizes) and sizes[j] < b:
                j += 1
            out.append(c * (sizes[j] - b) if j < len(sizes) else 0.0)
        return out

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True)
    top.bar(xs, counts, width=1.0, color="tab:blue", label="batches")
    for i, c in enumerate(report["capture_sizes"]):
        top.axvline(c, color="tab:red", linewidth=0.8, alpha=0.7, label="capture size" if i == 0 else None)
    top.set_ylabel("batches")
    top.set_title(title)
    top.legend(loc="upper right")
    bottom.bar(xs, padded(report["capture_sizes"]), width=1.0, color="tab:red", alpha=0.8,
               label=f"plan: padding ratio {report['padding_ratio']:.3f}")
    if report["baselines"]:
        name, base = next(iter(report["baselines"].items()))
        bottom.step(xs, padded(base["capture_sizes"]), where="mid", color="black", linewidth=0.9,
                    label=f"{name}: padding ratio {base['padding_ratio']:.3f}")
    bottom.set_xlabel("batch size (requests)")
    bottom.set_ylabel("padded rows")
    bottom.legend(loc="upper right")
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110, format="png")
    finally:
        plt.close(fig)
