"""Tiny HTTP servers as Pods on the local node, and the Services in front of them."""

from __future__ import annotations

import json
import sys

from graphserving.dev.pytest_fixtures import condition_status, wait_for

PORT = 8080

# GET / answers the Pod's name; GET /metrics a Prometheus text exposition naming it too.
SERVER = """\
import http.server, os
name, namespace = os.environ["POD_NAME"], os.environ["POD_NAMESPACE"]
metrics = ("# HELP graphserving_devtest_up A worker-like test server.\\n# TYPE graphserving_devtest_up gauge\\n"
           f'graphserving_devtest_up{{server="{name}"}} 1\\n').encode()
class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the workers (the dev gateway's fastProxy: docs/gateway.md)
    def do_GET(self):
        body = metrics if self.path == "/metrics" else name.encode()
        kind = "text/plain; version=0.0.4" if self.path == "/metrics" else "text/plain"
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
http.server.ThreadingHTTPServer((os.environ["POD_IP"], %(port)d), Handler).serve_forever()
""" % {"port": PORT}


def server_pod(name: str, labels: dict[str, str], port_name: str = "http") -> dict:
    """A Pod whose process answers its own name on :data:`PORT` at its pod address."""
    field = lambda path: {"valueFrom": {"fieldRef": {"fieldPath": path}}}  # noqa: E731
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {"terminationGracePeriodSeconds": 1, "containers": [{
            "name": "server", "image": "python:3.11", "command": [sys.executable, "-c", SERVER],
            "env": [{"name": "POD_NAME", **field("metadata.name")},
                    {"name": "POD_NAMESPACE", **field("metadata.namespace")},
                    {"name": "POD_IP", **field("status.podIP")}],
            "ports": [{"name": port_name, "containerPort": PORT, "protocol": "TCP"}],
            "readinessProbe": {"httpGet": {"path": "/", "port": port_name}, "periodSeconds": 1},
        }]},
    }


def service(name: str, selector: dict[str, str]) -> dict:
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name},
            "spec": {"selector": selector, "ports": [{"name": "http", "port": PORT, "targetPort": "http"}]}}


def start_servers(core, namespace: str, pods: list[dict], timeout: float = 90) -> None:
    """Create ``pods`` and wait until every one is Ready."""
    for pod in pods:
        core.create_namespaced_pod(namespace, pod)

    def all_ready() -> bool:
        return all(condition_status(json.loads(core.read_namespaced_pod(
            p["metadata"]["name"], namespace, _preload_content=False).data), "Ready") == "True" for p in pods)
    wait_for(all_ready, timeout=timeout, message=f"pods {[p['metadata']['name'] for p in pods]} Ready")
