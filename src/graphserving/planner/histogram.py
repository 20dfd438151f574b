"""Batch-size histograms: how often each decode batch size occurs.

A histogram is the planner's p(B) (docs/architecture.md, "Capture-size planner"). It comes from one of three places:

- a CSV file with header ``batch_size,count`` (:func:`load_csv`), the format
  ``graphserving plan-buckets --histogram`` reads and ``bench/make_traces.py`` writes;
- a list of observed batch sizes, e.g. from a trace simulation (:func:`from_batch_sizes`);
- the workers' Prometheus batch-size histogram (:func:`parse_prometheus_text`,
  :func:`scrape_prometheus`): cumulative ``<name>_bucket{le="..."}`` series are turned into
  per-bucket counts.
"""

from __future__ import annotations

import csv
import http.client
import io
import math
import urllib.request
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

CSV_HEADER = ("batch_size", "count")


class HistogramError(ValueError):
    """A histogram source that cannot be read as batch-size counts."""


@dataclass(frozen=True)
class BatchSizeHistogram:
    """Counts of decode batches by batch size (in requests).

    Attributes:
        counts: ``{batch_size: count}``; sizes >= 1, counts >= 0 (floats allowed, so that rates
            and scraped counter values fit); sorted by size.
        overflow: batches whose size is unknown but larger than every size in ``counts`` (a
            Prometheus ``+Inf`` bucket above the last finite bound). The planner counts them as
            eager fallbacks.
    """

    counts: Mapping[int, float]
    overflow: float = 0.0
    _sorted: tuple[tuple[int, float], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for size, count in self.counts.items():
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise HistogramError(f"batch_size must be an integer >= 1, got {size!r}")
            if not math.isfinite(count) or count < 0:
                raise HistogramError(f"count for batch_size {size} must be finite and >= 0, got {count!r}")
        if not math.isfinite(self.overflow) or self.overflow < 0:
            raise HistogramError(f"overflow count must be finite and >= 0, got {self.overflow!r}")
        items = tuple(sorted((s, float(c)) for s, c in self.counts.items() if c > 0))
        object.__setattr__(self, "counts", dict(items))
        object.__setattr__(self, "_sorted", items)

    @property
    def sizes(self) -> list[int]:
        """Observed batch sizes (count > 0), ascending."""
        return [s for s, _ in self._sorted]

    @property
    def total(self) -> float:
        """All batches, overflow included."""
        return sum(c for _, c in self._sorted) + self.overflow

    @property
    def max_size(self) -> int:
        """The largest observed batch size.

        Raises:
            HistogramError: the histogram is empty.
        """
        if not self._sorted:
            raise HistogramError("the histogram is empty: no batch size has a count > 0")
        return self._sorted[-1][0]

    def items(self) -> list[tuple[int, float]]:
        """``(batch_size, count)`` pairs with count > 0, ascending by size."""
        return list(self._sorted)

    def to_csv(self) -> str:
        """The histogram as CSV text with header ``batch_size,count`` (overflow not included)."""
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(CSV_HEADER)
        for size, count in self._sorted:
            writer.writerow((size, int(count) if float(count).is_integer() else count))
        return out.getvalue()


def from_batch_sizes(batch_sizes: Iterable[int]) -> BatchSizeHistogram:
    """A histogram counting each observed batch size once per occurrence.

    Raises:
        HistogramError: a batch size is not an integer >= 1.
    """
    return BatchSizeHistogram(dict(Counter(batch_sizes)))


def parse_csv(text: str, *, source: str = "histogram") -> BatchSizeHistogram:
    """Parse CSV text with header ``batch_size,count``; repeated sizes are summed.

    Raises:
        HistogramError: missing or wrong header, a row that is not two numbers, a batch size that
            is not an integer >= 1, or a negative count. The message names the line.
    """
    rows = list(csv.reader(io.StringIO(text)))
    rows = [r for r in rows if any(cell.strip() for cell in r)]
    if not rows:
        raise HistogramError(f"{source}: empty file; expected a header 'batch_size,count'")
    header = tuple(cell.strip() for cell in rows[0])
    if header != CSV_HEADER:
        raise HistogramError(
            f"{source}: header must be 'batch_size,count', got {','.join(header)!r}"
        )
    counts: Counter[int] = Counter()
    for line_no, row in enumerate(rows[1:], start=2):
        if len(row) != 2:
            raise HistogramError(f"{source}: line {line_no}: expected 2 columns, got {len(row)}: {row!r}")
        size_text, count_text = (cell.strip() for cell in row)
        try:
            size = int(size_text)
        except ValueError:
            raise HistogramError(
                f"{source}: line {line_no}: batch_size must be an integer, got {size_text!r}"
            ) from None
        try:
            count = float(count_text)
        except ValueError:
            raise HistogramError(
                f"{source}: line {line_no}: count must be a number, got {count_text!r}"
            ) from None
        if size < 1:
            raise HistogramError(f"{source}: line {line_no}: batch_size must be >= 1, got {size}")
        if not math.isfinite(count) or count < 0:
            raise HistogramError(f"{source}: line {line_no}: count must be >= 0, got {count_text}")
        counts[size] += count
    return BatchSizeHistogram(dict(counts))


def load_csv(path: str | Path) -> BatchSizeHistogram:
    """Read a ``batch_size,count`` CSV file (see :func:`parse_csv`).

    The file is UTF-8 text; a leading byte-order mark (spreadsheet exports) is skipped.

    Raises:
        HistogramError: the file cannot be read, is not UTF-8 text, or cannot be parsed.
    """
    return parse_csv(read_text(path, "histogram file"), source=str(path))


def read_text(path: str | Path, what: str, error: type[ValueError] = HistogramError) -> str:
    """The UTF-8 text of an input file ``path`` (a leading byte-order mark skipped); ``what``
    names it in errors, raised as ``error`` (the caller's error type: traces use TraceError).

    Raises:
        HistogramError (or ``error``): the file cannot be read or is not UTF-8 text.
    """
    try:
        return Path(path).read_text(encoding="utf-8-sig")
    except OSError as exc:
        raise error(f"cannot read {what} {str(path)!r}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise error(f"{what} {str(path)!r} is not UTF-8 text: {exc.reason} at byte {exc.start}") from None


def parse_prometheus_text(
    text: str, metric: str | None = None, labels: Mapping[str, str] | None = None
) -> BatchSizeHistogram:
    """Per-bucket batch counts from a Prometheus text-format histogram.

    The text is parsed with ``prometheus_client.parser``. Series of the histogram whose labels
    match ``labels`` (all given label values equal; other labels free) are summed bucket by
    bucket, so a histogram split by a ``mode`` label, or scraped from several workers, adds up.
    Cumulative counts become per-bucket counts: ``count(le_i) - count(le_{i-1})``.

    Batch sizes are integers, so the bucket ``(le_{i-1}, le_i]`` is attributed to
    ``floor(le_i)``, its largest integer: planning for the bucket's upper bound is conservative
    (a capture size at that bound covers every batch in the bucket). Buckets whose integer range
    is empty are merged into the next one. The ``+Inf`` bucket's excess over the last finite
    bound becomes :attr:`BatchSizeHistogram.overflow`.

    Args:
        text: the exposition text (what ``GET /metrics`` returns).
        metric: the histogram's family name (without ``_bucket``); None: the only histogram
            family whose name contains ``batch_size``.
        labels: label values a series must have to be counted.

    Raises:
        HistogramError: no such histogram family, an ambiguous default, malformed text, a
            bucket without a numeric ``le``, no matching series, or counts that decrease with
            ``le``.
    """
    from prometheus_client.parser import text_string_to_metric_families

    try:
        families = [f for f in text_string_to_metric_families(text) if f.type == "histogram"]
    except ValueError as exc:
        raise HistogramError(f"malformed Prometheus text: {exc}") from None
    if metric is None:
        named = [f for f in families if "batch_size" in f.name]
        if len(named) != 1:
            raise HistogramError(
                "pass the metric name: expected exactly one histogram whose name contains "
                f"'batch_size', found {sorted(f.name for f in named) or 'none'}"
            )
        family = named[0]
    else:
        matches = [f for f in families if f.name == metric]
        if not matches:
            raise HistogramError(
                f"no histogram named {metric!r}; histograms present: {sorted(f.name for f in families)}"
            )
        family = matches[0]
    wanted = dict(labels or {})
    cumulative: dict[float, float] = {}
    for sample in family.samples:
        if not sample.name.endswith("_bucket"):
            continue
        if any(sample.labels.get(k) != v for k, v in wanted.items()):
            continue
        le_text = sample.labels.get("le")
        try:
            le = float(le_text) if le_text is not None else math.nan
        except ValueError:
            le = math.nan
        if math.isnan(le):
            raise HistogramError(
                f"histogram {family.name!r}: bucket {sample.labels} needs an 'le' label that is a number or +Inf"
            )
        cumulative[le] = cumulative.get(le, 0.0) + float(sample.value)
    if not cumulative:
        raise HistogramError(f"histogram {family.name!r} has no bucket series matching labels {wanted}")
    counts: Counter[int] = Counter()
    previous = 0.0
    pending = 0.0
    overflow = 0.0
    for le in sorted(cumulative):
        value = cumulative[le]
        if value < previous:
            raise HistogramError(
                f"histogram {family.name!r}: cumulative count decreases at le={le} ({previous} -> {value})"
            )
        delta = value - previous + pending
        previous = value
        pending = 0.0
        if math.isinf(le):
            overflow = delta
            continue
        size = math.floor(le)
        if size < 1:
            pending = delta  # no batch size fits in (prev, le]; carry it to the next bucket
            continue
        counts[size] += delta
    overflow += pending
    return BatchSizeHistogram(dict(counts), overflow=overflow)


def scrape_prometheus(
    url: str,
    metric: str | None = None,
    labels: Mapping[str, str] | None = None,
    *,
    timeout_s: float = 10.0,
) -> BatchSizeHistogram:
    """Fetch ``url`` (a worker's ``/metrics``) and parse its batch-size histogram.

    Raises:
        HistogramError: the request fails (an invalid URL, a refused or broken connection, a body
            that is not UTF-8), or see :func:`parse_prometheus_text`.
    """
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:  # noqa: S310 (operator-given URL)
            text = response.read().decode("utf-8")
    except (OSError, ValueError, http.client.HTTPException) as exc:
        # ValueError: http.client.InvalidURL (a bad port) and UnicodeDecodeError; HTTPException:
        # a truncated body (IncompleteRead) or a malformed status line.
        raise HistogramError(f"cannot scrape {url!r}: {exc}") from None
    return parse_prometheus_text(text, metric, labels)
