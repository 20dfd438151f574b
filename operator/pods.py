"""What the operator reads from one worker Pod (pure): its report, gate decision and capacity.

A report counts only while it is the running worker container's (:mod:`.restarts`), and its
capacity only up to the plausibility bound of :mod:`.capacity` (:func:`with_capacity_bounds`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from graphserving.contract.report import REPORT_ANNOTATION, Phase, WorkerReport
from graphserving.contract.worker_config import ReadinessPolicy
from . import naming
from .capacity import AcceptedCapacity, Clamp, plausible_bound
from .readiness import GateDecision, decide
from .report_validation import Expectation, Validation, accepted_marker, validate_report
from .restarts import Restart, WorkerContainer, judge, worker_container


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
    container: WorkerContainer | None = None  # the worker container's status (None: not reported yet)
    restart: Restart | None = None  # set: the report is a dead container's, or the container loops
    clamp: Clamp | None = None  # set: the reported capacity is above its plausibility bound
    #: Listed ready in its revision Service's EndpointSlices, which is what gateways and kube-proxy
    #: send to (:func:`routable_pods`); a Pod turns Ready a moment before it is listed there.
    routable: bool = True

    @property
    def report(self) -> WorkerReport | None:
        """The accepted report, while it is the running container's (None otherwise)."""
        return self.validation.report if self.restart is None else None

    @property
    def gated_in(self) -> bool:
        """Alive, Pod Ready and the gate decision True."""
        return not self.terminating and self.pod_ready and self.decision.ready

    @property
    def serving(self) -> bool:
        """Counts as serving capacity: :attr:`gated_in` and listed in its Service's endpoints
        (capacity nothing can send traffic to is not served)."""
        return self.gated_in and self.routable

    @property
    def awaiting_endpoints(self) -> bool:
        """:attr:`gated_in`, but not yet listed in its Service's endpoints."""
        return self.gated_in and not self.routable

    @property
    def reported_capacity(self) -> float:
        """The report's effective capacity in tokens/s (0 without a report), as reported."""
        return self.report.effective_capacity_tokens_per_second if self.report else 0.0

    @property
    def counted_capacity(self) -> float:
        """:attr:`reported_capacity`, at most its plausibility bound (:attr:`clamp`)."""
        reported = self.reported_capacity
        return min(reported, self.clamp.bound) if self.clamp else reported

    @property
    def capacity(self) -> float:
        """Effective capacity in tokens/s as counted (0 unless serving)."""
        return self.counted_capacity if self.serving else 0.0

    def annotation(self, key: str) -> str | None:
        return (self.raw.get("metadata", {}).get("annotations") or {}).get(key)

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
        return marker if marker != self.annotation(naming.ANNOTATION_ACCEPTED_REPORT) else None


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
    container = worker_container(pod)
    restart = judge(validation.report, container)
    decision = restart.decision if restart is not None else decide(validation, policy, desired_graph_config_hash)
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
        container=container,
        restart=restart,
    )


def routable_pods(slices: Sequence[Mapping[str, Any]], service: str) -> set[str]:
    """Names of the Pods listed ready in the EndpointSlices of the Service ``service`` (pure).

    ``slices`` are EndpointSlice objects (``discovery.k8s.io/v1``) as read; an endpoint counts
    when its ``conditions.ready`` is not False (the API's meaning of a missing value) and it
    names its Pod (``targetRef``).
    """
    names: set[str] = set()
    for item in slices:
        if ((item.get("metadata") or {}).get("labels") or {}).get(SERVICE_NAME_LABEL) != service:
            continue
        for endpoint in item.get("endpoints") or []:
            ref = endpoint.get("targetRef") or {}
            if (endpoint.get("conditions") or {}).get("ready") is not False and ref.get("kind") == "Pod":
                names.add(ref.get("name", ""))
    return names


#: The label the EndpointSlice controller puts on each slice: the name of its Service.
SERVICE_NAME_LABEL = "kubernetes.io/service-name"


def _same_kind(a: PodView, b: PodView) -> bool:
    """Peers for plausibility: same revision and graph config, both degraded or both not."""
    assert a.report is not None and b.report is not None
    return (a.revision, a.report.graph_config_hash, a.decision.degraded) == (
        b.revision, b.report.graph_config_hash, b.decision.degraded)


def with_capacity_bounds(views: Sequence[PodView]) -> list[PodView]:
    """``views`` with :attr:`PodView.clamp` set where a reported capacity is implausible.

    Each live Pod's report is bounded by its serving peers of the same kind (:func:`_same_kind`)
    and by the capacity first accepted from its instance and graph config (the Pod's
    :data:`~.naming.ANNOTATION_ACCEPTED_CAPACITY`); :func:`.capacity.plausible_bound` decides.
    """
    live = [v for v in views if not v.terminating and v.report is not None]
    out = []
    for v in views:
        if v.terminating or v.report is None:
            out.append(v)
            continue
        peers = [p.reported_capacity for p in live if p is not v and p.serving and _same_kind(p, v)]
        history = AcceptedCapacity.parse(v.annotation(naming.ANNOTATION_ACCEPTED_CAPACITY))
        accepted = history.tokens_per_second if history is not None and history.applies_to(v.report) else None
        clamp = plausible_bound(v.reported_capacity, peers, accepted)
        out.append(dataclasses.replace(v, clamp=clamp) if clamp is not None else v)
    return out


def capacity_to_record(v: PodView) -> str | None:
    """The :data:`~.naming.ANNOTATION_ACCEPTED_CAPACITY` to write: the counted capacity of the first
    serving report of a worker instance and graph config (later reports are bounded by it); else None."""
    report = v.report
    if report is None or not report.phase.is_terminal_serving or v.counted_capacity <= 0:
        return None
    history = AcceptedCapacity.parse(v.annotation(naming.ANNOTATION_ACCEPTED_CAPACITY))
    if history is not None and history.applies_to(report):
        return None
    return AcceptedCapacity(report.worker.instance, report.graph_config_hash, v.counted_capacity).to_annotation()


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
