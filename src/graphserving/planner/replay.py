"""Trace replay: a request trace through the real scheduler, block manager and dispatcher, no model.

:func:`replay_trace` drives :class:`~graphserving.runtime.engine.scheduler.Scheduler` (over a real
:class:`~graphserving.runtime.engine.block_manager.BlockManager`) with the requests of a trace, on a
simulated clock:

1. Requests join the scheduler's waiting queue when the clock reaches their arrival time. When
   nothing is queued or running, the clock jumps to the next arrival.
2. Each step, the scheduler chooses the batch (FCFS, chunked prefill, preemption by recompute:
   exactly the worker's policy). :func:`~graphserving.runtime.graphs.key.dispatch` maps the batch
   to a FULL or PIECEWISE graph key, or to eager with a fallback reason; every configured key
   counts as captured. The wall time of the ``dispatch()`` call is measured (dispatch overhead).
3. The step costs ``T(key)`` simulated seconds (:func:`pass_seconds`) and the clock advances by
   it. Every scheduled sequence whose step reaches its last token produces one token (the first
   one ends its prefill: TTFT); a sequence finishes after its trace output length.

Latencies follow the worker's definitions (runtime/engine/metrics.py), in simulated seconds: TTFT =
arrival to the end of the step that produced the first token; TPOT = (finish - first token) /
(output tokens - 1), for requests with at least two output tokens; e2e = arrival to finish.

Padding follows the worker's graph metrics: a graph pass over ``n`` real token rows replayed in a
key of ``N`` rows pads ``N - n`` rows; padding ratio = padded rows / real rows over graph passes.

Prompt tokens are ids 0 (their values never matter without a model); a trace request with 0
prompt tokens is replayed with 1 (a sequence needs a token to start from).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence as SequenceOf
from dataclasses import asdict, dataclass, field

import numpy as np

from graphserving.contract.graph_policy import (
    GraphMode,
    default_capture_sizes,
    default_piecewise_capture_sizes,
    resolve_capture_sizes,
)
from graphserving.planner.cost_model import AnalyticCostModel, CostModel
from graphserving.planner.histogram import from_batch_sizes
from graphserving.planner.optimize import Budget, plan_capture_sizes
from graphserving.planner.traces import TraceRequest
from graphserving.runtime.engine.block_manager import BlockManager, cdiv
from graphserving.runtime.graphs.key import (
    Dispatch,
    GraphKey,
    GraphKeyContract,
    GraphRuntimeMode,
    configured_keys,
    dispatch,
)
from graphserving.runtime.engine.scheduler import Scheduler
from graphserving.runtime.engine.sequence import FinishReason, SamplingParams, Sequence

REPLAY_CONTRACT = GraphKeyContract(model_revision="trace-replay", dtype="none")
"""The key contract of replayed keys (no model is loaded; only the key shapes matter)."""


class ReplayError(ValueError):
    """A trace or configuration that cannot be replayed; the message names the value."""


@dataclass(frozen=True)
class AnalyticStepCost:
    """The replay's default cost model, in seconds, when nothing was measured.

    - Graph pass: ``T(B, C) = base_s + row_s · C`` (every padded row costs as much as a real one,
      as in the planner's :class:`~graphserving.planner.cost_model.AnalyticCostModel`, plus a
      fixed per-step floor so that simulated time is in seconds).
    - Eager pass: ``T_eager(B) = base_s + row_s · B``: no padding and no launch saving, so only
      padding separates graphs from eager here; a measured cost model (``--cost-model``) is what
      shows the launch savings.
    - Defaults (8 ms floor, 20 µs per row) are those of
      :class:`~graphserving.planner.traces.StepTimeModel`, which produced the shipped decode
      histograms, so the replay's clock matches the planner's trace simulation.
    - Graph memory and capture time: the planner's analytic defaults (2 MiB per row; 0.15 s per
      graph plus 1 ms per row).
    """

    base_s: float = 0.008
    row_s: float = 20e-6
    memory: AnalyticCostModel = field(default_factory=AnalyticCostModel)
    time_unit: str = "s"

    def step_time(self, batch_size: int, capture_size: int) -> float:
        return self.base_s + self.row_s * capture_size

    def eager_step_time(self, batch_size: int) -> float:
        return self.base_s + self.row_s * batch_size

    def graph_memory_bytes(self, capture_size: int) -> float:
        return self.memory.graph_memory_bytes(capture_size)

    def capture_seconds(self, capture_size: int) -> float:
        return self.memory.capture_seconds(capture_size)


@dataclass(frozen=True)
class ReplayConfig:
    """What one replay runs with (the worker's scheduler and graph settings).

    Attributes:
        mode: the graph mode.
        capture_sizes: resolved FULL capture sizes, requests (ascending, ending at max_num_seqs);
            ignored when the mode has no full graphs.
        piecewise_capture_sizes: resolved PIECEWISE capture sizes, tokens (ascending, ending at
            max_num_batched_tokens); ignored when the mode has no piecewise graphs.
        max_num_seqs / max_num_batched_tokens: the scheduler limits.
        num_kv_blocks: KV-cache blocks, the null block included.
        block_size: tokens per KV block.
    """

    mode: GraphMode
    capture_sizes: list[int]
    piecewise_capture_sizes: list[int]
    max_num_seqs: int
    max_num_batched_tokens: int
    num_kv_blocks: int
    block_size: int = 16

    @property
    def full_sizes(self) -> list[int]:
        return list(self.capture_sizes) if self.mode.has_full else []

    @property
    def piecewise_sizes(self) -> list[int]:
        return list(self.piecewise_capture_sizes) if self.mode.has_piecewise else []

    def keys(self) -> list[GraphKey]:
        """Every configured graph key (all count as captured in a replay), capture order."""
        return configured_keys(self.mode, self.full_sizes, self.piecewise_sizes, REPLAY_CONTRACT)


def default_num_kv_blocks(trace: SequenceOf[TraceRequest], max_num_seqs: int, block_size: int) -> int:
    """KV blocks for ``max_num_seqs`` sequences of the trace's longest request at once, plus the
    null block: a cache that never preempts (pass ``num_kv_blocks`` to model a real one)."""
    longest = max(max(r.input_tokens, 1) + r.output_tokens for r in trace)
    return max_num_seqs * cdiv(longest, block_size) + 1


def make_config(
    trace: SequenceOf[TraceRequest],
    *,
    mode: GraphMode = GraphMode.FULL_AND_PIECEWISE,
    capture_sizes: SequenceOf[int] | None = None,
    piecewise_capture_sizes: SequenceOf[int] | None = None,
    max_num_seqs: int = 64,
    max_num_batched_tokens: int = 2048,
    num_kv_blocks: int | None = None,
    block_size: int = 16,
) -> ReplayConfig:
    """A :class:`ReplayConfig` with capture sizes resolved as the worker resolves them.

    ``None`` capture sizes mean the worker's defaults (the vLLM grid up to ``max_num_seqs``; powers
    of two up to ``max_num_batched_tokens``); the maxima are always appended. Defaults of the
    limits are the worker's (``EngineLimits``: 64 sequences, 2048 tokens).

    Raises:
        ReplayError: a limit < 1, an empty trace, or a capture-size list the limits contradict.
    """
    from graphserving.contract.graph_policy import CaptureSizeError

    if not trace:
        raise ReplayError("the trace has no requests")
    for name, value in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens),
                        ("block_size", block_size)):
        if value < 1:
            raise ReplayError(f"{name} must be >= 1, got {value}")
    if num_kv_blocks is not None and num_kv_blocks < 2:
        raise ReplayError(f"num_kv_blocks must be >= 2 (block 0 is reserved), got {num_kv_blocks}")
    try:
        full = resolve_capture_sizes(
            list(capture_sizes) if capture_sizes is not None else None, max_num_seqs, what="max_num_seqs"
        )
        piece = resolve_capture_sizes(
            list(piecewise_capture_sizes) if piecewise_capture_sizes is not None else None,
            max_num_batched_tokens, what="max_num_batched_tokens", default=default_piecewise_capture_sizes,
        )
    except CaptureSizeError as exc:
        raise ReplayError(str(exc)) from None
    blocks = num_kv_blocks if num_kv_blocks is not None else default_num_kv_blocks(trace, max_num_seqs, block_size)
    return ReplayConfig(mode, full, piece, max_num_seqs, max_num_batched_tokens, blocks, block_size)


def pass_seconds(decision: Dispatch, num_tokens: int, num_reqs: int, cost_model: CostModel) -> float:
    """Simulated seconds of one forward pass, from the cost model's T.

    - FULL key of ``C`` requests: ``T(num_reqs, C)``.
    - PIECEWISE key of ``N`` tokens: ``T(num_tokens, N)``: the segments are costed as a graph of
      ``N`` rows (the eager attention between them is not costed separately).
    - Eager: ``T_eager(num_tokens)``.
    """
    key = decision.key
    if key is None:
        return cost_model.eager_step_time(num_tokens)
    if key.mode is GraphRuntimeMode.FULL:
        return cost_model.step_time(num_reqs, key.num_reqs)
    return cost_model.step_time(num_tokens, key.num_tokens)


def percentiles(values: SequenceOf[float], qs: SequenceOf[float] = (50, 90, 99)) -> dict[str, float | None]:
    """``{"p50": ..., ...}`` (numpy's linear interpolation); None for every q when ``values`` is empty."""
    if len(values) == 0:
        return {f"p{q:g}": None for q in qs}
    arr = np.asarray(values, dtype=float)
    return {f"p{q:g}": float(np.percentile(arr, q)) for q in qs}


@dataclass
class KeyHits:
    """Passes replayed in one graph key."""

    key: str
    mode: str
    passes: int = 0
    real_rows: int = 0
    padded_rows: int = 0


@dataclass
class ReplayResult:
    """Everything one replay measured; :meth:`to_json` is the report.

    Rows are token rows (a decode request is one row), as in the worker's graph metrics.
    Times are simulated seconds unless named ``*_wall_*``.
    """

    config: ReplayConfig
    cost_model: str
    time_unit: str
    num_requests: int = 0
    completed: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    preemptions: int = 0
    steps: int = 0
    simulated_seconds: float = 0.0
    passes_by_mode: Counter = field(default_factory=Counter)
    fallback_reasons: Counter = field(default_factory=Counter)
    hits: dict[str, KeyHits] = field(default_factory=dict)
    real_rows: int = 0
    padded_rows: int = 0
    eager_rows: int = 0
    decode_batch_sizes: Counter = field(default_factory=Counter)
    iteration_seconds: list[float] = field(default_factory=list, repr=False)
    dispatch_wall_seconds: list[float] = field(default_factory=list, repr=False)
    ttft_seconds: list[float] = field(default_factory=list, repr=False)
    tpot_seconds: list[float] = field(default_factory=list, repr=False)
    e2e_seconds: list[float] = field(default_factory=list, repr=False)
    graph_memory_bytes: dict[str, float] = field(default_factory=dict)
    capture_seconds: float = 0.0

    @property
    def padding_ratio(self) -> float:
        """Padded rows / real rows over graph passes (0 when nothing replayed a graph)."""
        return self.padded_rows / self.real_rows if self.real_rows else 0.0

    def rows_by_mode(self, what: str) -> dict[str, int]:
        """``real_rows`` or ``padded_rows`` summed per graph mode (full, piecewise)."""
        return {m: sum(getattr(h, what) for h in self.hits.values() if h.mode == m) for m in ("full", "piecewise")}

    def shares(self) -> dict[str, float]:
        """Share of passes per runtime mode (full, piecewise, eager)."""
        total = sum(self.passes_by_mode.values())
        return {m.value: (self.passes_by_mode[m.value] / total if total else 0.0) for m in GraphRuntimeMode}

    def to_json(self) -> dict:
        """The JSON report (see the module docstring for definitions)."""
        dispatch_us = [s * 1e6 for s in self.dispatch_wall_seconds]
        return {
            "config": {**asdict(self.config), "mode": self.config.mode.value,
                       "num_graphs": len(self.config.keys()),
                       "num_full_graphs": len(self.config.full_sizes),
                       "num_piecewise_graphs": len(self.config.piecewise_sizes)},
            "cost_model": self.cost_model,
            "time_unit": self.time_unit,
            "requests": {"total": self.num_requests, "completed": self.completed,
                         "prompt_tokens": self.prompt_tokens, "output_tokens": self.output_tokens,
                         "preemptions": self.preemptions},
            "steps": self.steps,
            "simulated_seconds": self.simulated_seconds,
            "output_tokens_per_s": self.output_tokens / self.simulated_seconds if self.simulated_seconds else 0.0,
            "passes": {m.value: self.passes_by_mode[m.value] for m in GraphRuntimeMode},
            "shares": self.shares(),
            "fallback_reasons": dict(sorted(self.fallback_reasons.items())),
            "bucket_hits": {h.key: asdict(h) for h in sorted(self.hits.values(), key=_hit_order)},
            "real_rows": self.real_rows,
            "padded_rows": self.padded_rows,
            "real_rows_by_mode": self.rows_by_mode("real_rows"),
            "padded_rows_by_mode": self.rows_by_mode("padded_rows"),
            "eager_rows": self.eager_rows,
            "padding_ratio": self.padding_ratio,
            "decode_batch_sizes": {str(b): c for b, c in sorted(self.decode_batch_sizes.items())},
            "graph_memory_bytes": self.graph_memory_bytes,
            "capture_seconds": self.capture_seconds,
            "dispatch_overhead_us": {**percentiles(dispatch_us, (50, 99)),
                                     "mean": float(np.mean(dispatch_us)) if dispatch_us else None},
            "iteration_s": {**percentiles(self.iteration_seconds, (50, 99)),
                            "mean": float(np.mean(self.iteration_seconds)) if self.iteration_seconds else None},
            "ttft_s": percentiles(self.ttft_seconds, (50, 99)),
            "tpot_s": percentiles(self.tpot_seconds, (50, 99)),
            "e2e_s": percentiles(self.e2e_seconds, (50, 99)),
        }


def _hit_order(h: KeyHits) -> tuple:
    mode, _, rest = h.key.partition("-")
    return (mode, int(rest.split("-")[0].removeprefix("t")))


def replay_trace(
    trace: SequenceOf[TraceRequest],
    config: ReplayConfig,
    cost_model: CostModel | None = None,
    *,
    cost_model_name: str | None = None,
) -> ReplayResult:
    """Replay ``trace`` through the real scheduler and dispatcher (see the module docstring).

    Args:
        trace: requests sorted or not (they are sorted by arrival).
        config: scheduler and graph settings (:func:`make_config`).
        cost_model: T and M in seconds (``time_unit == "s"``); default :class:`AnalyticStepCost`.
        cost_model_name: how the report names the cost model.

    Returns:
        The :class:`ReplayResult`; every request completes.

    Raises:
        ReplayError: the cost model's time unit is not seconds, or a request can never fit in
            the KV cache even alone (the message names it and the capacity).
    """
    model: CostModel = cost_model if cost_model is not None else AnalyticStepCost()
    if model.time_unit != "s":
        raise ReplayError(
            f"the replay needs a cost model in seconds (its clock follows the trace), got time unit {model.time_unit!r}"
        )
    block_manager = BlockManager(config.num_kv_blocks, config.block_size)
    scheduler = Scheduler(block_manager, config.max_num_seqs, config.max_num_batched_tokens)
    keys = config.keys()
    captured = frozenset(keys)
    full_sizes, piecewise_sizes = config.full_sizes, config.piecewise_sizes
    result = ReplayResult(config=config, cost_model=cost_model_name or type(model).__name__, time_unit="s")
    result.graph_memory_bytes = _graph_memory(keys, model)
    result.capture_seconds = sum(model.capture_seconds(k.num_tokens) for k in keys)

    pending = sorted(trace, key=lambda r: r.arrival_s)
    result.num_requests = len(pending)
    next_arrival = 0
    now = 0.0
    while next_arrival < len(pending) or scheduler.has_unfinished():
        if not scheduler.has_unfinished() and pending[next_arrival].arrival_s > now:
            now = pending[next_arrival].arrival_s
        while next_arrival < len(pending) and pending[next_arrival].arrival_s <= now:
            _admit(scheduler, pending[next_arrival], next_arrival)
            next_arrival += 1
        out = scheduler.schedule()
        if out.is_empty:  # the scheduler always makes progress while anything is unfinished
            raise RuntimeError(
                f"the scheduler scheduled nothing with {scheduler.num_running} running and "
                f"{scheduler.num_waiting} waiting sequences"
            )
        num_tokens = out.num_batched_tokens
        num_reqs = len(out.scheduled)
        max_query_len = max(row.num_new_tokens for row in out.scheduled)
        t0 = time.perf_counter()
        decision = dispatch(
            num_tokens=num_tokens, num_reqs=num_reqs, max_query_len=max_query_len, mode=config.mode,
            full_sizes=full_sizes, piecewise_sizes=piecewise_sizes, contract=REPLAY_CONTRACT, captured=captured,
        )
        result.dispatch_wall_seconds.append(time.perf_counter() - t0)
        _count_pass(result, decision, num_tokens)
        if max_query_len == 1 and num_tokens == num_reqs:
            result.decode_batch_sizes[num_reqs] += 1
        seconds = pass_seconds(decision, num_tokens, num_reqs, model)
        result.iteration_seconds.append(seconds)
        result.preemptions += len(out.preempted)
        result.steps += 1
        now += seconds
        scheduler.commit(out)
        for row in out.scheduled:
            if row.samples:
                _emit_token(scheduler, row.seq, now, result)
    result.simulated_seconds = now
    return result


def _admit(scheduler: Scheduler, request: TraceRequest, index: int) -> None:
    prompt = [0] * max(request.input_tokens, 1)
    params = SamplingParams(max_tokens=request.output_tokens, temperature=0.0, ignore_eos=True)
    seq = Sequence(seq_id=f"r{index}-0", request_id=f"r{index}", index=0, prompt_token_ids=prompt, params=params,
                   seed=index, max_tokens=request.output_tokens, arrival_time=request.arrival_s)
    try:
        scheduler.add(seq)
    except ValueError as exc:
        raise ReplayError(
            f"trace request {index} (arrival {request.arrival_s:g} s, {request.input_tokens} prompt + "
            f"{request.output_tokens} output tokens) can never fit: {exc}; raise num_kv_blocks"
        ) from None


def _emit_token(scheduler: Scheduler, seq: Sequence, now: float, result: ReplayResult) -> None:
    seq.output_token_ids.append(0)
    if seq.first_token_time is None:
        seq.first_token_time = now
        result.ttft_seconds.append(now - seq.arrival_time)
    if seq.num_output_tokens >= seq.max_tokens:
        scheduler.finish(seq, FinishReason.LENGTH)
        seq.finish_time = now  # simulated, not the wall clock finish() records
        result.completed += 1
        result.prompt_tokens += seq.num_prompt_tokens
        result.output_tokens += seq.num_output_tokens
        result.e2e_seconds.append(now - seq.arrival_time)
        if seq.num_output_tokens > 1:
            result.tpot_seconds.append((now - seq.first_token_time) / (seq.num_output_tokens - 1))


def _count_pass(result: ReplayResult, decision: Dispatch, num_tokens: int) -> None:
    key = decision.key
    result.passes_by_mode[decision.runtime_mode.value] += 1
    if key is None:
        result.fallback_reasons[decision.reason.value] += 1
        result.eager_rows += num_tokens
        return
    label = key.label()
    hit = result.hits.get(label)
    if hit is None:
        hit = result.hits[label] = KeyHits(label, key.mode.value)
    hit.passes += 1
    hit.real_rows += num_tokens
    hit.padded_rows += key.num_tokens - num_tokens
    result.real_rows += num_tokens
    result.padded_rows += key.num_tokens - num_tokens


def _graph_memory(keys: list[GraphKey], model: CostModel) -> dict[str, float]:
    """Graph memory from the cost model's M, by the key's padded rows (requests for FULL keys,
    tokens for PIECEWISE keys): ``full``, ``piecewise`` and ``total`` bytes."""
    full = sum(model.graph_memory_bytes(k.num_tokens) for k in keys if k.mode is GraphRuntimeMode.FULL)
    piece = sum(model.graph_memory_bytes(k.num_tokens) for k in keys if k.mode is GraphRuntimeMode.PIECEWISE)
    return {"full": full, "piecewise": piece, "total": full + piece}


# -- comparing capture-size lists ------------------------------------------------------------------

def planned_capture_sizes(
    decode_batch_sizes: Counter,
    baseline: ReplayConfig,
    cost_model: CostModel,
) -> list[int]:
    """The planner's FULL capture sizes for a replay's decode batch-size histogram, at no more
    graphs and no more graph memory than ``baseline``'s FULL list, with the same maximum
    (``max_num_seqs``) and λ = 0.

    Raises:
        ReplayError: the replay had no uniform-decode step to plan from.
    """
    sizes = [b for b, c in decode_batch_sizes.items() for _ in range(c)]
    if not sizes:
        raise ReplayError("the trace produced no uniform-decode step: there is no batch-size histogram to plan from")
    histogram = from_batch_sizes(sizes)
    base = baseline.capture_sizes
    budget = Budget(max_graphs=len(base),
                    max_graph_memory_bytes=sum(cost_model.graph_memory_bytes(c) for c in base))
    plan = plan_capture_sizes(histogram, cost_model, budget=budget, maximum=baseline.max_num_seqs)
    return plan.capture_sizes


def compare(
    trace: SequenceOf[TraceRequest],
    lists: SequenceOf[str],
    cost_model: CostModel | None = None,
    *,
    cost_model_name: str | None = None,
    **config_kwargs,
) -> dict[str, ReplayResult]:
    """Replay the same trace with several FULL capture-size lists, by name.

    Names: ``vllm`` (the default grid, graph_policy.default_capture_sizes), ``auto`` (the planner's
    list from the decode batch-size histogram of the ``vllm`` replay, at no more graphs and no
    more graph memory: :func:`planned_capture_sizes`), or comma-separated sizes. Other settings
    (``config_kwargs``) are shared, as :func:`make_config` takes them.

    Raises:
        ReplayError: an unknown name, or what :func:`make_config` / :func:`replay_trace` raise.
    """
    model = cost_model if cost_model is not None else AnalyticStepCost()
    results: dict[str, ReplayResult] = {}
    baseline: ReplayResult | None = None

    def vllm() -> ReplayResult:
        nonlocal baseline
        if baseline is None:
            cfg = make_config(trace, capture_sizes=None, **config_kwargs)
            baseline = replay_trace(trace, cfg, model, cost_model_name=cost_model_name)
        return baseline

    for name in lists:
        key = name.strip().lower()
        if key == "vllm":
            results["vllm"] = vllm()
        elif key == "auto":
            sizes = planned_capture_sizes(vllm().decode_batch_sizes, vllm().config, model)
            cfg = make_config(trace, capture_sizes=sizes, **config_kwargs)
            results["auto"] = replay_trace(trace, cfg, model, cost_model_name=cost_model_name)
        else:
            cfg = make_config(trace, capture_sizes=parse_sizes(name, "--compare"), **config_kwargs)
            results[name.strip()] = replay_trace(trace, cfg, model, cost_model_name=cost_model_name)
    return results


def parse_sizes(text: str, what: str) -> list[int]:
    """Comma-separated integers >= 1.

    Raises:
        ReplayError: anything else (the message names ``what`` and the text).
    """
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ReplayError(f"{what}: expected 'vllm', 'auto' or comma-separated integers, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise ReplayError(f"{what}: capture sizes must be integers >= 1, got {text!r}")
    return sizes


# -- text ------------------------------------------------------------------------------------------

def _fmt(value: float | None, scale: float = 1.0, spec: str = ".2f") -> str:
    return "-" if value is None else format(value * scale, spec)


def _ratio(report: dict, mode: str) -> float:
    real = report["real_rows_by_mode"][mode]
    return report["padded_rows_by_mode"][mode] / real if real else 0.0


def format_report(report: dict) -> str:
    """A plain-text table of one replay report (:meth:`ReplayResult.to_json`)."""
    return format_comparison({"replay": report})


def format_comparison(reports: dict[str, dict]) -> str:
    """Replay reports side by side, one column per name."""
    names = list(reports)
    rows: list[tuple[str, list[str]]] = []

    def row(label: str, fn) -> None:
        rows.append((label, [fn(reports[n]) for n in names]))

    row("mode", lambda r: r["config"]["mode"])
    row("full graphs", lambda r: str(r["config"]["num_full_graphs"]))
    row("piecewise graphs", lambda r: str(r["config"]["num_piecewise_graphs"]))
    row("requests done", lambda r: f"{r['requests']['completed']}/{r['requests']['total']}")
    row("steps", lambda r: str(r["steps"]))
    row("preemptions", lambda r: str(r["requests"]["preemptions"]))
    row("full share", lambda r: f"{r['shares']['full']:.1%}")
    row("piecewise share", lambda r: f"{r['shares']['piecewise']:.1%}")
    row("eager share", lambda r: f"{r['shares']['eager']:.1%}")
    reasons = sorted({k for r in reports.values() for k in r["fallback_reasons"]})
    for reason in reasons:
        row(f"  eager: {reason}", lambda r, reason=reason: str(r["fallback_reasons"].get(reason, 0)))
    row("real rows (graphs)", lambda r: str(r["real_rows"]))
    row("padded rows", lambda r: str(r["padded_rows"]))
    row("padding ratio", lambda r: f"{r['padding_ratio']:.4f}")
    row("  full padded rows", lambda r: str(r["padded_rows_by_mode"]["full"]))
    row("  full padding ratio", lambda r: f"{_ratio(r, 'full'):.4f}")
    row("  piecewise padded", lambda r: str(r["padded_rows_by_mode"]["piecewise"]))
    row("graph memory MiB", lambda r: f"{r['graph_memory_bytes']['total'] / 2**20:.1f}")
    row("  full MiB", lambda r: f"{r['graph_memory_bytes']['full'] / 2**20:.1f}")
    row("capture s (model)", lambda r: f"{r['capture_seconds']:.2f}")
    row("dispatch us p50", lambda r: _fmt(r["dispatch_overhead_us"]["p50"]))
    row("dispatch us p99", lambda r: _fmt(r["dispatch_overhead_us"]["p99"]))
    row("iteration ms p50", lambda r: _fmt(r["iteration_s"]["p50"], 1e3, ".3f"))
    row("iteration ms p99", lambda r: _fmt(r["iteration_s"]["p99"], 1e3, ".3f"))
    row("TTFT ms p50", lambda r: _fmt(r["ttft_s"]["p50"], 1e3))
    row("TTFT ms p99", lambda r: _fmt(r["ttft_s"]["p99"], 1e3))
    row("TPOT ms p50", lambda r: _fmt(r["tpot_s"]["p50"], 1e3, ".3f"))
    row("TPOT ms p99", lambda r: _fmt(r["tpot_s"]["p99"], 1e3, ".3f"))
    row("output tok/s (sim)", lambda r: f"{r['output_tokens_per_s']:.1f}")

    width = max(len(label) for label, _ in rows) + 2
    col = max(12, *(len(n) + 2 for n in names), *(len(v) + 2 for _, values in rows for v in values))
    lines = [f"{'':<{width}}" + "".join(f"{n:>{col}}" for n in names)]
    lines += [f"{label:<{width}}" + "".join(f"{v:>{col}}" for v in values) for label, values in rows]
    lines.append("")
    for n in names:
        r = reports[n]
        lines.append(f"{n}: full capture sizes {r['config']['capture_sizes'] if r['config']['num_full_graphs'] else []}")
        hits = ", ".join(f"{k} {h['passes']}" for k, h in r["bucket_hits"].items())
        lines.append(f"{n}: bucket hits: {hits or '-'}")
    lines.append(f"(times are simulated seconds from the cost model {next(iter(reports.values()))['cost_model']}; "
                 "dispatch overhead is measured wall time)")
    return "\n".join(lines)
