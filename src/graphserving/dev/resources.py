"""Server-side apply and condition waits over the local control plane's REST API.

The dev cluster installs a handful of cluster-level objects itself (the Gateway API CRDs, RBAC
for the gateway and Prometheus, a GatewayClass and Gateway) before any Python Kubernetes client is
configured, so these helpers speak HTTP through :meth:`LocalCluster.request
<graphserving.dev.cluster.LocalCluster.request>` (admin credentials) and nothing else.
"""

from __future__ import annotations

import json
import time
import urllib.parse
from typing import Any, Protocol

#: The field manager of everything the dev cluster applies.
FIELD_MANAGER = "graphserving-dev"
APPLY_CONTENT_TYPE = "application/apply-patch+yaml"


class ApplyError(RuntimeError):
    """The API server refused an object, or a condition was not reached in time."""


class Requester(Protocol):
    def request(self, method: str, path: str, body: dict | None = None,
                content_type: str = "application/json", timeout: float = 10.0) -> tuple[int, str]: ...


def plural(kind: str) -> str:
    """The resource name of ``kind`` by the API conventions: ``GatewayClass`` -> ``gatewayclasses``,
    ``ValidatingAdmissionPolicy`` -> ``validatingadmissionpolicies``, ``Gateway`` -> ``gateways``."""
    lower = kind.lower()
    if lower.endswith("y") and lower[-2:-1] not in "aeiou":
        return lower[:-1] + "ies"
    if lower.endswith(("s", "x", "ch", "sh")):
        return lower + "es"
    return lower + "s"


def resource_path(obj: dict[str, Any]) -> str:
    """The REST path of ``obj`` (by ``apiVersion``, ``kind``, ``metadata.namespace`` and ``name``).

    Namespaced exactly when ``metadata.namespace`` is set. Raises :class:`ApplyError` when
    ``apiVersion``, ``kind`` or ``metadata.name`` is missing.
    """
    meta = obj.get("metadata") or {}
    missing = [f for f, v in (("apiVersion", obj.get("apiVersion")), ("kind", obj.get("kind")),
                              ("metadata.name", meta.get("name"))) if not v]
    if missing:
        raise ApplyError(f"object has no {', '.join(missing)}: {json.dumps(obj)[:200]}")
    version = obj["apiVersion"]
    base = f"/api/{version}" if "/" not in version else f"/apis/{version}"
    namespace = meta.get("namespace")
    scope = f"/namespaces/{urllib.parse.quote(namespace)}" if namespace else ""
    return f"{base}{scope}/{plural(obj['kind'])}/{urllib.parse.quote(meta['name'])}"


def describe(obj: dict[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    where = f"{meta['namespace']}/" if meta.get("namespace") else ""
    return f"{obj.get('kind')} {where}{meta.get('name')}"


def apply(api: Requester, obj: dict[str, Any], manager: str = FIELD_MANAGER, dry_run: bool = False) -> dict[str, Any]:
    """Server-side apply ``obj`` (forcing conflicts, as ``kubectl apply --server-side --force-conflicts``).

    Returns the object as stored (with ``dry_run``: as it would be, defaults and validation
    applied, nothing stored). Raises :class:`ApplyError` with the API server's message (which
    names the offending field) when it refuses the object.
    """
    params = {"fieldManager": manager, "force": "true", **({"dryRun": "All"} if dry_run else {})}
    query = urllib.parse.urlencode(params)
    status, text = api.request("PATCH", f"{resource_path(obj)}?{query}", obj, APPLY_CONTENT_TYPE)
    if status >= 300:
        try:
            message = json.loads(text).get("message", text)
        except ValueError:
            message = text
        raise ApplyError(f"the API server refused {describe(obj)} ({status}): {message}")
    return json.loads(text)


def condition(obj: dict[str, Any], condition_type: str) -> dict[str, Any] | None:
    """The condition of type ``condition_type`` in ``obj['status']['conditions']`` (None if absent)."""
    for cond in (obj.get("status") or {}).get("conditions") or []:
        if cond.get("type") == condition_type:
            return cond
    return None


def wait_condition(api: Requester, obj: dict[str, Any], condition_type: str, deadline: float,
                   interval: float = 0.2) -> dict[str, Any]:
    """Poll ``obj`` until its ``condition_type`` condition is ``True`` for its current generation
    (when the condition records ``observedGeneration``); returns the object then.

    ``deadline`` is a :func:`time.monotonic` value. Raises :class:`ApplyError` naming the object
    and its last condition (or that it had none) when the deadline passes.
    """
    path = resource_path(obj)
    last: dict[str, Any] | None = None
    while True:
        status, text = api.request("GET", path)
        if status == 200:
            current = json.loads(text)
            last = condition(current, condition_type)
            generation = (current.get("metadata") or {}).get("generation")
            # a controller's condition counts for the spec it observed (those that record it)
            current_spec = last is not None and last.get("observedGeneration", generation) == generation
            if last and last.get("status") == "True" and current_spec:
                return current
        if time.monotonic() >= deadline:
            seen = (f"{last.get('status')} ({last.get('reason')}: {last.get('message')})" if last
                    else f"absent (GET {status})")
            raise ApplyError(f"{describe(obj)} did not become {condition_type}; the condition is {seen}")
        time.sleep(interval)
