"""The operator's Kubernetes clients: where the credentials come from, the API groups it calls, and
how each kind of child is written (server-side apply, one API call per kind).

Imported by the process (:mod:`.main`), the kopf handlers (:mod:`.handlers`) and the reconciler
(:mod:`.reconcile`); it imports none of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from kubernetes import client

from . import routing

#: Content types of the patches the operator sends.
APPLY = "application/apply-patch+yaml"
MERGE = "application/merge-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"
JSON_PATCH = "application/json-patch+json"


def load_kube_config() -> None:
    """In-cluster credentials in a Pod, else the kubeconfig (``KUBECONFIG`` or ``~/.kube/config``).

    Raises:
        kubernetes.config.ConfigException: neither is available.
    """
    from kubernetes import config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()


REQUEST_TIMEOUT_SECONDS = 30.0
"""Deadline of every API request made through :func:`bounded_api_client` that names none itself
(connect and read; kopf's own requests use the same 30 s, ``handlers.apply_settings``)."""


def bounded_api_client(timeout: float = REQUEST_TIMEOUT_SECONDS) -> client.ApiClient:
    """An ``ApiClient`` whose requests time out after ``timeout`` seconds unless a call passes its own
    ``_request_timeout``.

    The kubernetes client sends requests without a timeout by default: a connection the API server
    (or the network) leaves open without an answer would block that reconcile's worker thread for
    ever, and the work queue never runs a key that is still being processed (``workqueue.py``), so
    the GraphServing would stop reconciling. With the deadline the call raises, the reconcile fails
    and the queue retries it with back-off.
    """
    api_client = client.ApiClient()
    rest_client = api_client.rest_client
    unbounded = rest_client.request

    def request(method, url, *args, _request_timeout=None, **kwargs):
        return unbounded(method, url, *args, _request_timeout=_request_timeout or timeout, **kwargs)

    rest_client.request = request
    return api_client


@dataclasses.dataclass
class Clients:
    """The API groups the operator calls, over one ``ApiClient``."""

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


#: The patch call of one kind: ``(clients, name, namespace, body, **request options)``.
PatchCall = Callable[..., Any]


def _patch_http_route(k: Clients, name: str, namespace: str, body: dict[str, Any], **kw: Any) -> Any:
    return k.custom.patch_namespaced_custom_object(
        routing.GROUP, routing.VERSION, namespace, routing.PLURAL, name, body, **kw
    )


#: How each kind of child is patched (server-side apply when called with :data:`APPLY`).
PATCH_BY_KIND: dict[str, PatchCall] = {
    "Deployment": lambda k, name, ns, body, **kw: k.apps.patch_namespaced_deployment(name, ns, body, **kw),
    "Service": lambda k, name, ns, body, **kw: k.core.patch_namespaced_service(name, ns, body, **kw),
    "PodDisruptionBudget": lambda k, name, ns, body, **kw: k.policy.patch_namespaced_pod_disruption_budget(
        name, ns, body, **kw
    ),
    "HTTPRoute": _patch_http_route,
    "ServiceAccount": lambda k, name, ns, body, **kw: k.core.patch_namespaced_service_account(name, ns, body, **kw),
    "Role": lambda k, name, ns, body, **kw: k.rbac.patch_namespaced_role(name, ns, body, **kw),
    "RoleBinding": lambda k, name, ns, body, **kw: k.rbac.patch_namespaced_role_binding(name, ns, body, **kw),
}
