"""The dev cluster's gateway: Traefik's Kubernetes Gateway provider on a loopback port.

Traefik (``binaries.TRAEFIK_VERSION``, built from its Go module) watches the cluster's Gateway
API objects with the client certificate of ``graphserving-dev:gateway`` (RBAC in
``gateway-rbac.yaml``) and proxies what HTTPRoutes attached to its Gateway ask for: weighted
``backendRefs`` to Services, resolved through their EndpointSlices to the Pods' addresses (the
node agent's pod network, reachable from this machine; no ClusterIP is needed). :meth:`Gateway.start`
applies

* the GatewayClass ``graphserving-dev`` (controller ``traefik.io/gateway-controller``);
* the Gateway ``graphserving`` in namespace ``graphserving-gateway`` with one HTTP listener
  ``http`` on the entry point's port, accepting routes from every namespace: a GraphServing's
  ``spec.routing.parentRefs`` names it as
  ``{name: graphserving, namespace: graphserving-gateway}``;

and returns once Traefik answers its ping and has marked the Gateway ``Programmed``. Traffic goes
to ``http://127.0.0.1:<port>`` (:attr:`Gateway.url`); Traefik's own Prometheus metrics and ping
are on a second loopback port (:attr:`Gateway.admin_url`). Version checks and anonymous usage
reports are off: nothing leaves the machine.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from importlib import resources as package_files
from pathlib import Path
from typing import Any

import yaml

from graphserving.dev import binaries, cluster, resources
from graphserving.dev.ports import free_port

GATEWAY_CLASS = "graphserving-dev"
CONTROLLER_NAME = "traefik.io/gateway-controller"
GATEWAY_NAMESPACE = "graphserving-gateway"
GATEWAY_NAME = "graphserving"
LISTENER_NAME = "http"
#: Traefik's entry point for the listener; the listener's port selects it (Traefik matches ports).
ENTRY_POINT = "web"
DEFAULT_START_TIMEOUT = 90.0


def parent_ref() -> dict[str, str]:
    """The ``parentRefs`` entry an HTTPRoute (or ``spec.routing.parentRefs``) uses to attach here."""
    return {"name": GATEWAY_NAME, "namespace": GATEWAY_NAMESPACE}


def rbac() -> list[dict[str, Any]]:
    """The ClusterRole and ClusterRoleBinding of ``gateway-rbac.yaml``."""
    text = package_files.files("graphserving.dev").joinpath("gateway-rbac.yaml").read_text()
    return [d for d in yaml.safe_load_all(text) if d]


def gateway_objects(port: int) -> list[dict[str, Any]]:
    """The Namespace, GatewayClass and Gateway whose HTTP listener is on ``port``."""
    return [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": GATEWAY_NAMESPACE}},
        {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "GatewayClass",
         "metadata": {"name": GATEWAY_CLASS},
         "spec": {"controllerName": CONTROLLER_NAME,
                  "description": "Traefik run by graphserving's dev cluster on loopback"}},
        {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "Gateway",
         "metadata": {"name": GATEWAY_NAME, "namespace": GATEWAY_NAMESPACE},
         "spec": {"gatewayClassName": GATEWAY_CLASS,
                  "listeners": [{"name": LISTENER_NAME, "protocol": "HTTP", "port": port,
                                 "allowedRoutes": {"namespaces": {"from": "All"}}}]}},
    ]


def static_config(port: int, admin_port: int, log_level: str = "INFO") -> dict[str, Any]:
    """Traefik's static configuration: two loopback entry points, the Kubernetes Gateway provider
    and Traefik's ``experimental.fastProxy`` for plain-HTTP backends.

    Why ``fastProxy``: Traefik's default proxy (Go's ``net/http`` transport) cuts a small share of
    streamed responses right after their first bytes under load (a stream without its last chunk;
    measured in docs/gateway.md, "Streaming requests through Traefik's default proxy"), which
    would count as a request lost by a rollout. ``fastProxy`` writes the whole request before it
    reads the response and streams chunked responses with a flush per chunk. Its own edge: a
    backend that closes its connection after each response (HTTP/1.0) gets some requests answered
    502; the workers keep connections alive (the same section of docs/gateway.md).
    """
    return {
        "global": {"checkNewVersion": False, "sendAnonymousUsage": False},
        "experimental": {"fastProxy": {"debug": False}},
        "entryPoints": {ENTRY_POINT: {"address": f"127.0.0.1:{port}"},
                        "traefik": {"address": f"127.0.0.1:{admin_port}"}},
        "providers": {"kubernetesGateway": {"statusAddress": {"ip": "127.0.0.1"}}},
        "ping": {"entryPoint": "traefik"},
        "metrics": {"prometheus": {"entryPoint": "traefik", "addServicesLabels": True,
                                   "addRoutersLabels": True}},
        "log": {"level": log_level, "noColor": True},
        "accessLog": {"format": "json"},
    }


class Gateway:
    """Traefik serving the Gateway ``graphserving-gateway/graphserving`` of a running :class:`LocalCluster`."""

    def __init__(self, local: cluster.LocalCluster, port: int | None = None) -> None:
        self.cluster = local
        self.dir = local.state_dir / "gateway"
        self.port = port or free_port()
        self.admin_port = free_port()
        self.record: cluster.ProcessRecord | None = None

    @property
    def url(self) -> str:
        """Where HTTPRoutes attached to the Gateway are served."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def admin_url(self) -> str:
        """Traefik's ping (``/ping``) and Prometheus metrics (``/metrics``)."""
        return f"http://127.0.0.1:{self.admin_port}"

    @property
    def log_path(self) -> Path:
        return self.cluster.state_dir / "gateway.log"

    def start(self, timeout: float = DEFAULT_START_TIMEOUT) -> Gateway:
        """Apply RBAC, the GatewayClass and the Gateway, run Traefik, wait for ``Programmed``.

        Raises :class:`~graphserving.dev.cluster.ClusterError` when traefik is not built, an
        object is refused, Traefik exits, or the Gateway is not programmed within ``timeout`` s.
        """
        path = binaries.binary_path("traefik")
        if path is None:
            raise cluster.ClusterError("traefik is not built; run `graphserving dev build traefik`")
        deadline = time.monotonic() + timeout
        objects = gateway_objects(self.port)
        try:
            for obj in [*rbac(), *objects]:
                resources.apply(self.cluster, obj)
        except resources.ApplyError as exc:
            raise cluster.ClusterError(f"gateway: {exc}") from exc
        self.dir.mkdir(parents=True, exist_ok=True)
        config = self.dir / "traefik.yaml"
        config.write_text(json.dumps(static_config(self.port, self.admin_port), indent=2))
        env = {"PATH": "/usr/bin:/bin", "KUBECONFIG": str(self.cluster.state_dir / "gateway.kubeconfig")}
        self.cluster.endpoints["gateway"] = self.url
        proc = self.cluster.spawn_client("gateway", [str(path), f"--configFile={config}"], env=env)
        self.record = next(r for r in self.cluster.records if r.pid == proc.pid)
        try:
            self._wait_ping(proc, deadline)
            resources.wait_condition(self.cluster, objects[-1], "Programmed", deadline)
        except (resources.ApplyError, cluster.ClusterError) as exc:
            self.stop()
            tail = cluster.log_tail(self.log_path)
            raise cluster.ClusterError(f"gateway: {exc}; log {self.log_path}:\n{tail}") from exc
        return self

    def _wait_ping(self, proc, deadline: float) -> None:
        while True:
            if proc.poll() is not None:
                raise cluster.ClusterError(f"traefik exited with code {proc.returncode}")
            try:
                with urllib.request.urlopen(f"{self.admin_url}/ping", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() >= deadline:
                raise cluster.ClusterError(f"traefik did not answer {self.admin_url}/ping")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.record is not None:
            self.cluster.stop_client(self.record, grace=5)
            self.record = None

    def __enter__(self) -> Gateway:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

