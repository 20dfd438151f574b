"""The worker report, built from the lifecycle's state (docs/architecture.md, section "Lifecycle").

:func:`build_report` is a pure function of a :class:`ReportState` snapshot: the lifecycle takes
the snapshot under its lock (the engine thread writes key reports during a recapture), this
module turns it into the published :class:`~graphserving.contract.report.WorkerReport`.
:func:`key_report` and :func:`canary_report` turn one key's capture and canary results into the
report's per-key entries, :func:`with_online_canary` adds the online canary's tallies to them;
:func:`bounded_phases` keeps the phase records within the report's
bound.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Mapping
from dataclasses import dataclass

from graphserving.contract.report import (
    CanaryResult as ReportCanary,
)
from graphserving.contract.report import (
    MAX_PHASES,
    GraphMemory,
    KeyReport,
    KvCacheCapacity,
    ModeKeys,
    OnlineCanary as ReportOnlineCanary,
    Phase,
    PhaseRecord,
    PrefixCacheReport,
    Progress,
    SpecDecodeReport,
    WorkerIdentity,
    WorkerReport,
    config_hash,
)
from graphserving.contract.worker_config import WorkerConfig
from ..engine.prefix_cache import PrefixCacheStats
from ..engine.spec_decode.acceptance import AcceptanceStats
from ..graphs.canary import CanaryResult
from ..graphs.key import FallbackReason, GraphKey, GraphRuntimeMode
from ..graphs.online_canary import KeyTally
from ..graphs.runner import KeyCapture
from .outcome import Outcome, ResolvedGraphs, coverage, passing_keys

#: Characters of a canary's failure reason kept in its key report.
MAX_CANARY_REASON_CHARS = 256


@dataclass(frozen=True)
class ReportState:
    """What a report is built from: a snapshot of the lifecycle, taken under its lock.

    Attributes:
        identity: who writes the report.
        config: the worker configuration (its graph configuration is hashed into the report).
        model_revision: the loaded model's revision, None when unverified.
        dtype: the model dtype without the ``torch.`` prefix (``"bfloat16"``).
        device: the device the model runs on (``"cuda:0"``, ``"cpu"``).
        graphs: the resolved capture sizes of the current graph configuration.
        generation: this report's generation (increases with every report of the process).
        phase: the current phase.
        phases: every phase record so far (bounded here to ``MAX_PHASES``).
        progress: progress of the running phase, or None.
        keys: one key report per key captured (or attempted), in capture order.
        configured_keys: keys of the served graph configuration, one per capture size and query
            length (coverage's denominator).
        kv_cache: the KV-cache capacity, None before the engine exists.
        graph_memory_estimate_bytes: the profiling estimate of the graphs' memory (bytes, every rank).
        graph_memory_actual_bytes: what the captured graphs take (bytes, every rank).
        capacity_tokens_per_second: decode tokens/s measured at ``max_num_seqs``.
        outcome: the lifecycle's verdict, None before the first one.
        updated_at: the report's timestamp (UTC).
        online_canary_comparisons / online_canary_divergences: the online canary's totals since
            the worker started (every key, every capture).
        prefix_cache: the engine's prefix-cache totals (``Scheduler.prefix_cache_stats``), None
            before the engine exists.
        spec_decode: the engine's speculative-decoding totals (``SpeculativeDecoder.stats``), None
            when speculative decoding is off or before the engine exists.
        parallel_layout: ``tp<N>-pp<M>`` (runtime/model/parallel.py) of a split model; None: one rank.
    """

    identity: WorkerIdentity
    config: WorkerConfig
    model_revision: str | None
    dtype: str
    device: str
    graphs: ResolvedGraphs
    generation: int
    phase: Phase
    phases: list[PhaseRecord]
    progress: Progress | None
    keys: list[KeyReport]
    configured_keys: int
    kv_cache: KvCacheCapacity | None
    graph_memory_estimate_bytes: int
    graph_memory_actual_bytes: int
    capacity_tokens_per_second: float
    outcome: Outcome | None
    updated_at: dt.datetime
    online_canary_comparisons: int = 0
    online_canary_divergences: int = 0
    prefix_cache: PrefixCacheStats | None = None
    spec_decode: AcceptanceStats | None = None
    parallel_layout: str | None = None


def _mode_keys(graphs: ResolvedGraphs, keys: list[KeyReport]) -> list[ModeKeys]:
    """Configured against captured capture sizes, one entry per kind the configuration has."""
    modes = []
    if graphs.full_sizes:
        captured = sorted(k.size for k in keys if k.kind == "FULL" and k.captured)
        modes.append(ModeKeys(kind="FULL", configured=graphs.full_sizes, captured=captured))
    if graphs.piecewise_sizes:
        captured = sorted(k.size for k in keys if k.kind == "PIECEWISE" and k.captured)
        modes.append(ModeKeys(kind="PIECEWISE", configured=graphs.piecewise_sizes, captured=captured))
    return modes


def build_report(state: ReportState) -> WorkerReport:
    """The report for ``state``; the degraded (failure) reason only while the phase is Degraded
    (Failed).

    Raises:
        pydantic.ValidationError: a value outside the report's bounds (a bug: the bounds are kept
            by :func:`bounded_phases` and the reasons' cut).
    """
    keys = state.keys
    p50, pmax = WorkerReport.capture_stats(keys)
    outcome = state.outcome
    return WorkerReport(
        worker=state.identity,
        model_name=state.config.model_name,
        model_revision=state.model_revision,
        dtype=state.dtype,
        device=state.device,
        parallel_layout=state.parallel_layout,
        graph_config_hash=config_hash(state.config.graphs),
        mode=state.graphs.config.mode,
        generation=state.generation,
        phase=state.phase,
        phases=bounded_phases(state.phases),
        progress=state.progress,
        modes=_mode_keys(state.graphs, keys),
        coverage=coverage(state.graphs.config.mode, state.configured_keys, passing_keys(keys)),
        keys=keys,
        canary_failures=sum(1 for k in keys if k.canary is not None and not k.canary.passed),
        online_canary_comparisons=state.online_canary_comparisons,
        online_canary_divergences=state.online_canary_divergences,
        graph_memory=GraphMemory(estimate_bytes=state.graph_memory_estimate_bytes,
                                 actual_bytes=state.graph_memory_actual_bytes),
        kv_cache=state.kv_cache,
        prefix_cache=prefix_cache_report(state.prefix_cache),
        spec_decode=SpecDecodeReport(**state.spec_decode.to_json()) if state.spec_decode is not None else None,
        capture_seconds_p50=p50,
        capture_seconds_max=pmax,
        effective_capacity_tokens_per_second=state.capacity_tokens_per_second,
        degraded_reason=outcome.degraded_reason if outcome and state.phase is Phase.DEGRADED else None,
        failure_reason=outcome.failure_reason if outcome and state.phase is Phase.FAILED else None,
        updated_at=state.updated_at,
    )


def kv_cache_capacity(num_blocks: int, block_size: int) -> KvCacheCapacity:
    """The report's KV-cache entry: ``num_blocks`` blocks of ``block_size`` tokens."""
    return KvCacheCapacity(num_blocks=num_blocks, block_size=block_size, tokens=num_blocks * block_size)


def prefix_cache_report(stats: PrefixCacheStats | None) -> PrefixCacheReport | None:
    """The report's ``prefixCache`` entry from the engine's totals (None stays None)."""
    if stats is None:
        return None
    return PrefixCacheReport(enabled=stats.enabled, query_tokens=stats.query_tokens, hit_tokens=stats.hit_tokens,
                             cached_blocks=stats.cached_blocks)


def bounded_phases(records: list[PhaseRecord]) -> list[PhaseRecord]:
    """At most ``MAX_PHASES`` records (the report's bound; each recapture adds three): the first
    half (start-up, whose durations probes and deadlines are set from) and the latest."""
    if len(records) <= MAX_PHASES:
        return list(records)
    head = MAX_PHASES // 2
    return records[:head] + records[len(records) - (MAX_PHASES - head):]


def key_report(c: KeyCapture) -> KeyReport:
    """The report entry of one key's capture (its canary is added once it has run)."""
    full = c.key.mode is GraphRuntimeMode.FULL
    return KeyReport(
        kind="FULL" if full else "PIECEWISE",
        size=c.key.num_reqs if full else c.key.num_tokens,
        query_len=c.key.uniform_query_len if full and c.key.uniform_query_len > 1 else None,
        captured=c.ok,
        capture_seconds=c.capture_seconds,
        memory_bytes=c.memory_bytes if c.ok else None,
    )


def canary_report(r: CanaryResult) -> ReportCanary:
    """The report's canary entry: an infinite error is reported as 1e30 (the report holds finite
    numbers only), the reason cut to :data:`MAX_CANARY_REASON_CHARS` characters."""
    return ReportCanary(
        passed=r.passed,
        max_relative_logit_error=r.relative_error if math.isfinite(r.relative_error) else 1e30,
        top1_agreement=r.top1_agreement,
        min_top1_margin=max(0.0, r.min_margin),
        reason=(r.reason or None) and r.reason[:MAX_CANARY_REASON_CHARS],
    )


def with_online_canary(
    keys: Mapping[GraphKey, KeyReport],
    tallies: Mapping[GraphKey, KeyTally],
    diverged: Mapping[GraphKey, str],
    enabled: bool,
) -> list[KeyReport]:
    """The key reports with the online canary's tally of each key and, for a key it took out of
    dispatch, ``eager_reason`` ``canary_divergence`` (coverage then counts the key as not passing).

    Args:
        keys: the key reports of the current capture, in capture order.
        tallies: the online canary's per-key tallies (``OnlineCanary.tallies``).
        diverged: the runner's diverged keys (``GraphRunner.diverged``).
        enabled: whether the online canary is on (off: no ``online_canary`` entries).
    """
    out = []
    for key, report in keys.items():
        update: dict[str, object] = {}
        tally = tallies.get(key)
        if enabled and report.captured:
            update["online_canary"] = ReportOnlineCanary(
                comparisons=tally.comparisons if tally else 0,
                divergences=tally.divergences if tally else 0,
                last_divergence=canary_report(tally.last_divergence) if tally and tally.last_divergence else None,
            )
        if key in diverged:
            update["eager_reason"] = FallbackReason.CANARY_DIVERGENCE.value
        out.append(report.model_copy(update=update) if update else report)
    return out
