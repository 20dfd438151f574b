"""The lifecycle's pure decisions: resolved capture sizes, coverage, the outcome, readiness.

Nothing here touches a device or the engine: each function maps what the lifecycle measured
(keys captured, canaries passed, the readiness policy) to a verdict, so the rules are tested
directly (tests/runtime/lifecycle/test_lifecycle.py, "the outcome decision"). The phases that
feed them are described in docs/architecture.md, section "Lifecycle".
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from graphserving.contract.graph_policy import (
    GraphMode,
    default_piecewise_capture_sizes,
    resolve_capture_sizes,
)
from graphserving.contract.report import KeyReport, Phase
from graphserving.contract.worker_config import GraphConfig, ReadinessPolicy
from ..graphs.key import GraphRuntimeMode

NO_CUDA_REASON = "no CUDA: graphs need a CUDA device; serving eagerly"
# WorkerReport.degraded_reason / failure_reason hold at most this many characters; the reasons
# quote exception texts (a CUDA out-of-memory message alone is about 600 characters).
MAX_REASON_CHARS = 1024


def cut_reason(text: str) -> str:
    """``text`` cut to :data:`MAX_REASON_CHARS`, ending in ``...`` when it was cut."""
    return text if len(text) <= MAX_REASON_CHARS else text[: MAX_REASON_CHARS - 3] + "..."


@dataclass
class Readiness:
    """Whether the worker takes traffic; the lifecycle flips it (``/readyz`` reads it)."""

    ready: bool = False
    reason: str = "starting"

    def set_ready(self, reason: str = "ready") -> None:
        self.ready, self.reason = True, reason

    def set_not_ready(self, reason: str) -> None:
        self.ready, self.reason = False, reason


@dataclass(frozen=True)
class ResolvedGraphs:
    """A GraphConfig with its capture sizes resolved against the engine limits.

    Attributes:
        config: the graph configuration as given.
        full_sizes: FULL capture sizes in requests, sorted (empty when the mode has no FULL).
        piecewise_sizes: PIECEWISE capture sizes in tokens, sorted (empty when the mode has no
            PIECEWISE).
    """

    config: GraphConfig
    full_sizes: list[int]
    piecewise_sizes: list[int]


def resolve_graphs(graphs: GraphConfig, max_num_seqs: int, max_num_batched_tokens: int) -> ResolvedGraphs:
    """Resolve capture sizes; the scheduler maxima are always captured.

    Raises:
        CaptureSizeError: a list that contradicts its maximum (the message names both values).
    """
    full = resolve_capture_sizes(graphs.capture_sizes, max_num_seqs, what="max_num_seqs") if graphs.mode.has_full else []
    piece = (
        resolve_capture_sizes(
            graphs.piecewise_capture_sizes, max_num_batched_tokens, what="max_num_batched_tokens",
            default=default_piecewise_capture_sizes,
        )
        if graphs.mode.has_piecewise
        else []
    )
    return ResolvedGraphs(graphs, full, piece)


def passing_keys(keys: Iterable[KeyReport]) -> int:
    """Keys captured whose canary passed (or has not run yet) and that replay: a key with an
    ``eager_reason`` (the online canary took it out, or its canary found no KV blocks to run on)
    runs eagerly and does not count."""
    return sum(1 for k in keys if k.captured and (k.canary is None or k.canary.passed) and k.eager_reason is None)


def coverage(mode: GraphMode, configured: int, passing: int) -> float:
    """Fraction of the configured keys that pass, in [0, 1]; 1 when none is configured or the
    mode is NONE (nothing to cover)."""
    if not configured or mode is GraphMode.NONE:
        return 1.0
    return passing / configured


@dataclass(frozen=True)
class Outcome:
    """The lifecycle's verdict after capture and canary.

    Attributes:
        phase: ``Ready``, ``Degraded`` or ``Failed``.
        ready: whether the worker takes traffic.
        reason: the readiness reason (``/readyz`` quotes it).
        degraded_reason / failure_reason: the report's reasons, at most :data:`MAX_REASON_CHARS`.
    """

    phase: Phase
    ready: bool
    reason: str
    degraded_reason: str | None = None
    failure_reason: str | None = None


def _missing_modes(policy: ReadinessPolicy, captured_modes: set[GraphRuntimeMode]) -> list[str]:
    """The policy's required modes of which some kind has no passing graph."""
    missing = []
    for required in policy.required_modes:
        kinds = []
        if required.has_full:
            kinds.append(GraphRuntimeMode.FULL)
        if required.has_piecewise:
            kinds.append(GraphRuntimeMode.PIECEWISE)
        if not all(k in captured_modes for k in kinds):
            missing.append(required.value)
    return missing


def decide_outcome(
    policy: ReadinessPolicy,
    mode: GraphMode,
    *,
    graphs_available: bool,
    configured: int,
    passing: int,
    captured_modes: set[GraphRuntimeMode],
    problems: list[str],
    unproven: Sequence[GraphRuntimeMode] = (),
    unproven_reason: str = "",
) -> Outcome:
    """Pure readiness decision from what was captured and what passed the canary.

    - coverage = passing / configured (1 when nothing is configured, i.e. mode NONE);
    - ready as a graph worker when coverage >= ``policy.min_coverage`` and every required mode
      has a passing key;
    - otherwise degraded (still serving, eagerly where graphs are missing) if
      ``policy.allow_degraded``; else not ready: ``Degraded`` when graphs are unavailable on this
      device (no CUDA: nothing failed, the operator's gate says ``DegradedNotAllowed``) or when
      the worker falls short only by keys whose canary could not run (``unproven``: no KV blocks,
      a capacity shortfall the lifecycle retries, never a failure), ``Failed`` when captures or
      canaries failed.

    Args:
        unproven: the kind of each captured key whose canary found no KV blocks to run on (it
            runs eagerly, so it is not among ``passing`` nor in ``captured_modes``).
        unproven_reason: what the reasons say about them (which keys, the retries).

    The degraded and failure reasons are cut to :data:`MAX_REASON_CHARS` (the report's bound).
    """
    ratio = passing / configured if configured else 1.0
    missing_modes = _missing_modes(policy, captured_modes)
    no_graphs = not graphs_available and mode is not GraphMode.NONE
    if not no_graphs and ratio >= policy.min_coverage and not missing_modes:
        return Outcome(Phase.READY, True, f"graphs ready: coverage {ratio:.2f}")
    # short only of the unproven keys: had they run and passed, the worker would be ready
    proven_ratio = (passing + len(unproven)) / configured if configured else 1.0
    waiting = bool(unproven) and proven_ratio >= policy.min_coverage and not (
        _missing_modes(policy, captured_modes | set(unproven)))
    shortfall: list[str] = []
    if no_graphs:
        shortfall.append(NO_CUDA_REASON)
    else:
        if ratio < policy.min_coverage:
            shortfall.append(f"coverage {ratio:.2f} < minCoverage {policy.min_coverage:.2f}")
        if missing_modes:
            shortfall.append(f"required modes without a passing graph: {', '.join(missing_modes)}")
        if unproven:
            shortfall.append(unproven_reason or f"canary not run for {len(unproven)} keys: no free KV blocks")
        shortfall += problems[:3]
    reason = "; ".join(shortfall)
    if policy.allow_degraded:
        return Outcome(Phase.DEGRADED, True, f"degraded: {reason}", degraded_reason=cut_reason(reason))
    if no_graphs or waiting:  # nothing failed (yet): degraded, and the policy keeps the worker out
        return Outcome(Phase.DEGRADED, False, f"not ready: degraded ({reason}) and allowDegraded is false",
                       degraded_reason=cut_reason(reason))
    return Outcome(Phase.FAILED, False, f"not ready: {reason} (allowDegraded is false)",
                   failure_reason=cut_reason(f"{reason} (allowDegraded is false)"))


def unproven_reason(labels: Sequence[str], attempts: int, delays: Sequence[float]) -> str:
    """What the outcome's reason says of the keys (``labels``) whose canary found no KV blocks,
    after ``attempts`` of the retries scheduled ``delays`` seconds apart (pure): a capacity
    shortfall, the next retry or that none is left."""
    shown = ", ".join(labels[:3]) + (", ..." if len(labels) > 3 else "")
    then = (f"retry {attempts + 1}/{len(delays)} in {delays[attempts]:g} s" if attempts < len(delays)
            else f"no retry left of {len(delays)}; a recapture tries again")
    return (f"canary not run for {len(labels)} keys ({shown}): no free KV blocks, requests hold them all "
            f"(a capacity shortfall, not a divergence); {then}")


def failed(prefix: str, reason: str) -> Outcome:
    """A ``Failed`` outcome for a phase that raised: readiness says ``{prefix}: {reason}``, the
    report's failure reason is ``reason`` cut to :data:`MAX_REASON_CHARS`."""
    return Outcome(Phase.FAILED, False, f"{prefix}: {reason}", failure_reason=cut_reason(reason))
