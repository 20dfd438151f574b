"""The pure steps of one reconcile (:mod:`.reconcile` makes the API calls around them).

What a step hands on (:class:`Desired`, :class:`Observed`, :class:`Applied`) and the decisions taken
from it: the spec's warnings, the Pods' views, a gate change's Event, the annotations a Pod lacks,
a recapture request, the rollout step, the traffic weights, the reconcile's warnings, failure and
Events, and when to run again. No function here calls the API server.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Mapping, Sequence
from typing import Any

import pydantic

from graphserving.contract import graphserving_types as api
from graphserving.contract import worker_config as wc
from graphserving.contract.graph_policy import GraphMode
from graphserving.contract.report import RECAPTURE_ANNOTATION, Phase, RecaptureRequest
from . import children, naming, routing, rollout, status
from .capacity import CLAMP_REASON
from .divergence import divergence_event
from .divergence import marker as divergence_marker
from .pods import PodView, capacity_to_record, routable_pods, view, with_capacity_bounds
from .readiness import WARNING_REASONS
from .report_validation import REJECTIONS
from .restarts import restart_event

#: Requeue while a rollout moves (progress deadline checks) and as a slow resync otherwise.
ACTIVE_REQUEUE_SECONDS = 5.0
IDLE_RESYNC_SECONDS = 300.0

#: A ``(reason, message)`` pair: a warning (it makes the ``Reconciled`` condition False), a refused child.
ReasonMessage = tuple[str, str]
#: An Event to post: ``(type, reason, message)``.
EventSpec = tuple[str, str, str]


# ------------------------------------------------------------------------- what a step hands on


@dataclasses.dataclass(frozen=True)
class Desired:
    """What the spec asks for in this reconcile."""

    target: str  # revision hash of the spec
    graphs: wc.GraphConfig
    graph_config_hash: str  # config_hash(graphs)
    capture_sizes: list[int] | None  # resolved autoCaptureSizes (None: the spec's or the default grid)
    warnings: tuple[ReasonMessage, ...]  # for the Reconciled condition
    failure: api.Failure | None  # for lastFailure (None: keep the previous one)


@dataclasses.dataclass(frozen=True)
class Observed:
    """Step 1's result: one GraphServing, what its spec asks and what runs for it."""

    namespace: str
    name: str
    body: dict[str, Any]  # the GraphServing as read (its status, to skip an unchanged write)
    gs: api.GraphServing
    now: dt.datetime
    desired: Desired
    deployments: dict[str, dict[str, Any]]  # revision hash -> its Deployment (owned by gs)
    infos: dict[str, status.RevisionInfo]  # every revision with a Deployment, and the target
    views: list[PodView]  # the worker Pods of those revisions


@dataclasses.dataclass(frozen=True)
class Applied:
    """Step 5's result: the revisions left after deletions, their traffic weights, refusals, and
    where the stable Service answers."""

    infos: dict[str, status.RevisionInfo]
    weights: dict[str, int]  # percent per revision
    rejected: list[ReasonMessage]  # (reason, message) per child the API server refused, in order
    address: str | None = None  # children.service_address of the stable Service (None: refused)


# ---------------------------------------------------------------------- pure decision functions


def spec_warnings(spec: api.GraphServingSpec) -> list[ReasonMessage]:
    """Warnings about a valid spec that cannot work as meant (graph mode without GPUs)."""
    if spec.graphs.mode is GraphMode.NONE or spec.runtime.gpus != 0:
        return []
    consequence = (
        "and will serve degraded (allowDegraded)" if spec.graphs.readiness.allow_degraded
        else "and allowDegraded is false, so they will not become ready"
    )
    return [(
        "GraphModeWithoutGPU",
        f"graphs.mode {spec.graphs.mode.value} without GPUs: workers cannot capture CUDA graphs " + consequence,
    )]


def observe(
    namespace: str,
    name: str,
    body: dict[str, Any],
    gs: api.GraphServing,
    now: dt.datetime,
    desired: Desired,
    deployments: Sequence[dict[str, Any]],
    pods: Sequence[dict[str, Any]],
    endpoint_slices: Sequence[dict[str, Any]] | None = None,
) -> Observed:
    """Index the Deployments ``gs`` owns by revision and view the Pods of those revisions; with
    ``endpoint_slices`` (the GraphServing's, as read), a Pod is routable only once its revision
    Service's EndpointSlices list it ready (:attr:`PodView.routable`)."""
    spec = gs.spec
    by_rev: dict[str, dict[str, Any]] = {}
    infos: dict[str, status.RevisionInfo] = {}
    for d in deployments:
        if not children.owned_by(d, gs.metadata.uid):
            continue
        rev = d["metadata"]["labels"].get(naming.LABEL_REVISION)
        ann = d["metadata"].get("annotations") or {}
        by_rev[rev] = d
        infos[rev] = status.RevisionInfo(
            rev, ann.get(naming.ANNOTATION_MODEL_REVISION, ""), ann.get(naming.ANNOTATION_DTYPE),
            ann.get(naming.ANNOTATION_GRAPH_CONFIG_HASH)
        )
    target = desired.target
    infos[target] = status.RevisionInfo(target, spec.model.revision, spec.model.dtype, desired.graph_config_hash)
    policy = spec.graphs.readiness.to_worker()
    views = with_capacity_bounds([
        view(
            pod,
            model_name=spec.model.name,
            model_revision=infos[rev].model_revision,
            policy=policy,
            desired_graph_config_hash=desired.graph_config_hash if rev == target else None,
        )
        for pod in pods
        if (rev := (pod["metadata"].get("labels") or {}).get(naming.LABEL_REVISION)) in infos
    ])
    if endpoint_slices is not None:
        listed = {rev: routable_pods(endpoint_slices, naming.revision_name(name, rev)) for rev in infos}
        views = [dataclasses.replace(v, routable=v.name in listed.get(v.revision, set())) for v in views]
    return Observed(namespace, name, body, gs, now, desired, by_rev, infos, views)


def gate_event(v: PodView) -> EventSpec | None:
    """The Event that goes with a changed graphs-ready gate: a rejected report or a worker that
    will not get ready alone (Warning), a gate that became True (Normal); else None."""
    d = v.decision
    if v.validation.reason in REJECTIONS:
        return "Warning", v.validation.reason, v.validation.message
    if d.reason in WARNING_REASONS:
        return "Warning", d.reason, d.message
    if d.ready:
        return "Normal", d.reason, d.message
    return None


def _restart_event(v: PodView) -> tuple[str, str] | None:
    return restart_event(v.container, v.annotation(naming.ANNOTATION_OBSERVED_RESTARTS), v.restart)


def _divergence_event(v: PodView) -> tuple[str, str] | None:
    return divergence_event(v.report, v.annotation(naming.ANNOTATION_OBSERVED_DIVERGENCES))


def pod_events(v: PodView) -> list[EventSpec]:
    """Warning Events about the Pod beyond its gate's: a worker container restart not posted yet
    (once per ``restartCount``) and online canary divergences not posted yet (once per increase);
    :func:`pod_annotations` records both on the Pod."""
    return [("Warning", *e) for e in (_restart_event(v), _divergence_event(v)) if e is not None]


def pod_annotations(v: PodView) -> dict[str, str]:
    """Annotations the Pod lacks: a newly accepted report's marker, its deletion cost (capacity),
    the first accepted capacity of its worker instance, and what :func:`pod_events` posted."""
    annotations: dict[str, str] = {}
    marker = v.accepted_marker_changed
    if marker:
        annotations[naming.ANNOTATION_ACCEPTED_REPORT] = marker
    cost = str(int(v.capacity))
    if v.report is not None and v.annotation(naming.POD_DELETION_COST) != cost:
        annotations[naming.POD_DELETION_COST] = cost
    accepted = capacity_to_record(v)
    if accepted:
        annotations[naming.ANNOTATION_ACCEPTED_CAPACITY] = accepted
    if v.container is not None and _restart_event(v) is not None:
        annotations[naming.ANNOTATION_OBSERVED_RESTARTS] = str(v.container.restart_count)
    if v.report is not None and _divergence_event(v) is not None:
        annotations[naming.ANNOTATION_OBSERVED_DIVERGENCES] = divergence_marker(v.report)
    return annotations


def recapture_request(v: PodView, desired: Desired) -> str | None:
    """The recapture request (JSON) for a serving worker whose graphs are another configuration's,
    unless the Pod already carries one for this configuration; else None."""
    report = v.report
    if v.terminating or report is None or report.phase not in (Phase.READY, Phase.DEGRADED):
        return None
    if report.graph_config_hash == desired.graph_config_hash:
        return None
    request = RecaptureRequest(graph_config_hash=desired.graph_config_hash, graphs=desired.graphs)
    asked = (v.raw["metadata"].get("annotations") or {}).get(RECAPTURE_ANNOTATION)
    if asked:
        try:
            if RecaptureRequest.model_validate_json(asked).graph_config_hash == desired.graph_config_hash:
                return None
        except pydantic.ValidationError:
            pass
    return request.model_dump_json(by_alias=True)


def decide_rollout(seen: Observed) -> rollout.Decision:
    """Step 4: the rollout step over the observed revisions and the state kept in status."""
    revisions = {
        rev: rollout.RevisionState(
            rev,
            int((dep["spec"] or {}).get("replicas") or 0),
            tuple(
                rollout.PodCapacity(v.name, v.serving, v.capacity, v.decision.canary_failed)
                for v in seen.views
                if v.revision == rev and not v.terminating
            ),
        )
        for rev, dep in seen.deployments.items()
    }
    gs, desired = seen.gs, seen.desired
    previous_state = (gs.status.rollout if gs.status else None) or api.RolloutStatus()
    return rollout.step(
        desired.target, revisions, gs.spec.replicas, gs.spec.rollout, previous_state, seen.now,
        desired.graph_config_hash,
    )


def traffic_weights(
    views: Sequence[PodView], infos: Mapping[str, status.RevisionInfo], serving_target: str,
    replicas: Mapping[str, int] | None = None,
) -> dict[str, int]:
    """Percent of traffic per revision, proportional to the live Pods' measured capacity.

    A revision that ``replicas`` (this reconcile's decision) scales to zero counts at zero: its
    Pods get SIGTERM now, and the route written in the same reconcile must already send its share
    elsewhere (the workers keep serving for their shutdown delay while the gateway applies it,
    docs/rollout-traffic.md)."""
    replicas = replicas or {}
    capacity = {rev: 0.0 if replicas.get(rev, 1) == 0 else
                sum(v.capacity for v in views if v.revision == rev and not v.terminating) for rev in infos}
    return routing.capacity_weights(capacity, serving_target)


def outcome(
    seen: Observed, decision: rollout.Decision, rejected: Sequence[ReasonMessage]
) -> tuple[list[ReasonMessage], api.Failure | None, list[EventSpec]]:
    """``(warnings, failure, events)`` of this reconcile.

    Refused children come first in the ``Reconciled`` condition (nothing else matters while a child
    cannot be written) and are the failure, with an Event unless ``lastFailure`` says so already;
    clamped capacities come next, each with an Event unless the last False ``Reconciled`` condition
    names it already;
    a Warning Event of the rollout (a rollback, a deadline) is the failure after that.
    """
    desired, now = seen.desired, seen.now
    clamps = capacity_warnings(seen.views)
    warnings = [*rejected, *clamps, *desired.warnings]
    failure = desired.failure
    to_post: list[EventSpec] = [("Warning", r, m) for r, m in clamps if m not in _previous_warnings(seen.gs)]
    if rejected:
        reason, message = rejected[0]
        failure = api.Failure(reason=reason, message=message, revision=desired.target, time=now)
        last = seen.gs.status.last_failure if seen.gs.status else None
        if last is None or (last.reason, last.message) != (reason, message):
            to_post.append(("Warning", reason, message))
    for e in decision.events:
        to_post.append((e.type, e.reason, e.message))
        if e.type == "Warning":
            failure = api.Failure(reason=e.reason, message=e.message, revision=desired.target, time=now)
    return warnings, failure, to_post


def capacity_warnings(views: Sequence[PodView]) -> list[ReasonMessage]:
    """``CapacityClamped`` warnings, one per serving Pod whose reported capacity was bounded."""
    return [(CLAMP_REASON, v.clamp.message(v.name)) for v in views if v.serving and v.clamp is not None]


def _previous_warnings(gs: api.GraphServing) -> str:
    """The warnings of the ``Reconciled`` condition as last written (a clamp in them was posted
    already); empty while it is True."""
    previous = gs.status.conditions if gs.status else []
    return next((c.message for c in previous if c.type == api.RECONCILED and c.status == "False"), "")


def requeue_after(decision: rollout.Decision, infos: Mapping[str, status.RevisionInfo],
                  views: Sequence[PodView] = ()) -> float:
    """Soon while a rollout moves, old revisions remain or a ready Pod awaits its endpoints (no
    Pod event follows its EndpointSlice listing); else a slow resync."""
    if decision.state.phase in rollout.MOVING or len(infos) > 1 or any(v.awaiting_endpoints for v in views):
        return ACTIVE_REQUEUE_SECONDS
    return IDLE_RESYNC_SECONDS
