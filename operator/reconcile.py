"""One GraphServing reconcile: read, decide (pure functions), write. All side effects live here.

:meth:`Reconciler._reconcile` is the list of its steps, in order:

1. **read** (:meth:`~Reconciler._read`): the GraphServing, what its spec asks for (the revision
   hash, the graph config, ``autoCaptureSizes`` resolved through its ConfigMap), its Deployments and
   its worker Pods (two list calls), each Pod's report validated and its graphs-ready gate decided
   (:class:`Observed`);
2. **sync pods** (:meth:`~Reconciler._sync_pods`): per Pod, write the gate condition through the
   ``pods/status`` subresource when it changed (plus an Event when a report is rejected), post the
   Events of a worker container restart or online canary divergence not posted yet, record the
   accepted report marker, the pod-deletion cost (its capacity), the first accepted capacity and
   what those Events posted;
3. **recapture** (:meth:`~Reconciler._recapture`): ask workers whose report is about another graph
   configuration to recapture;
4. **rollout** (:func:`.decisions.decide_rollout`, pure): the rollout step's replicas per revision;
5. **apply children** (:meth:`~Reconciler._apply_children`), in dependency order: the workers'
   ServiceAccount and RBAC, Services and the PodDisruptionBudget (server-side apply, only when
   changed), then the revisions (create the target Deployment, scale and delete the others), then
   the HTTPRoute; a child the API server refuses goes to the ``Reconciled`` condition (False),
   ``lastFailure`` and an Event;
6. **write status** (:meth:`~Reconciler._write_status`): Events for transitions, status (one JSON
   patch of ``/status``, only when changed) and the per-GraphServing metrics.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import pydantic
from kubernetes.client.rest import ApiException

from graphserving.contract import graphserving_types as api
from graphserving.contract.report import RECAPTURE_ANNOTATION, config_hash
from . import children, events, kube, naming, routing, rollout, status
from .decisions import (
    Applied,
    Desired,
    Observed,
    ReasonMessage,
    decide_rollout,
    gate_event,
    observe,
    outcome,
    pod_annotations,
    pod_events,
    recapture_request,
    requeue_after,
    spec_warnings,
    traffic_weights,
)
from .kube import Clients
from .metrics import OperatorMetrics
from .pods import PodView, gate_condition
from .report_validation import REJECTIONS

log = logging.getLogger(__name__)


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc).replace(microsecond=0)


class CaptureSizeResolutionError(RuntimeError):
    """``autoCaptureSizes`` could not be resolved (ConfigMap, histogram or planner)."""


def plan_from_histogram(text: str, max_graphs: int, maximum: int, source: str) -> list[int]:
    """The planner's capture sizes for the CSV histogram ``text`` (always ending at ``maximum``).

    Raises:
        CaptureSizeResolutionError: the planner is not installed, or it refused the histogram.
    """
    try:
        from graphserving.planner.histogram import parse_csv
        from graphserving.planner.optimize import Budget, plan_capture_sizes
    except ImportError as exc:  # the planner is an optional part of an operator image
        raise CaptureSizeResolutionError(f"the planner is not installed: {exc}") from exc
    try:
        plan = plan_capture_sizes(parse_csv(text, source=source), budget=Budget(max_graphs=max_graphs), maximum=maximum)
    except ValueError as exc:
        raise CaptureSizeResolutionError(str(exc)) from exc
    return list(plan.capture_sizes)


class Reconciler:
    """Reconciles GraphServings. Thread-safe: one lock per GraphServing serialises its reconciles."""

    def __init__(
        self,
        clients: Clients,
        metrics: OperatorMetrics | None = None,
        clock: Callable[[], dt.datetime] = utcnow,
        recapture_http: Callable[[str, int, str], None] | None = None,
    ) -> None:
        self.k = clients
        self.metrics = metrics or OperatorMetrics()
        self.clock = clock
        self.recapture_http = recapture_http if recapture_http is not None else _post_recapture
        #: What was last applied per (kind, namespace, name); None: known absent (a removed HTTPRoute).
        self._applied: dict[tuple[str, str, str], str | None] = {}
        self._locks: dict[tuple[str, str], threading.Lock] = {}
        self._locks_guard = threading.Lock()

    # ------------------------------------------------------------------------------ entry point

    def reconcile(self, namespace: str, name: str) -> float | None:
        """Reconcile one GraphServing; returns seconds until it wants to run again (None: never)."""
        with self._locks_guard:
            lock = self._locks.setdefault((namespace, name), threading.Lock())
        with lock:
            started = time.perf_counter()
            try:
                requeue = self._reconcile(namespace, name)
            except Exception as exc:
                self.metrics.reconcile_total.labels("error").inc()
                self.metrics.reconcile_errors.labels(type(exc).__name__).inc()
                raise
            finally:
                self.metrics.reconcile_seconds.observe(time.perf_counter() - started)
            self.metrics.reconcile_total.labels("ok").inc()
            return requeue

    def _reconcile(self, namespace: str, name: str) -> float | None:
        """The six steps of the module docstring, in order; returns the requeue delay."""
        seen = self._read(namespace, name)
        if seen is None:  # gone, being deleted, or an invalid spec (recorded)
            return None
        self._sync_pods(seen)
        self._recapture(seen)
        decision = decide_rollout(seen)
        applied = self._apply_children(seen, decision)
        self._write_status(seen, decision, applied)
        return requeue_after(decision, applied.infos, seen.views)

    def child_changed(self, kind: str, namespace: str, name: str) -> None:
        """A child (Service, PodDisruptionBudget, HTTPRoute) changed or went away outside this
        reconciler: apply it again on the next reconcile instead of trusting what was last applied."""
        self._applied.pop((kind, namespace, name), None)

    def forget(self, namespace: str, name: str) -> None:
        self.metrics.forget_graphserving(namespace, name)
        for key in [k for k in self._applied if k[1] == namespace and (_belongs(k[2], name) or k[0] in _SHARED)]:
            self._applied.pop(key, None)

    # ------------------------------------------------------------------------------- 1. read

    def _read(self, namespace: str, name: str) -> Observed | None:
        """The GraphServing, what it asks for, its Deployments, Pods and EndpointSlices; None: nothing to do."""
        read = self._read_graphserving(namespace, name)
        if read is None:
            return None
        body, gs, now = read
        desired = self._desired(namespace, gs, now)
        selector = naming.selector_string(naming.selector_labels(name))
        deployments = _items(self.k.apps.list_namespaced_deployment(namespace, label_selector=selector, _preload_content=False))
        pods = _items(self.k.core.list_namespaced_pod(namespace, label_selector=selector, _preload_content=False))
        # the EndpointSlice controller copies the Services' labels onto their slices
        slices = self.k.custom.list_namespaced_custom_object(
            "discovery.k8s.io", "v1", namespace, "endpointslices", label_selector=selector)["items"]
        return observe(namespace, name, body, gs, now, desired, deployments, pods, slices)

    def _read_graphserving(self, namespace: str, name: str) -> tuple[dict, api.GraphServing, dt.datetime] | None:
        """``(body, model, now)``; None when it is gone (forgotten), being deleted (owner references
        let the garbage collector remove the children) or its spec is invalid (recorded)."""
        try:
            body = self.k.custom.get_namespaced_custom_object(api.GROUP, api.VERSION, namespace, api.PLURAL, name)
        except ApiException as exc:
            if exc.status == 404:
                self.forget(namespace, name)
                return None
            raise
        if (body.get("metadata") or {}).get("deletionTimestamp"):
            return None
        now = self.clock()
        try:
            gs = api.GraphServing.model_validate(body)
        except pydantic.ValidationError as exc:
            self._record_invalid(body, exc, now)
            return None
        return body, gs, now

    def _desired(self, namespace: str, gs: api.GraphServing, now: dt.datetime) -> Desired:
        """The revision and graph config the spec asks for; an unresolvable ``autoCaptureSizes``
        falls back to the default grid with a warning and a failure."""
        spec = gs.spec
        target = naming.revision_hash(spec)
        warnings = spec_warnings(spec)
        failure: api.Failure | None = None
        capture_sizes: list[int] | None = None
        if spec.graphs.auto_capture_sizes is not None:
            try:
                capture_sizes = self._resolve_auto(namespace, spec)
            except CaptureSizeResolutionError as exc:
                failure = api.Failure(reason="CaptureSizesUnresolved", message=str(exc), revision=target, time=now)
                warnings.append(("CaptureSizesUnresolved", f"{exc}; using the default grid"))
        graphs = spec.graphs.to_worker(capture_sizes)
        return Desired(target, graphs, config_hash(graphs), capture_sizes, tuple(warnings), failure)

    def _resolve_auto(self, namespace: str, spec: api.GraphServingSpec) -> list[int]:
        auto = spec.graphs.auto_capture_sizes
        assert auto is not None
        try:
            cm = self.k.core.read_namespaced_config_map(auto.histogram_config_map, namespace)
        except ApiException as exc:
            raise CaptureSizeResolutionError(
                f"ConfigMap {namespace}/{auto.histogram_config_map}: {exc.status} {exc.reason}"
            ) from exc
        text = (cm.data or {}).get(auto.key)
        if text is None:
            raise CaptureSizeResolutionError(f"ConfigMap {auto.histogram_config_map} has no key {auto.key!r}")
        return plan_from_histogram(text, auto.max_graphs, spec.runtime.engine.max_num_seqs, auto.histogram_config_map)

    # -------------------------------------------------------------------------- 2. sync pods

    def _sync_pods(self, seen: Observed) -> None:
        """Every live Pod's graphs-ready gate and annotations (a Pod gone meanwhile is skipped)."""
        for v in seen.views:
            self._sync_pod(seen.gs.metadata.namespace or "", v, seen.now)

    def _sync_pod(self, namespace: str, v: PodView, now: dt.datetime) -> None:
        if v.terminating:
            return
        d = v.decision
        if (v.gate_status, v.gate_reason) != (d.status, d.reason) and not self._write_gate(namespace, v, now):
            return  # the Pod is gone
        for event in pod_events(v):  # recorded by the annotations below, so posted once
            events.post(self.k.core, _pod_ref(v), *event)
        annotations = pod_annotations(v)
        if annotations:
            try:
                self.k.core.patch_namespaced_pod(
                    v.name, namespace, {"metadata": {"annotations": annotations}},
                    field_manager=naming.FIELD_MANAGER, _content_type=kube.MERGE,
                )
            except ApiException as exc:
                if exc.status != 404:
                    raise

    def _write_gate(self, namespace: str, v: PodView, now: dt.datetime) -> bool:
        """Write the graphs-ready condition (and its Event); False when the Pod is gone (404)."""
        d = v.decision
        cond = gate_condition(d, now.strftime("%Y-%m-%dT%H:%M:%SZ"))
        try:
            self.k.core.patch_namespaced_pod_status(
                v.name, namespace, {"status": {"conditions": [cond]}},
                field_manager=naming.FIELD_MANAGER, _content_type=kube.STRATEGIC,
            )
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise
        self.metrics.gate_updates.labels(d.status).inc()
        if v.validation.reason in REJECTIONS:
            self.metrics.report_rejections.labels(v.validation.reason).inc()
        event = gate_event(v)
        if event is not None:
            events.post(self.k.core, _pod_ref(v), *event)
        return True

    # -------------------------------------------------------------------------- 3. recapture

    def _recapture(self, seen: Observed) -> None:
        """Ask the target's serving workers with another graph config to recapture: the Pod
        annotation (the durable trigger), an Event, and a best-effort POST to the worker.

        Workers behind an API key (``runtime.apiKeySecretRef``) get no POST: the endpoint needs the
        key (runtime/api/access.py), which the operator does not read, so they pick the annotation
        up when they next poll their Pod (runtime/lifecycle/publisher.py, every 5 s)."""
        port = seen.gs.spec.runtime.port
        post = seen.gs.spec.runtime.api_key_secret_ref is None
        for v in seen.views:
            if v.revision != seen.desired.target:
                continue
            payload = recapture_request(v, seen.desired)
            if payload is None:
                continue
            self.k.core.patch_namespaced_pod(
                v.name, v.raw["metadata"]["namespace"], {"metadata": {"annotations": {RECAPTURE_ANNOTATION: payload}}},
                field_manager=naming.FIELD_MANAGER, _content_type=kube.MERGE,
            )
            events.post(self.k.core, _pod_ref(v), "Normal", "RecaptureRequested",
                        f"graph config {seen.desired.graph_config_hash}")
            if post and v.pod_ip:
                self.recapture_http(v.pod_ip, port, payload)

    # --------------------------------------------------------------------- 5. apply children

    def _apply_children(self, seen: Observed, decision: rollout.Decision) -> Applied:
        """What a Deployment's Pods need before it exists (the workers' ServiceAccount and RBAC,
        else the ReplicaSet's first Pod creations fail; Services; the PodDisruptionBudget), then
        the HTTPRoute over the revision Services (removed when ``spec.routing`` is unset; a
        revision scaled to zero or deleted has no weight in it), then the revisions (create,
        scale, delete)."""
        rejected: list[ReasonMessage] = []
        infos = {rev: info for rev, info in seen.infos.items() if rev not in decision.delete}
        for obj in children.worker_rbac(seen.namespace):
            self._apply(obj)
        gs = seen.gs
        service = children.stable_service(gs)
        address = children.service_address(service) if self._apply_child(service, rejected) else None
        for rev in infos:
            self._apply_child(children.revision_service(gs, rev), rejected)
        self._apply_child(children.pod_disruption_budget(gs), rejected)
        # the route first: it must stop naming a revision before that revision's Service is
        # deleted (a gateway refuses a backendRef to a missing Service) or its Pods are stopped
        weights = traffic_weights(seen.views, infos, decision.serving_target, decision.replicas)
        route = routing.http_route(gs, {r: w for r, w in weights.items() if r in infos}, children.owner_reference(gs))
        if route is not None:
            self._apply_child(route, rejected)
        else:
            self._remove_route(gs)
        self._apply_revisions(seen, decision, rejected)
        return Applied(infos, weights, rejected, address)

    def _apply_revisions(self, seen: Observed, decision: rollout.Decision, rejected: list[ReasonMessage]) -> None:
        """Create the target's Deployment, scale the others, delete the finished ones (with their
        revision Services)."""
        target = seen.desired.target
        startup = max((s for v in seen.views if (s := v.startup_seconds) is not None), default=None)
        for rev, replicas in decision.replicas.items():
            dep = seen.deployments.get(rev)
            if dep is None:
                if rev == target:
                    obj = children.deployment(seen.gs, target, replicas, seen.desired.graphs, startup)
                    self._apply_child(obj, rejected, force_create=True)
                continue
            if int(dep["spec"].get("replicas") or 0) != replicas:
                self.k.apps.patch_namespaced_deployment_scale(
                    naming.revision_name(seen.name, rev), seen.namespace, {"spec": {"replicas": replicas}},
                    field_manager=naming.FIELD_MANAGER, _content_type=kube.MERGE,
                )
        for rev in decision.delete:
            self._delete_revision(seen.namespace, seen.name, rev)

    def _apply(self, obj: dict[str, Any], force_create: bool = False) -> None:
        """Server-side apply ``obj`` (:data:`kube.PATCH_BY_KIND`) unless its content was applied last.

        Raises:
            ValueError: a kind the operator does not write.
            ApiException: the API server refused it.
        """
        meta = obj["metadata"]
        key = (obj["kind"], meta["namespace"], meta["name"])
        content = children.content_key(obj)
        if not force_create and self._applied.get(key) == content:
            return
        kind, ns, name = key
        patch = kube.PATCH_BY_KIND.get(kind)
        if patch is None:
            raise ValueError(f"cannot apply kind {kind}")
        patch(self.k, name, ns, obj, field_manager=naming.FIELD_MANAGER, force=True, _content_type=kube.APPLY)
        self._applied[key] = content

    def _apply_child(self, obj: dict[str, Any], rejected: list[ReasonMessage], force_create: bool = False) -> bool:
        """:meth:`_apply`, with a refusal collected in ``rejected`` as ``(reason, message)``;
        whether ``obj`` stands applied (False: refused).

        A child rendered from the spec can be refused by the API server (400/422: e.g. an invalid
        ``podTemplate`` pass-through field, which the CRD keeps open) or have no API to go to (404:
        an HTTPRoute without the Gateway API installed). Retrying cannot help until the spec or the
        cluster changes, so the reconcile goes on and reports it in status and an Event rather than
        failing before anything is written.
        """
        try:
            self._apply(obj, force_create=force_create)
        except ApiException as exc:
            if exc.status not in (400, 404, 422):
                raise
            kind, name = obj["kind"], obj["metadata"]["name"]
            rejected.append((f"{kind}Rejected", f"{kind} {name}: {exc.status} {_api_message(exc)}"[:1024]))
            return False
        return True

    def _remove_route(self, gs: api.GraphServing) -> None:
        """Delete the HTTPRoute ``gs`` owns once ``spec.routing`` is unset.

        A route left behind keeps splitting traffic by the weights last written, to revision
        Services that later rollouts delete. Only a route owned by ``gs`` goes (precondition on its
        uid); a route of the same name that someone else made stays. Checked once per operator run
        (then remembered as absent until :meth:`child_changed`); a missing Gateway API is no route.
        """
        ns, name = gs.metadata.namespace or "", gs.metadata.name
        key = ("HTTPRoute", ns, name)
        if key in self._applied and self._applied[key] is None:
            return
        try:
            route = self.k.custom.get_namespaced_custom_object(routing.GROUP, routing.VERSION, ns, routing.PLURAL, name)
        except ApiException as exc:
            if exc.status != 404:
                raise
            route = None
        if route is not None and children.owned_by(route, gs.metadata.uid):
            try:
                self.k.custom.delete_namespaced_custom_object(
                    routing.GROUP, routing.VERSION, ns, routing.PLURAL, name,
                    body={"preconditions": {"uid": route["metadata"]["uid"]}},
                )
            except ApiException as exc:
                if exc.status not in (404, 409):
                    raise
        self._applied[key] = None

    def _delete_revision(self, namespace: str, name: str, rev: str) -> None:
        child = naming.revision_name(name, rev)
        for delete in (self.k.apps.delete_namespaced_deployment, self.k.core.delete_namespaced_service):
            try:
                delete(child, namespace)
            except ApiException as exc:
                if exc.status != 404:
                    raise
        self._applied.pop(("Deployment", namespace, child), None)
        self._applied.pop(("Service", namespace, child), None)

    # ------------------------------------------------------------------------ 6. write status

    def _write_status(self, seen: Observed, decision: rollout.Decision, applied: Applied) -> None:
        """Events, then ``status`` (only when changed), then the GraphServing's metrics."""
        warnings, failure, to_post = outcome(seen, decision, applied.rejected)
        for type_, reason, message in to_post:
            events.post(self.k.core, seen.body, type_, reason, message)
        new_status = status.aggregate(
            seen.gs, seen.desired.target, applied.infos, seen.views, decision, applied.weights, seen.now,
            warnings=warnings, failure=failure, capture_sizes=seen.desired.capture_sizes, address=applied.address,
        )
        self._patch_status(seen.gs, seen.body, new_status)
        self.metrics.observe_graphserving(
            seen.namespace,
            seen.name,
            decision.state.phase,
            {r.hash: (r.effective_capacity_tokens_per_second, r.traffic_weight, r.ready_replicas, r.degraded_replicas)
             for r in new_status.revisions},
        )

    def _patch_status(self, gs: api.GraphServing, body: dict, new: api.GraphServingStatus) -> None:
        value = new.to_api()
        if body.get("status") == value:
            return
        meta = gs.metadata
        self.k.custom.patch_namespaced_custom_object_status(
            api.GROUP, api.VERSION, meta.namespace, api.PLURAL, meta.name,
            [{"op": "add", "path": "/status", "value": value}],
            field_manager=naming.FIELD_MANAGER, _content_type=kube.JSON_PATCH,
        )

    def _record_invalid(self, body: dict, exc: pydantic.ValidationError, now: dt.datetime) -> None:
        meta = body["metadata"]
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        message = f"spec rejected by the operator: {where}: {first['msg']}"
        previous = (body.get("status") or {}).get("lastFailure") or {}
        if previous.get("message") == message:
            return
        events.post(self.k.core, body, "Warning", "InvalidSpec", message)
        failure = api.Failure(reason="InvalidSpec", message=message, time=now).to_api()
        self.k.custom.patch_namespaced_custom_object_status(
            api.GROUP, api.VERSION, meta["namespace"], api.PLURAL, meta["name"],
            {"status": {"lastFailure": failure, "observedGeneration": meta.get("generation")}},
            _content_type=kube.MERGE,
        )


_SHARED = ("ServiceAccount", "Role", "RoleBinding")


def _items(response: Any) -> list[dict]:
    """Items of a list call made with ``_preload_content=False`` (raw JSON: camelCase, no model overhead)."""
    return json.loads(response.data)["items"]


def _api_message(exc: ApiException) -> str:
    """The ``message`` of an API error's Status body (it names the field), else its HTTP reason."""
    try:
        return str(json.loads(exc.body)["message"])
    except (TypeError, ValueError, KeyError):
        return str(exc.reason)


def _belongs(child: str, name: str) -> bool:
    return child == name or child.startswith(f"{name}-")


def _pod_ref(v: PodView) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": v.raw["metadata"]}


def _post_recapture(ip: str, port: int, payload: str) -> None:
    """Best effort ``POST /v1/graphs/recapture`` (the annotation is the durable trigger)."""
    try:
        import httpx

        httpx.post(f"http://{ip}:{port}/v1/graphs/recapture", content=payload,
                   headers={"Content-Type": "application/json"}, timeout=2.0)
    except Exception as exc:  # the worker may not serve the endpoint yet; the annotation remains
        log.info("recapture POST to %s:%s failed: %s", ip, port, exc)
