"""GraphServing status aggregation (pure): pod views + rollout decision -> ``status``."""

from __future__ import annotations

import dataclasses
import datetime as dt
import statistics
from collections import Counter
from collections.abc import Mapping, Sequence

from graphserving.contract import graphserving_types as api
from . import divergence, naming
from .pods import PodView
from .rollout import Decision


@dataclasses.dataclass(frozen=True)
class RevisionInfo:
    """What the operator knows about a revision from its Deployment."""

    revision: str
    model_revision: str
    dtype: str | None
    graph_config_hash: str | None


def human_bytes(n: int | None) -> str | None:
    """Binary-prefixed size as kubectl prints quantities (``412Mi``, ``1.5Gi``)."""
    if n is None:
        return None
    for unit, scale in (("Gi", 1 << 30), ("Mi", 1 << 20), ("Ki", 1 << 10)):
        if n >= scale:
            value = n / scale
            return f"{value:.0f}{unit}" if value >= 10 else f"{value:.1f}{unit}"
    return f"{n}B"


def api_url(address: str | None) -> str | None:
    """The OpenAI API base URL served at ``address`` (``host:port``): ``http://<address>/v1``."""
    return f"http://{address}/v1" if address is not None else None


def set_condition(
    previous: Sequence[api.Condition],
    type_: str,
    status: str,
    reason: str,
    message: str,
    generation: int | None,
    now: dt.datetime,
) -> api.Condition:
    """A metav1.Condition; ``lastTransitionTime`` is kept unless ``status`` changed."""
    old = next((c for c in previous if c.type == type_), None)
    when = old.last_transition_time if old is not None and old.status == status else now
    return api.Condition(
        type=type_,
        status=status,  # type: ignore[arg-type]
        observed_generation=generation,
        last_transition_time=when,
        reason=reason,
        message=message[:32768],
    )


def revision_status(info: RevisionInfo, replicas: int, views: Sequence[PodView], weight: int) -> api.RevisionStatus:
    live = [v for v in views if not v.terminating]
    reports = [v.report for v in live if v.report is not None]
    captures: list[float] = []
    for r in reports:
        captures.extend(k.capture_seconds for k in r.keys if k.captured and k.capture_seconds is not None)
        if not r.keys and r.capture_seconds_max is not None:
            captures.append(r.capture_seconds_max)
    memory = [r.graph_memory.actual_bytes for r in reports]
    return api.RevisionStatus(
        hash=info.revision,
        model_revision=info.model_revision,
        dtype=info.dtype,
        graph_config_hash=info.graph_config_hash,
        replicas=replicas,
        ready_replicas=sum(1 for v in live if v.serving),
        degraded_replicas=sum(1 for v in live if v.degraded),
        coverage=min((r.coverage for r in reports), default=None),
        graph_memory_bytes=max(memory, default=None),
        capture_seconds_p50=statistics.median(captures) if captures else None,
        capture_seconds_max=max(captures, default=None),
        effective_capacity_tokens_per_second=round(sum(v.capacity for v in live), 3),
        traffic_weight=weight,
        canary_failures=sum(1 for v in live if v.decision.canary_failed),
    )


def _reason_summary(views: Sequence[PodView]) -> str:
    counts = Counter(f"{v.decision.reason}: {v.decision.message}" for v in views if not v.serving and not v.terminating)
    return "; ".join(f"{n} pod(s) {text}" for text, n in sorted(counts.items()))


#: A condition's ``(status, reason, message)``.
ConditionValue = tuple[str, str, str]


def ready_condition(live: Sequence[PodView], replicas: int) -> ConditionValue:
    """``Ready``: at least ``spec.replicas`` live Pods serve (the rest summarised by reason)."""
    ready = sum(1 for v in live if v.serving)
    if ready >= replicas:
        return "True", "ReplicasReady", f"{ready}/{replicas} workers graphs-ready"
    summary = f"; {_reason_summary(live)}" if live else ""
    return "False", "ReplicasNotReady", f"{ready}/{replicas} workers graphs-ready{summary}"


def degraded_condition(live: Sequence[PodView]) -> ConditionValue:
    """``Degraded``: some serving Pod serves degraded (``WorkersDegraded``, their reasons), or some
    live Pod's online canary diverged (``GraphsDiverged``: keys it took out of dispatch run eagerly)."""
    degraded = [v for v in live if v.degraded]
    reasons = "; ".join(sorted({f"{v.name}: {v.report.degraded_reason}" for v in degraded if v.report}))
    diverged = sorted((v.name, divergence.summary(v.report)) for v in live
                      if v.report is not None and v.report.online_canary_divergences > 0)
    divergences = "; ".join(f"{name}: {text}" for name, text in diverged)
    message = "; ".join(m for m in (reasons, divergences) if m) or "no worker serves degraded"
    if degraded:
        return "True", "WorkersDegraded", message
    if diverged:
        return "True", divergence.DIVERGED_REASON, message
    return "False", "NoDegradedWorkers", message


def capture_conditions(target_views: Sequence[PodView], policy: api.Readiness) -> tuple[ConditionValue, ConditionValue]:
    """``GraphsCaptured`` and ``CanaryPassed`` of the current revision's live Pods."""
    reports = [v.report for v in target_views if v.report is not None]
    if not reports:
        awaiting = ("Unknown", "AwaitingReports", "no report from the current revision yet")
        return awaiting, awaiting
    low = min(r.coverage for r in reports)
    captured = all(r.phase.value == "Ready" for r in reports) and low >= policy.min_coverage
    coverage = f"lowest coverage {low:.3f} (minCoverage {policy.min_coverage:.3f}); phases " + ", ".join(
        sorted({r.phase.value for r in reports})
    )
    graphs = ("True", "CoverageMet", coverage) if captured else ("False", "CoverageBelowPolicy", coverage)
    failed = sum(1 for v in target_views if v.decision.canary_failed)
    canary = (
        ("False", "CanaryFailed", f"{failed} pod(s) failed canaries")
        if failed
        else ("True", "CanariesPassed", "every captured key passed its canary")
    )
    return graphs, canary


#: The ``Reconciled`` condition's reason while nothing stands between the spec and what runs.
AS_SPECIFIED = "AsSpecified"


def reconciled_condition(warnings: Sequence[tuple[str, str]]) -> ConditionValue:
    """``Reconciled`` (:data:`api.ConditionType` says what it states): False with the first
    warning's reason and every warning's message; True (``AsSpecified``) without warnings."""
    if warnings:
        return "False", warnings[0][0], "; ".join(m for _, m in warnings)
    return "True", AS_SPECIFIED, "the spec is carried out as written and every capacity counts as reported"


def conditions(
    gs: api.GraphServing,
    live: Sequence[PodView],
    target_views: Sequence[PodView],
    decision: Decision,
    warnings: Sequence[tuple[str, str]],
    now: dt.datetime,
) -> list[api.Condition]:
    """One condition per :data:`api.CONDITION_TYPES`, in that order (``lastTransitionTime`` kept
    where the status holds)."""
    previous = (gs.status or api.GraphServingStatus()).conditions
    graphs, canary = capture_conditions(target_views, gs.spec.graphs.readiness)
    values: list[tuple[str, ConditionValue]] = [
        ("Ready", ready_condition(live, gs.spec.replicas)),
        ("Progressing", decision.progressing_condition),
        ("Degraded", degraded_condition(live)),
        ("GraphsCaptured", graphs),
        ("CanaryPassed", canary),
        (api.RECONCILED, reconciled_condition(warnings)),
    ]
    generation = gs.metadata.generation
    return [set_condition(previous, type_, *value, generation, now) for type_, value in values]


def aggregate(
    gs: api.GraphServing,
    target: str,
    infos: Mapping[str, RevisionInfo],
    views: Sequence[PodView],
    decision: Decision,
    weights: Mapping[str, int],
    now: dt.datetime,
    *,
    warnings: Sequence[tuple[str, str]] = (),
    failure: api.Failure | None = None,
    capture_sizes: list[int] | None = None,
    address: str | None = None,
) -> api.GraphServingStatus:
    """The new ``status`` of ``gs``.

    Args:
        target: revision hash of the current spec.
        infos: every revision with a Deployment (or about to get one).
        views: every worker Pod of ``gs``.
        decision: this reconcile's rollout decision.
        weights: traffic weight per revision (percent).
        warnings: (reason, message) pairs that make the ``Reconciled`` condition False (e.g. graph
            mode without GPU).
        address: :func:`.children.service_address` of the stable Service once applied, for
            ``status.address`` and ``status.url`` (None leaves both unset).
        failure: the failure to record in ``lastFailure`` (None keeps the previous one).
    """
    previous = gs.status or api.GraphServingStatus()
    by_rev: dict[str, list[PodView]] = {}
    for v in views:
        by_rev.setdefault(v.revision, []).append(v)
    revisions = [
        revision_status(infos[r], decision.replicas.get(r, 0), by_rev.get(r, []), weights.get(r, 0))
        for r in sorted(infos, key=lambda r: (r != target, r))
    ]
    live = [v for v in views if not v.terminating]
    ready = sum(1 for v in live if v.serving)
    capacity = sum(v.capacity for v in live)
    current = next((r for r in revisions if r.hash == target), None)
    target_views = [v for v in by_rev.get(target, []) if not v.terminating]
    replicas = gs.spec.replicas
    graph_memory = current.graph_memory_bytes if current else None
    return api.GraphServingStatus(
        observed_generation=gs.metadata.generation,
        replicas=len(live),
        ready_replicas=ready,
        degraded_replicas=sum(1 for v in live if v.degraded),
        updated_replicas=current.ready_replicas if current else 0,
        selector=naming.selector_string(naming.selector_labels(gs.metadata.name)),
        ready=f"{ready}/{replicas}",
        url=api_url(address),
        address=address,
        current_revision=target,
        coverage=f"{current.coverage * 100:.0f}%" if current and current.coverage is not None else None,
        graph_memory=human_bytes(graph_memory),
        capacity=f"{capacity:.0f} tok/s",
        effective_capacity_tokens_per_second=round(capacity, 3),
        capture_sizes=capture_sizes,
        conditions=conditions(gs, live, target_views, decision, warnings, now),
        revisions=revisions,
        rollout=decision.state,
        last_failure=failure or previous.last_failure,
    )
