"""An in-memory stand-in for the API calls the reconciler makes (no API server, no network).

Objects live in dicts by (kind, namespace, name); every call is recorded in ``calls`` as
``(api method, name, body)`` so a test can assert what was written, in which order. ``refuse`` makes
one call fail with an ``ApiException`` (e.g. a 422 for a Service the API server rejects).
"""

from __future__ import annotations

import copy
import dataclasses
import datetime as dt
import json
from typing import Any

from kubernetes.client.rest import ApiException

from graphserving.contract import graphserving_types as api
from graphserving.contract.report import REPORT_ANNOTATION, WorkerReport
from graphserving.operator import naming
from graphserving.operator.kube import Clients

T0 = dt.datetime(2025, 1, 1, tzinfo=dt.timezone.utc)


def api_error(status: int, message: str = "refused") -> ApiException:
    exc = ApiException(status=status, reason={400: "Bad Request", 404: "Not Found", 409: "Conflict",
                                              422: "Unprocessable Entity"}.get(status, "Error"))
    exc.body = json.dumps({"kind": "Status", "message": message})
    return exc


@dataclasses.dataclass
class _Raw:
    """A response read with ``_preload_content=False``."""

    data: bytes


@dataclasses.dataclass
class _Named:
    @dataclasses.dataclass
    class _Meta:
        name: str

    metadata: _Meta


@dataclasses.dataclass
class _ConfigMap:
    data: dict[str, str] | None


class FakeKube:
    """The five API groups of :class:`~graphserving.operator.kube.Clients`, over one object store."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.calls: list[tuple[str, str, Any]] = []
        self.refusals: dict[tuple[str, str], ApiException] = {}
        self._events = 0

    # ------------------------------------------------------------------------ test-side helpers

    def clients(self) -> Clients:
        return Clients(self, self, self, self, self)  # type: ignore[arg-type]

    def refuse(self, method: str, name: str, exc: ApiException) -> None:
        self.refusals[(method, name)] = exc

    def put(self, kind: str, obj: dict[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        self.objects[(kind, meta.get("namespace", "ns"), meta["name"])] = obj
        return obj

    def get(self, kind: str, name: str, namespace: str = "ns") -> dict[str, Any] | None:
        return self.objects.get((kind, namespace, name))

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [o for (k, _, _), o in sorted(self.objects.items()) if k == kind]

    def written(self, prefix: str = "") -> list[tuple[str, str]]:
        """(method, name) of every call so far (reads and events left out) starting with ``prefix``."""
        reads = ("get_", "list_", "read_", "create_namespaced_event", "patch_namespaced_event")
        return [(m, n) for m, n, _ in self.calls if m.startswith(prefix) and not m.startswith(reads)]

    def events(self) -> list[tuple[str, str, str]]:
        """(type, reason, involved object name) of every Event created, in order."""
        return [(b["type"], b["reason"], b["involvedObject"]["name"]) for m, _, b in self.calls
                if m == "create_namespaced_event"]

    def add_pod(self, gs_name: str, revision: str, pod: str, report: WorkerReport | None,
                ready: bool = True, ip: str | None = "10.0.0.1") -> dict[str, Any]:
        """A worker Pod of ``revision`` carrying ``report`` (its own Ready condition ``ready``)."""
        dep = self.get("Deployment", naming.revision_name(gs_name, revision)) or {}
        template = ((dep.get("spec") or {}).get("template") or {}).get("metadata") or {}
        annotations = dict(template.get("annotations") or {})
        if report is not None:
            annotations[REPORT_ANNOTATION] = report.model_dump_json(by_alias=True)
        return self.put("Pod", {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": pod, "namespace": "ns", "uid": f"uid-{pod}",
                         "labels": naming.revision_labels(gs_name, revision), "annotations": annotations},
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
        })

    # ------------------------------------------------------------------------------- internals

    def _call(self, method: str, name: str, body: Any = None) -> None:
        self.calls.append((method, name, copy.deepcopy(body)))
        exc = self.refusals.get((method, name))
        if exc is not None:
            raise exc

    def _list(self, kind: str, namespace: str, label_selector: str) -> _Raw:
        want = dict(kv.split("=", 1) for kv in label_selector.split(","))
        items = [o for (k, ns, _), o in sorted(self.objects.items()) if k == kind and ns == namespace
                 and all((o["metadata"].get("labels") or {}).get(key) == v for key, v in want.items())]
        return _Raw(json.dumps({"items": items}).encode())

    def _apply(self, kind: str, name: str, namespace: str, obj: dict[str, Any]) -> dict[str, Any]:
        self._call(f"apply {kind}", name, obj)
        old = self.get(kind, name, namespace)
        stored = copy.deepcopy(obj)
        stored["metadata"]["uid"] = (old or {}).get("metadata", {}).get("uid") or f"uid-{kind}-{name}"
        if old is not None and "status" in old:
            stored["status"] = old["status"]
        return self.put(kind, stored)

    def _missing(self, kind: str, name: str, namespace: str) -> dict[str, Any]:
        obj = self.get(kind, name, namespace)
        if obj is None:
            raise api_error(404, f'{kind} "{name}" not found')
        return obj

    # ------------------------------------------------------------------------- CustomObjectsApi

    def get_namespaced_custom_object(self, group: str, version: str, namespace: str, plural: str, name: str):
        kind = api.KIND if plural == api.PLURAL else "HTTPRoute"
        self._call("get_namespaced_custom_object", name)
        return copy.deepcopy(self._missing(kind, name, namespace))

    def list_namespaced_custom_object(self, group: str, version: str, namespace: str, plural: str,
                                      label_selector: str = ""):
        """EndpointSlices, as the EndpointSlice controller keeps them: one per Service, listing
        the Pods its selector matches, ready when the Pod is Ready and not terminating (the
        reconcile's only list through this API)."""
        assert (group, plural) == ("discovery.k8s.io", "endpointslices"), (group, plural)
        self._call("list_namespaced_endpoint_slice", namespace)
        slices = []
        for service in json.loads(self._list("Service", namespace, label_selector).data)["items"]:
            selector = ",".join(f"{k}={v}" for k, v in (service["spec"].get("selector") or {}).items())
            pods = json.loads(self._list("Pod", namespace, selector).data)["items"] if selector else []
            slices.append({
                "metadata": {"labels": {"kubernetes.io/service-name": service["metadata"]["name"]}},
                "endpoints": [{"targetRef": {"kind": "Pod", "name": p["metadata"]["name"]},
                               "conditions": {"ready": not p["metadata"].get("deletionTimestamp") and any(
                                   c["type"] == "Ready" and c["status"] == "True"
                                   for c in (p.get("status") or {}).get("conditions") or [])}} for p in pods],
            })
        return {"items": slices}

    def patch_namespaced_custom_object_status(self, group, version, namespace, plural, name, body, **kw):
        self._call("patch_namespaced_custom_object_status", name, {"body": body, **kw})
        obj = self._missing(api.KIND, name, namespace)
        if isinstance(body, list):  # JSON patch: one "add /status"
            (op,) = body
            assert (op["op"], op["path"]) == ("add", "/status")
            obj["status"] = op["value"]
        else:  # merge patch
            obj.setdefault("status", {}).update(body["status"])

    def patch_namespaced_custom_object(self, group, version, namespace, plural, name, body, **kw):
        self._apply("HTTPRoute", name, namespace, body)

    def delete_namespaced_custom_object(self, group, version, namespace, plural, name, body=None, **kw):
        self._call("delete HTTPRoute", name, body)
        self._missing("HTTPRoute", name, namespace)
        self.objects.pop(("HTTPRoute", namespace, name))

    # ------------------------------------------------------------------------------ AppsV1Api

    def list_namespaced_deployment(self, namespace: str, label_selector: str, _preload_content: bool = True):
        self._call("list_namespaced_deployment", namespace)
        return self._list("Deployment", namespace, label_selector)

    def patch_namespaced_deployment(self, name, namespace, body, **kw):
        self._apply("Deployment", name, namespace, body)

    def patch_namespaced_deployment_scale(self, name, namespace, body, **kw):
        self._call("scale Deployment", name, {"body": body, **kw})
        self._missing("Deployment", name, namespace)["spec"]["replicas"] = body["spec"]["replicas"]

    def delete_namespaced_deployment(self, name, namespace, **kw):
        self._call("delete Deployment", name)
        self._missing("Deployment", name, namespace)
        self.objects.pop(("Deployment", namespace, name))

    # ------------------------------------------------------------------------------ CoreV1Api

    def list_namespaced_pod(self, namespace: str, label_selector: str, _preload_content: bool = True):
        self._call("list_namespaced_pod", namespace)
        return self._list("Pod", namespace, label_selector)

    def read_namespaced_config_map(self, name, namespace, **kw):
        self._call("read_namespaced_config_map", name)
        return _ConfigMap(self._missing("ConfigMap", name, namespace).get("data"))

    def patch_namespaced_pod_status(self, name, namespace, body, **kw):
        self._call("patch_namespaced_pod_status", name, {"body": body, **kw})
        pod = self._missing("Pod", name, namespace)
        conditions = pod.setdefault("status", {}).setdefault("conditions", [])
        for new in body["status"]["conditions"]:  # strategic merge: conditions by type
            conditions[:] = [c for c in conditions if c["type"] != new["type"]] + [new]

    def patch_namespaced_pod(self, name, namespace, body, **kw):
        self._call("patch_namespaced_pod", name, {"body": body, **kw})
        pod = self._missing("Pod", name, namespace)
        pod["metadata"].setdefault("annotations", {}).update(body["metadata"]["annotations"])

    def patch_namespaced_service(self, name, namespace, body, **kw):
        self._apply("Service", name, namespace, body)

    def patch_namespaced_service_account(self, name, namespace, body, **kw):
        self._apply("ServiceAccount", name, namespace, body)

    def delete_namespaced_service(self, name, namespace, **kw):
        self._call("delete Service", name)
        self._missing("Service", name, namespace)
        self.objects.pop(("Service", namespace, name))

    def create_namespaced_event(self, namespace, body, **kw):
        self._call("create_namespaced_event", body["involvedObject"]["name"], body)
        self._events += 1
        return _Named(_Named._Meta(f"event-{self._events}"))

    def patch_namespaced_event(self, name, namespace, body, **kw):
        self._call("patch_namespaced_event", name, body)

    # ------------------------------------------------------------------- PolicyV1Api, RbacV1Api

    def patch_namespaced_pod_disruption_budget(self, name, namespace, body, **kw):
        self._apply("PodDisruptionBudget", name, namespace, body)

    def patch_namespaced_role(self, name, namespace, body, **kw):
        self._apply("Role", name, namespace, body)

    def patch_namespaced_role_binding(self, name, namespace, body, **kw):
        self._apply("RoleBinding", name, namespace, body)


def graphserving(name: str = "gs", spec: dict[str, Any] | None = None, generation: int = 1) -> dict[str, Any]:
    """A GraphServing object as the API server would return it."""
    from op_helpers import spec_dict

    return {
        "apiVersion": api.API_VERSION, "kind": api.KIND,
        "metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}", "generation": generation},
        "spec": spec if spec is not None else spec_dict(),
    }


class Clock:
    """A settable clock (UTC), advanced by the test."""

    def __init__(self, start: dt.datetime = T0) -> None:
        self.now = start

    def __call__(self) -> dt.datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += dt.timedelta(seconds=seconds)
