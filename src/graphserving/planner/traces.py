"""Request traces: synthetic generation, CSV loading, and a decode batch-size simulation.

A trace is a list of :class:`TraceRequest` (arrival time, prompt tokens, output tokens), sorted
by arrival. Sources:

- :func:`synthetic_trace`: Poisson arrivals (exponential inter-arrival times at ``rate_rps``)
  with log-normal prompt and output lengths, drawn from ``numpy.random.default_rng(seed)``
  (PCG64, reproducible across platforms and numpy versions). :data:`SYNTHETIC_LOADS` names the
  loads shipped under ``bench/traces/``.
- :func:`load_csv_trace`: CSV with a header naming an arrival column (``timestamp``,
  ``arrival_time``, ``TIMESTAMP``), a prompt-length column (``input_tokens``, ``prompt_tokens``,
  ``ContextTokens``) and an output-length column (``output_tokens``, ``completion_tokens``,
  ``GeneratedTokens``); the capitalised names are those of the Azure LLM inference traces.
  Timestamps are seconds, or ISO 8601 date-times; both become seconds since the first arrival.

:func:`simulate_decode_batches` turns a trace into the decode batch sizes a continuous-batching
worker would see, for :func:`graphserving.planner.histogram.from_batch_sizes`.
"""

from __future__ import annotations

import csv
import io
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np

from graphserving.planner.histogram import read_text

TRACE_HEADER = ("timestamp", "input_tokens", "output_tokens")
_ARRIVAL = ("timestamp", "arrival_time", "arrival_s", "TIMESTAMP")
_INPUT = ("input_tokens", "prompt_tokens", "ContextTokens")
_OUTPUT = ("output_tokens", "completion_tokens", "GeneratedTokens")


class TraceError(ValueError):
    """A trace that cannot be read or generated."""


@dataclass(frozen=True)
class TraceRequest:
    """One request: arrival time in seconds from the trace start, prompt and output lengths in tokens."""

    arrival_s: float
    input_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class LengthDistribution:
    """A log-normal token length: ``round(exp(N(ln(median), sigma)))`` clipped to [1, maximum]."""

    median: float
    sigma: float
    maximum: int


@dataclass(frozen=True)
class SyntheticLoad:
    """A named synthetic load: Poisson arrivals at ``rate_rps`` requests per second."""

    name: str
    rate_rps: float
    num_requests: int
    seed: int


# Prompt and output lengths loosely follow chat traffic: prompts with a median of 256 tokens and
# a heavy tail, outputs with a median of 128 tokens.
PROMPT_LENGTHS = LengthDistribution(median=256, sigma=1.0, maximum=4096)
OUTPUT_LENGTHS = LengthDistribution(median=128, sigma=0.8, maximum=1024)

# Rates chosen so that the simulated decode concurrency (StepTimeModel defaults, max_num_seqs
# 256) sits around 6, 45 and 200 requests: a nearly idle, a moderate and a busy worker.
SYNTHETIC_LOADS: tuple[SyntheticLoad, ...] = (
    SyntheticLoad("low", rate_rps=4.0, num_requests=1500, seed=101),
    SyntheticLoad("moderate", rate_rps=30.0, num_requests=4000, seed=202),
    SyntheticLoad("high", rate_rps=100.0, num_requests=6000, seed=303),
)


def _lengths(rng: np.random.Generator, dist: LengthDistribution, n: int) -> np.ndarray:
    draws = rng.lognormal(mean=math.log(dist.median), sigma=dist.sigma, size=n)
    return np.clip(np.rint(draws), 1, dist.maximum).astype(int)


def synthetic_trace(
    rate_rps: float,
    num_requests: int,
    seed: int,
    *,
    prompt: LengthDistribution = PROMPT_LENGTHS,
    output: LengthDistribution = OUTPUT_LENGTHS,
) -> list[TraceRequest]:
    """Poisson arrivals with log-normal lengths; the same seed gives the same trace.

    Draw order (part of the reproducibility contract): all inter-arrival gaps, then all prompt
    lengths, then all output lengths. The first request arrives at 0 s; the first gap is drawn
    and discarded, so request ``i`` arrives after the sum of gaps 1..i.

    Raises:
        TraceError: ``rate_rps`` <= 0 or ``num_requests`` < 1.
    """
    if not rate_rps > 0:
        raise TraceError(f"rate_rps must be > 0, got {rate_rps}")
    if num_requests < 1:
        raise TraceError(f"num_requests must be >= 1, got {num_requests}")
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate_rps, size=num_requests)
    arrivals = np.cumsum(gaps) - gaps[0]
    prompts = _lengths(rng, prompt, num_requests)
    outputs = _lengths(rng, output, num_requests)
    return [
        TraceRequest(round(float(t), 6), int(p), int(o)) for t, p, o in zip(arrivals, prompts, outputs)
    ]


def trace_to_csv(trace: Sequence[TraceRequest]) -> str:
    """CSV text with header ``timestamp,input_tokens,output_tokens`` (timestamp in seconds)."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(TRACE_HEADER)
    for r in trace:
        writer.writerow((f"{r.arrival_s:.6f}", r.input_tokens, r.output_tokens))
    return out.getvalue()


def _pick(header: list[str], names: tuple[str, ...], what: str, source: str) -> int:
    for name in names:
        if name in header:
            return header.index(name)
    raise TraceError(f"{source}: no {what} column; expected one of {list(names)}, got header {header}")


def _seconds(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        pass
    # ISO 8601; Azure traces carry 7 fractional digits, datetime accepts at most 6.
    head, dot, frac = text.partition(".")
    if dot:
        digits = "".join(ch for ch in frac if ch.isdigit())
        text = f"{head}.{digits[:6]}{frac[len(digits):]}"
    return datetime.fromisoformat(text).timestamp()


def parse_csv_trace(text: str, *, source: str = "trace") -> list[TraceRequest]:
    """Parse CSV trace text (column names in the module docstring); sorted by arrival.

    Raises:
        TraceError: a missing column, an unparsable value, a timestamp that is not finite (NaN or
            infinite arrivals can never be reached by a simulated clock), or a token count < 0
            (prompt) or < 1 (output); the message names the line.
    """
    rows = [r for r in csv.reader(io.StringIO(text)) if any(c.strip() for c in r)]
    if not rows:
        raise TraceError(f"{source}: empty trace")
    header = [c.strip() for c in rows[0]]
    ia, ii, io_ = (_pick(header, n, w, source) for n, w in ((_ARRIVAL, "arrival"), (_INPUT, "input-token"), (_OUTPUT, "output-token")))
    parsed: list[tuple[float, int, int]] = []
    for line_no, row in enumerate(rows[1:], start=2):
        try:
            t = _seconds(row[ia].strip())
            p = int(row[ii])
            o = int(row[io_])
        except (ValueError, IndexError) as exc:
            raise TraceError(f"{source}: line {line_no}: cannot parse {row!r}: {exc}") from None
        if not math.isfinite(t):
            raise TraceError(f"{source}: line {line_no}: timestamp must be a finite number, got {row[ia].strip()!r}")
        if p < 0 or o < 1:
            raise TraceError(
                f"{source}: line {line_no}: input tokens must be >= 0 and output tokens >= 1, got {p} and {o}"
            )
        parsed.append((t, p, o))
    if not parsed:
        raise TraceError(f"{source}: no requests after the header")
    start = min(t for t, _, _ in parsed)
    return sorted((TraceRequest(t - start, p, o) for t, p, o in parsed), key=lambda r: r.arrival_s)


def load_csv_trace(path: str | Path) -> list[TraceRequest]:
    """Read a CSV trace file (see :func:`parse_csv_trace`).

    The file is UTF-8 text; a leading byte-order mark (spreadsheet exports) is skipped.

    Raises:
        TraceError: unreadable file, not UTF-8 text, or bad content.
    """
    return parse_csv_trace(read_text(path, "trace", TraceError), source=str(path))


@dataclass(frozen=True)
class StepTimeModel:
    """Duration of one simulated step, seconds:
    ``base_s + per_decode_s · decode rows + per_prefill_token_s · prompt tokens admitted``.

    Defaults sketch a small model on a data-centre GPU (8 ms floor, 20 µs per decode row, 20 µs
    per prompt token); only the shape of the resulting histogram depends on them.
    """

    base_s: float = 0.008
    per_decode_s: float = 20e-6
    per_prefill_token_s: float = 20e-6

    def __call__(self, decode_rows: int, prefill_tokens: int) -> float:
        return self.base_s + self.per_decode_s * decode_rows + self.per_prefill_token_s * prefill_tokens


def simulate_decode_batches(
    trace: Sequence[TraceRequest],
    *,
    max_num_seqs: int = 256,
    step_time: StepTimeModel = StepTimeModel(),
) -> list[int]:
    """Decode batch sizes, one per step, of a simple continuous-batching worker serving ``trace``.

    The simulation: steps run back to back. At the start of a step, requests that have arrived
    join the running set first come first served while fewer than ``max_num_seqs`` run. A newly
    joined request is prefilled in that step (its first output token); every request already
    running decodes one token. The step's decode batch size is the number of decoding requests
    (recorded when > 0), its duration ``step_time(decode rows, prompt tokens admitted)``. A
    request leaves after its last output token. When nothing runs, time jumps to the next
    arrival. KV-cache capacity, chunked prefill and preemption are not modelled (the real
    scheduler's replay is ``graphserving replay-trace``).

    Returns:
        Decode batch sizes (requests), in step order, each in [1, max_num_seqs].

    Raises:
        TraceError: ``max_num_seqs`` < 1.
    """
    if max_num_seqs < 1:
        raise TraceError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    pending = deque(sorted(trace, key=lambda r: r.arrival_s))
    running: list[int] = []  # remaining output tokens of decoding requests
    batches: list[int] = []
    now = 0.0
    while pending or running:
        if not running and pending and pending[0].arrival_s > now:
            now = pending[0].arrival_s
        admitted_tokens = 0
        joined: list[int] = []
        while pending and pending[0].arrival_s <= now and len(running) + len(joined) < max_num_seqs:
            request = pending.popleft()
            admitted_tokens += request.input_tokens
            if request.output_tokens > 1:
                joined.append(request.output_tokens - 1)
        decode_rows = len(running)
        if decode_rows:
            batches.append(decode_rows)
        now += step_time(decode_rows, admitted_tokens)
        running = [left - 1 for left in running if left > 1] + joined
    return batches
