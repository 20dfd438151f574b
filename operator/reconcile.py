"""One GraphServing reconcile: read, decide (pure modules), write. All side effects live here.

Order of a reconcile:

1. read the GraphServing, its Deployments and its worker Pods (two list calls);
2. per Pod: validate the report, decide the graphs-ready gate, write the Pod condition through the
   ``pods/status`` subresource when it changed (plus an Event when a report is rejected), record the
   accepted report marker and the pod-deletion cost (its capacity);
3. ask workers whose report is about another graph configuration to recapture;
4. the rollout step -> create the target Deployment (server-side apply) and scale the others;
5. Services, PodDisruptionBudget and the HTTPRoute (server-side apply, only when changed); a child the
   API server refuses (step 4 or 5) goes to the ``Warning`` condition, ``lastFailure`` and an Event;
6. status (one JSON patch of ``/status``, only when changed) and Events for transitions.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import pydantic
from kubernetes import client
from kubernetes.client.rest import ApiException

from graphserving.contract import graphserving_types as api
from graphserving.contract import worker_config as wc
from graphserving.contract.report import RECAPTURE_ANNOTATION, Phase, RecaptureRequest, config_hash
from . import children, events, naming, routing, rollout, status
from .metrics import OperatorMetrics
from .pods import PodView, gate_condition, view

log = logging.getLogger(__name__)

APPLY = "application/apply-patch+yaml"
MERGE = "application/merge-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"
JSON_PATCH = "application/json-patch+json"
#: Requeue while a rollout moves (progress deadline checks) and as a slow resync otherwise.
ACTIVE_REQUEUE_SECONDS = 5.0
IDLE_RESYNC_SECONDS = 300.0
_REJECTIONS = {
    "ReportOversized", "ReportMalformed", "ReportForeignPod", "ReportForeignModel",
    "ReportForeignRevision", "ReportContractMismatch", "ReportStale",
}


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc).replace(microsecond=0)


@dataclasses.dataclass
class Clients:
    core: client.CoreV1Api
    apps: client.AppsV1Api
    policy: client.PolicyV1Api
    custom: client.CustomObjectsApi
    rbac: client.RbacAuthorizationV1Api

    @classmethod
    def from_api_client(cls, api_client: client.ApiClient) -> Clients:
        return cls(
            client.CoreV1Api(api_client),
            client.AppsV1Api(api_client),
            client.PolicyV1Api(api_client),
            client.CustomObjectsApi(api_client),
            client.RbacAuthorizationV1Api(api_client),
        )


class CaptureSizeResolutionError(RuntimeError):
    """``autoCaptureSizes`` could not be resolved (ConfigMap, histogram or planner)."""


def plan_from_histogram(text: str, max_graphs: int, maximum: int, source: str) -> list[int]:
    """The planner's capture sizes for the CSV histogram ``text`` (always ending at ``maximum``)."""
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

    # -------------------------------------------------------------------------------- the steps

    def _reconcile(self, namespace: str, name: str) -> float | None:
        try:
            body = self.k.custom.get_namespaced_custom_object(api.GROUP, api.VERSION, namespace, api.PLURAL, name)
        except ApiException as exc:
            if exc.status == 404:
                self.forget(namespace, name)
                return None
            raise
        if (body.get("metadata") or {}).get("deletionTimestamp"):
            return None  # owner references let the garbage collector remove the children
        now = self.clock()
        try:
            gs = api.GraphServing.model_validate(body)
        except pydantic.ValidationError as exc:
            self._record_invalid(body, exc, now)
            return None
        spec = gs.spec
        target = naming.revision_hash(spec)
        warnings: list[tuple[str, str]] = []
        failure: api.Failure | None = None
        if spec.graphs.mode.value != "NONE" and spec.runtime.gpus == 0:
            warnings.append(
                (
                    "GraphModeWithoutGPU",
                    f"graphs.mode {spec.graphs.mode.value} without GPUs: workers cannot capture CUDA graphs "
                    + ("and will serve degraded (allowDegraded)" if spec.graphs.readiness.allow_degraded
                       else "and allowDegraded is false, so they will not become ready"),
                )
            )
        capture_sizes: list[int] | None = None
        if spec.graphs.auto_capture_sizes is not None:
            try:
                capture_sizes = self._resolve_auto(namespace, spec)
            except CaptureSizeResolutionError as exc:
                failure = api.Failure(reason="CaptureSizesUnresolved", message=str(exc), revision=target, time=now)
                warnings.append(("CaptureSizesUnresolved", f"{exc}; using the default grid"))
        graphs = spec.graphs.to_worker(capture_sizes)
        desired_hash = config_hash(graphs)

        selector = naming.selector_string(naming.selector_labels(name))
        deployments = [
            d for d in _items(self.k.apps.list_namespaced_deployment(namespace, label_selector=selector, _preload_content=False))
            if _owned_by(d, gs.metadata.uid)
        ]
        pods = _items(self.k.core.list_namespaced_pod(namespace, label_selector=selector, _preload_content=False))

        infos: dict[str, status.RevisionInfo] = {}
        dep_by_rev: dict[str, dict] = {}
        for d in deployments:
            rev = d["metadata"]["labels"].get(naming.LABEL_REVISION)
            ann = d["metadata"].get("annotations") or {}
            dep_by_rev[rev] = d
            infos[rev] = status.RevisionInfo(
                rev, ann.get(naming.ANNOTATION_MODEL_REVISION, ""), ann.get(naming.ANNOTATION_DTYPE),
                ann.get(naming.ANNOTATION_GRAPH_CONFIG_HASH)
            )
        infos[target] = status.RevisionInfo(target, spec.model.revision, spec.model.dtype, desired_hash)

        policy = spec.graphs.readiness.to_worker()
        views: list[PodView] = []
        for pod in pods:
            rev = (pod["metadata"].get("labels") or {}).get(naming.LABEL_REVISION)
            if rev not in infos:
                continue
            views.append(
                view(
                    pod,
                    model_name=spec.model.name,
                    model_revision=infos[rev].model_revision,
                    policy=policy,
                    desired_graph_config_hash=desired_hash if rev == target else None,
                )
            )
        for v in views:
            self._sync_pod(gs, v, now)
        for v in views:
            if v.revision == target:
                self._maybe_recapture(v, desired_hash, graphs, spec.runtime.port)

        revisions = {
            rev: rollout.RevisionState(
                rev,
                int((dep_by_rev[rev]["spec"] or {}).get("replicas") or 0),
                tuple(
                    rollout.PodCapacity(v.name, v.serving, v.capacity, v.decision.canary_failed)
                    for v in views
                    if v.revision == rev and not v.terminating
                ),
            )
            for rev in dep_by_rev
        }
        previous_state = (gs.status.rollout if gs.status else None) or api.RolloutStatus()
        decision = rollout.step(target, revisions, spec.replicas, spec.rollout, previous_state, now, desired_hash)

        startup = max((s for v in views if (s := v.startup_seconds) is not None), default=None)
        rejected: list[tuple[str, str]] = []
        for rev, replicas in decision.replicas.items():
            if rev not in dep_by_rev:
                if rev == target:
                    self._apply_child(
                        children.deployment(gs, target, replicas, graphs, startup), rejected, force_create=True
                    )
                continue
            if int(dep_by_rev[rev]["spec"].get("replicas") or 0) != replicas:
                self.k.apps.patch_namespaced_deployment_scale(
                    naming.revision_name(name, rev), namespace, {"spec": {"replicas": replicas}},
                    field_manager=naming.FIELD_MANAGER, _content_type=MERGE,
                )
        for rev in decision.delete:
            self._delete_revision(namespace, name, rev)
            infos.pop(rev, None)

        capacity = {
            rev: sum(v.capacity for v in views if v.revision == rev and not v.terminating) for rev in infos
        }
        weights = routing.capacity_weights(capacity, decision.serving_target)
        for obj in children.worker_rbac(namespace):
            self._apply(obj)
        self._apply_child(children.stable_service(gs), rejected)
        for rev in infos:
            self._apply_child(children.revision_service(gs, rev), rejected)
        self._apply_child(children.pod_disruption_budget(gs), rejected)
        route = routing.http_route(gs, {r: w for r, w in weights.items() if r in infos}, children.owner_reference(gs))
        if route is not None:
            self._apply_child(route, rejected)
        else:
            self._remove_route(gs)

        if rejected:
            # First in the Warning condition: nothing else matters while a child cannot be written.
            warnings[:0] = rejected
            reason, message = rejected[0]
            failure = api.Failure(reason=reason, message=message, revision=target, time=now)
            last = gs.status.last_failure if gs.status else None
            if last is None or (last.reason, last.message) != (reason, message):
                events.post(self.k.core, body, "Warning", reason, message)
        for e in decision.events:
            events.post(self.k.core, body, e.type, e.reason, e.message)
            if e.type == "Warning":
                failure = api.Failure(reason=e.reason, message=e.message, revision=target, time=now)
        new_status = status.aggregate(
            gs, target, infos, views, decision, weights, now,
            warnings=warnings, failure=failure, capture_sizes=capture_sizes,
        )
        self._write_status(gs, body, new_status)
        self.metrics.observe_graphserving(
            namespace,
            name,
            decision.state.phase,
            {r.hash: (r.effective_capacity_tokens_per_second, r.traffic_weight, r.ready_replicas, r.degraded_replicas)
             for r in new_status.revisions},
        )
        if decision.state.phase in ("Progressing", "DeadlineExceeded") or len(infos) > 1:
            return ACTIVE_REQUEUE_SECONDS
        return IDLE_RESYNC_SECONDS

    # ---------------------------------------------------------------------------------- helpers

    def child_changed(self, kind: str, namespace: str, name: str) -> None:
        """A child (Service, PodDisruptionBudget, HTTPRoute) changed or went away outside this
        reconciler: apply it again on the next reconcile instead of trusting what was last applied."""
        self._applied.pop((kind, namespace, name), None)

    def forget(self, namespace: str, name: str) -> None:
        self.metrics.forget_graphserving(namespace, name)
        for key in [k for k in self._applied if k[1] == namespace and (_belongs(k[2], name) or k[0] in _SHARED)]:
            self._applied.pop(key, None)

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

    def _sync_pod(self, gs: api.GraphServing, v: PodView, now: dt.datetime) -> None:
        if v.terminating:
            return
        namespace = gs.metadata.namespace or ""
        d = v.decision
        if (v.gate_status, v.gate_reason) != (d.status, d.reason):
            cond = gate_condition(d, now.strftime("%Y-%m-%dT%H:%M:%SZ"))
            try:
                self.k.core.patch_namespaced_pod_status(
                    v.name, namespace, {"status": {"conditions": [cond]}},
                    field_manager=naming.FIELD_MANAGER, _content_type=STRATEGIC,
                )
            except ApiException as exc:
                if exc.status == 404:
                    return
                raise
            self.metrics.gate_updates.labels(d.status).inc()
            if v.validation.reason in _REJECTIONS:
                self.metrics.report_rejections.labels(v.validation.reason).inc()
                events.post(self.k.core, _pod_ref(v), "Warning", v.validation.reason, v.validation.message)
            elif d.reason in ("CanaryFailed", "WorkerFailed", "DegradedNotAllowed"):
                events.post(self.k.core, _pod_ref(v), "Warning", d.reason, d.message)
            elif d.ready:
                events.post(self.k.core, _pod_ref(v), "Normal", d.reason, d.message)
        annotations: dict[str, str] = {}
        marker = v.accepted_marker_changed
        if marker:
            annotations[naming.ANNOTATION_ACCEPTED_REPORT] = marker
        cost = str(int(v.capacity))
        current = (v.raw["metadata"].get("annotations") or {}).get(naming.POD_DELETION_COST)
        if v.report is not None and current != cost:
            annotations[naming.POD_DELETION_COST] = cost
        if annotations:
            try:
                self.k.core.patch_namespaced_pod(
                    v.name, namespace, {"metadata": {"annotations": annotations}},
                    field_manager=naming.FIELD_MANAGER, _content_type=MERGE,
                )
            except ApiException as exc:
                if exc.status != 404:
                    raise

    def _maybe_recapture(self, v: PodView, desired_hash: str, graphs: wc.GraphConfig, port: int) -> None:
        report = v.report
        if v.terminating or report is None or report.phase not in (Phase.READY, Phase.DEGRADED):
            return
        if report.graph_config_hash == desired_hash:
            return
        annotations = v.raw["metadata"].get("annotations") or {}
        request = RecaptureRequest(graph_config_hash=desired_hash, graphs=graphs)
        asked = annotations.get(RECAPTURE_ANNOTATION)
        if asked:
            try:
                if RecaptureRequest.model_validate_json(asked).graph_config_hash == desired_hash:
                    return
            except pydantic.ValidationError:
                pass
        payload = request.model_dump_json(by_alias=True)
        self.k.core.patch_namespaced_pod(
            v.name, v.raw["metadata"]["namespace"], {"metadata": {"annotations": {RECAPTURE_ANNOTATION: payload}}},
            field_manager=naming.FIELD_MANAGER, _content_type=MERGE,
        )
        events.post(self.k.core, _pod_ref(v), "Normal", "RecaptureRequested", f"graph config {desired_hash}")
        if v.pod_ip:
            self.recapture_http(v.pod_ip, port, payload)

    def _apply(self, obj: dict[str, Any], force_create: bool = False) -> None:
        meta = obj["metadata"]
        key = (obj["kind"], meta["namespace"], meta["name"])
        content = children.content_key(obj)
        if not force_create and self._applied.get(key) == content:
            return
        kw = {"field_manager": naming.FIELD_MANAGER, "force": True, "_content_type": APPLY}
        kind, ns, name = key
        if kind == "Deployment":
            self.k.apps.patch_namespaced_deployment(name, ns, obj, **kw)
        elif kind == "Service":
            self.k.core.patch_namespaced_service(name, ns, obj, **kw)
        elif kind == "PodDisruptionBudget":
            self.k.policy.patch_namespaced_pod_disruption_budget(name, ns, obj, **kw)
        elif kind == "HTTPRoute":
            self.k.custom.patch_namespaced_custom_object(routing.GROUP, routing.VERSION, ns, routing.PLURAL, name, obj, **kw)
        elif kind == "ServiceAccount":
            self.k.core.patch_namespaced_service_account(name, ns, obj, **kw)
        elif kind == "Role":
            self.k.rbac.patch_namespaced_role(name, ns, obj, **kw)
        elif kind == "RoleBinding":
            self.k.rbac.patch_namespaced_role_binding(name, ns, obj, **kw)
        else:
            raise ValueError(f"cannot apply kind {kind}")
        self._applied[key] = content

    def _apply_child(self, obj: dict[str, Any], rejected: list[tuple[str, str]], force_create: bool = False) -> None:
        """:meth:`_apply`, with a refusal collected in ``rejected`` as ``(reason, message)``.

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
        if route is not None and _owned_by(route, gs.metadata.uid):
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

    def _write_status(self, gs: api.GraphServing, body: dict, new: api.GraphServingStatus) -> None:
        value = new.to_api()
        if body.get("status") == value:
            return
        meta = gs.metadata
        self.k.custom.patch_namespaced_custom_object_status(
            api.GROUP, api.VERSION, meta.namespace, api.PLURAL, meta.name,
            [{"op": "add", "path": "/status", "value": value}],
            field_manager=naming.FIELD_MANAGER, _content_type=JSON_PATCH,
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
            _content_type=MERGE,
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


def _owned_by(obj: dict, uid: str | None) -> bool:
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return any(r.get("uid") == uid for r in refs)


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
