"""What the operator reads from one worker Pod (pure): its report, gate decision and capacity."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from graphserving.contract.report import REPORT_ANNOTATION, Phase, WorkerReport
from graphserving.contract.worker_config import ReadinessPolicy
from . import naming
from .readiness import GateDecision, decide
from .report_validation import Expectation, Validation, accepted_marker, validate_report


@dataclasses.dataclass(frozen=True)
class PodView:
    name: str
    revision: str
    terminating: bool
    pod_ready: bool  # the Pod's own Ready condition (probes and gates together)
    gate_status: str | None  # current graphs-ready condition status on the Pod, if any
    gate_reason: str | None
    validation: Validation
    decision: GateDecision
    pod_ip: str | None
    raw: Mapping[str, Any]

    @property
    def report(self) -> WorkerReport | None:
        return self.validation.report

    @property
    def serving(self) -> bool:
        """Counts as serving capacity: alive, Pod Ready and the gate decision True."""
        return not self.terminating and self.pod_ready and self.decision.ready

    @property
    def capacity(self) -> float:
        """Measured effective capacity in tokens/s (0 unless serving)."""
        return self.report.effective_capacity_tokens_per_second if self.serving and self.report else 0.0

    @property
    def degraded(self) -> bool:
        return self.serving and self.decision.degraded

    @property
    def startup_seconds(self) -> float | None:
        """Loading through Canary, measured, for the startup probe of later revisions."""
        if self.report is None or self.report.phase not in (Phase.READY, Phase.DEGRADED):
            return None
        phases = (Phase.LOADING, Phase.WARMUP, Phase.PROFILING, Phase.CAPTURING, Phase.CANARY)
        parts = [self.report.phase_seconds(p) for p in phases]
        known = [p for p in parts if p is not None]
        return sum(known) if known else None

    @property
    def accepted_marker_changed(self) -> str | None:
        """The marker to record on the Pod when a newer report was accepted, else None."""
        if self.report is None:
            return None
        marker = accepted_marker(self.report)
        current = (self.raw.get("metadata", {}).get("annotations") or {}).get(naming.ANNOTATION_ACCEPTED_REPORT)
        return marker if marker != current else None


def _condition(pod: Mapping[str, Any], kind: str) -> Mapping[str, Any] | None:
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == kind:
            return cond
    return None


def view(
    pod: Mapping[str, Any],
    *,
    model_name: str,
    model_revision: str,
    policy: ReadinessPolicy,
    desired_graph_config_hash: str | None,
) -> PodView:
    """Validate the Pod's report and decide its graphs-ready gate.

    ``model_revision`` is the model revision the Pod's revision serves (its pod-template
    annotation), so a report about other weights is foreign even during a rollout.
    """
    meta = pod.get("metadata") or {}
    annotations = meta.get("annotations") or {}
    expect = Expectation(
        pod_name=meta.get("name", ""),
        namespace=meta.get("namespace", ""),
        model_name=model_name,
        model_revision=annotations.get(naming.ANNOTATION_MODEL_REVISION, model_revision),
        accepted=annotations.get(naming.ANNOTATION_ACCEPTED_REPORT),
    )
    validation = validate_report(annotations.get(REPORT_ANNOTATION), expect)
    decision = decide(validation, policy, desired_graph_config_hash)
    ready = _condition(pod, "Ready")
    gate = _condition(pod, naming.READINESS_GATE)
    return PodView(
        name=expect.pod_name,
        revision=(meta.get("labels") or {}).get(naming.LABEL_REVISION, ""),
        terminating=meta.get("deletionTimestamp") is not None,
        pod_ready=bool(ready and ready.get("status") == "True"),
        gate_status=gate.get("status") if gate else None,
        gate_reason=gate.get("reason") if gate else None,
        validation=validation,
        decision=decision,
        pod_ip=(pod.get("status") or {}).get("podIP"),
        raw=pod,
    )


def gate_condition(decision: GateDecision, now_iso: str) -> dict[str, Any]:
    """The Pod condition for the readiness gate (PodCondition shape)."""
    return {
        "type": naming.READINESS_GATE,
        "status": decision.status,
        "reason": decision.reason,
        "message": decision.message[:1024],
        "lastTransitionTime": now_iso,
        "lastProbeTime": None,
    }
