"""The graphs-ready decision for one Pod (pure): report + policy -> readiness-gate condition.

The operator sets the Pod condition ``graphserving.io/graphs-ready`` to the returned status; Pod
readiness (and so Services, EndpointSlices, Deployments and gateways) follows it.
"""

from __future__ import annotations

import dataclasses
import enum

from graphserving.contract.graph_policy import GraphMode
from graphserving.contract.report import Phase, WorkerReport
from graphserving.contract.worker_config import ReadinessPolicy
from .report_validation import Validation



class GateReason(enum.StrEnum):
    """``reason`` of a graphs-ready decision the report's phase does not name itself.

    A worker still starting up is not ready with its phase as the reason (``Loading``,
    ``Capturing``, ...); a Pod without an acceptable report with the validation's reason
    (:class:`~.report_validation.ReportReason`); a Pod whose report is a restarted container's
    with ``WorkerRestarted`` or ``WorkerCrashLoop`` (:func:`.restarts.judge`).
    """

    WORKER_FAILED = "WorkerFailed"
    WORKER_RESTARTED = "WorkerRestarted"  # the report is a dead container's (.restarts)
    WORKER_CRASH_LOOP = "WorkerCrashLoop"
    CANARY_FAILED = "CanaryFailed"
    DRAINING = "Draining"
    RECAPTURE_PENDING = "RecapturePending"
    DEGRADED_ALLOWED = "DegradedAllowed"
    DEGRADED_NOT_ALLOWED = "DegradedNotAllowed"
    COVERAGE_BELOW_MINIMUM = "CoverageBelowMinimum"
    REQUIRED_MODE_MISSING = "RequiredModeMissing"
    GRAPHS_READY = "GraphsReady"


#: Not-ready decisions that also post a Warning Event on the Pod (the worker will not get better alone).
WARNING_REASONS = frozenset({GateReason.CANARY_FAILED, GateReason.WORKER_FAILED, GateReason.DEGRADED_NOT_ALLOWED})

_IN_PROGRESS = {Phase.LOADING, Phase.WARMUP, Phase.PROFILING, Phase.CAPTURING, Phase.CANARY, Phase.RECAPTURING}


@dataclasses.dataclass(frozen=True)
class GateDecision:
    """``ready`` is the condition status; ``reason``/``message`` go on the Pod condition."""

    ready: bool
    reason: str
    message: str
    degraded: bool = False
    canary_failed: bool = False

    @property
    def status(self) -> str:
        return "True" if self.ready else "False"


def _captured_kinds(report: WorkerReport) -> set[str]:
    return {m.kind for m in report.modes if m.captured}


def _missing_modes(report: WorkerReport, required: list[GraphMode]) -> list[str]:
    kinds = _captured_kinds(report)
    missing = []
    for mode in required:
        if mode is GraphMode.NONE:
            continue
        if (mode.has_full and "FULL" not in kinds) or (mode.has_piecewise and "PIECEWISE" not in kinds):
            missing.append(mode.value)
    return missing


def decide(validation: Validation, policy: ReadinessPolicy, desired_graph_config_hash: str | None) -> GateDecision:
    """Whether a Pod's graphs satisfy ``policy``.

    Args:
        validation: the Pod's report after :func:`~graphserving.operator.report_validation.validate_report`.
        policy: the GraphServing's readiness policy (minimum coverage, required modes, allowDegraded).
        desired_graph_config_hash: ``config_hash`` of the GraphConfig the spec asks for now; a report
            about another configuration means a recapture is pending. None: any configuration
            (an old revision during a rollout is never recaptured).

    Returns:
        A :class:`GateDecision`. True only for a ``Ready`` report meeting coverage, required modes
        and canaries, or a ``Degraded`` report when degraded serving is allowed.
    """
    report = validation.report
    if report is None:
        return GateDecision(False, validation.reason, validation.message)
    canary_failed = not report.canary_passed()
    if report.phase is Phase.FAILED:
        reason = GateReason.CANARY_FAILED if canary_failed else GateReason.WORKER_FAILED
        return GateDecision(False, reason, report.failure_reason or "worker failed", canary_failed=canary_failed)
    if report.phase in _IN_PROGRESS:
        progress = f" ({report.progress.done}/{report.progress.total})" if report.progress else ""
        return GateDecision(False, report.phase.value, f"worker phase {report.phase.value}{progress}")
    if report.phase is Phase.DRAINING:
        return GateDecision(False, GateReason.DRAINING, "worker is draining")
    if desired_graph_config_hash is not None and report.graph_config_hash != desired_graph_config_hash:
        return GateDecision(
            False,
            GateReason.RECAPTURE_PENDING,
            f"report is for graph config {report.graph_config_hash}, the spec asks for {desired_graph_config_hash}",
        )
    if report.phase is Phase.DEGRADED:
        if policy.allow_degraded:
            return GateDecision(True, GateReason.DEGRADED_ALLOWED, f"degraded: {report.degraded_reason}", degraded=True)
        return GateDecision(
            False, GateReason.DEGRADED_NOT_ALLOWED, f"degraded ({report.degraded_reason}) and allowDegraded is false"
        )
    if canary_failed:
        return GateDecision(False, GateReason.CANARY_FAILED, "a captured graph failed its canary", canary_failed=True)
    if report.coverage < policy.min_coverage:
        return GateDecision(
            False, GateReason.COVERAGE_BELOW_MINIMUM, f"coverage {report.coverage:.3f} < minCoverage {policy.min_coverage:.3f}"
        )
    missing = _missing_modes(report, policy.required_modes)
    if missing:
        return GateDecision(False, GateReason.REQUIRED_MODE_MISSING, f"no captured graphs for required mode(s) {missing}")
    return GateDecision(True, GateReason.GRAPHS_READY, f"coverage {report.coverage:.3f}, canaries passed")
