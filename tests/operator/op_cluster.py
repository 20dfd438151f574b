"""Helpers for the operator's cluster tests: install the API, run the operator, read objects."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client
from kubernetes.client.rest import ApiException

from graphserving.contract import graphserving_types as api
from graphserving.dev.pytest_fixtures import condition_status, wait_for
from graphserving.operator import crd, naming

REPO = Path(__file__).resolve().parents[2]
STANDIN = Path(__file__).resolve().parent / "standin_worker.py"
APPLY = "application/apply-patch+yaml"
MANAGER = "graphserving-tests"


def install_api(api_client: client.ApiClient) -> None:
    """The GraphServing CRD (checked-in file) and the worker admission policy; the Gateway API's own
    CRDs (HTTPRoute) are installed by the local cluster itself (docs/gateway.md)."""
    ext = client.ApiextensionsV1Api(api_client)
    for doc in (yaml.safe_load((REPO / crd.CRD_PATH).read_text()),):
        ext.patch_custom_resource_definition(doc["metadata"]["name"], doc, field_manager=MANAGER, force=True,
                                             _content_type=APPLY)
        wait_for(lambda n=doc["metadata"]["name"]: condition_status({"status": _crd_status(ext, n)}, "Established") == "True",
                 timeout=60, message=f"CRD {doc['metadata']['name']} established")
    adm = client.AdmissionregistrationV1Api(api_client)
    for doc in yaml.safe_load_all((REPO / "manifests/policy/worker-own-pod.yaml").read_text()):
        if doc["kind"] == "ValidatingAdmissionPolicy":
            adm.patch_validating_admission_policy(doc["metadata"]["name"], doc, field_manager=MANAGER, force=True,
                                                  _content_type=APPLY)
        else:
            adm.patch_validating_admission_policy_binding(doc["metadata"]["name"], doc, field_manager=MANAGER,
                                                          force=True, _content_type=APPLY)


def _crd_status(ext: client.ApiextensionsV1Api, name: str) -> dict:
    raw = ext.read_custom_resource_definition(name, _preload_content=False)
    return json.loads(raw.data).get("status") or {}


class OperatorProcess:
    """The operator as a subprocess (as it runs in its Pod), watching one namespace."""

    def __init__(self, kubeconfig: Path, namespace: str, log_path: Path) -> None:
        self.kubeconfig = kubeconfig
        self.namespace = namespace
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def start(self) -> OperatorProcess:
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig)}
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "graphserving.operator", "run", "-n", self.namespace,
             "--metrics-port", "0", "--metrics-host", "127.0.0.1", "--no-leader-election"],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        log.close()
        return self

    def kill(self) -> None:
        """SIGKILL: no cleanup, as when a node dies mid-rollout."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)

    def metrics_url(self) -> str | None:
        """``http://host:port`` of /metrics and /healthz, from the operator's start-up log line."""
        import re

        match = re.search(r"serving /healthz and /metrics on ([0-9.]+):(\d+)", self.log_path.read_text(errors="replace"))
        return f"http://{match.group(1)}:{match.group(2)}" if match else None

    def rss_bytes(self) -> int:
        """Resident memory of the operator process (Linux /proc)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]


def standin_spec(go_dir: Path, *, replicas: int = 1, allow_degraded: bool = False, behavior: str = "ready",
                 capacity: float = 1000.0, dtype: str = "float32", **extra: Any) -> dict[str, Any]:
    """A GraphServing spec whose workers are the stand-in worker (test fixture)."""
    spec: dict[str, Any] = {
        "model": {"name": "smollm2", "source": {"path": "/models/smollm2.gguf"}, "revision": "a" * 64, "dtype": dtype},
        "runtime": {"command": [sys.executable, str(STANDIN)], "port": 8000,
                    "engine": {"maxNumSeqs": 8, "maxNumBatchedTokens": 256}},
        "graphs": {"mode": "FULL", "captureSizes": [1, 2, 4, 8], "readiness": {"allowDegraded": allow_degraded}},
        "replicas": replicas,
        "podTemplate": {"env": [
            {"name": "STANDIN_GO_DIR", "value": str(go_dir)},
            {"name": "STANDIN_BEHAVIOR", "value": behavior},
            {"name": "STANDIN_CAPACITY", "value": str(capacity)},
        ]},
    }
    spec.update(extra)
    return spec


def create_gs(custom: client.CustomObjectsApi, namespace: str, name: str, spec: dict) -> dict:
    body = {"apiVersion": api.API_VERSION, "kind": api.KIND, "metadata": {"name": name}, "spec": spec}
    return custom.create_namespaced_custom_object(api.GROUP, api.VERSION, namespace, api.PLURAL, body,
                                                  field_validation="Strict")


def get_gs(custom: client.CustomObjectsApi, namespace: str, name: str) -> dict:
    return custom.get_namespaced_custom_object(api.GROUP, api.VERSION, namespace, api.PLURAL, name)


def patch_gs(custom: client.CustomObjectsApi, namespace: str, name: str, patch: dict) -> dict:
    return custom.patch_namespaced_custom_object(api.GROUP, api.VERSION, namespace, api.PLURAL, name, patch,
                                                 _content_type="application/merge-patch+json")


def pods(core: client.CoreV1Api, namespace: str, name: str) -> list[dict]:
    raw = core.list_namespaced_pod(namespace, label_selector=f"{naming.LABEL_NAME}={name}", _preload_content=False)
    return json.loads(raw.data)["items"]


def rollout_summary(custom: client.CustomObjectsApi, namespace: str, name: str) -> str:
    """The GraphServing's rollout status and each revision's ready pods and measured capacity (what
    a stalled rollout's failure must show: e.g. the capacity floor holding an old pod)."""
    status = get_gs(custom, namespace, name).get("status") or {}
    revisions = [(r.get("hash"), r.get("readyReplicas"), r.get("effectiveCapacityTokensPerSecond"))
                 for r in status.get("revisions") or []]
    return f"status.rollout={status.get('rollout')}; revisions (hash, ready, tokens/s)={revisions}"


def wait_rollout_complete(custom: client.CustomObjectsApi, core: client.CoreV1Api, namespace: str, name: str,
                          old: str, operator, timeout: float, interval: float = 2.0) -> dict:
    """Until the rollout away from revision ``old`` is Complete: ``status.rollout.phase`` Complete,
    ``currentRevision`` another revision and no Pod of ``old`` left; returns the GraphServing.
    Raises ``TimeoutError`` with :func:`rollout_summary` and ``operator``'s log."""
    return wait_for(
        lambda: (g := get_gs(custom, namespace, name))["status"].get("rollout", {}).get("phase") == "Complete"
        and g["status"]["currentRevision"] != old
        and not [p for p in pods(core, namespace, name) if p["metadata"]["labels"][naming.LABEL_REVISION] == old]
        and g,
        timeout=timeout, interval=interval,
        message=lambda: f"rollout Complete, old pods gone; {rollout_summary(custom, namespace, name)}; {operator.log()}")


def ready_pods(core: client.CoreV1Api, namespace: str, name: str) -> list[dict]:
    """The GraphServing's Pods that are Ready and not being deleted."""
    return [p for p in pods(core, namespace, name)
            if not p["metadata"].get("deletionTimestamp") and (pod_condition(p, "Ready") or {}).get("status") == "True"]


def pod_condition(pod: dict, kind: str) -> dict | None:
    return next((c for c in (pod.get("status") or {}).get("conditions") or [] if c["type"] == kind), None)


def gs_condition(gs: dict, kind: str) -> dict | None:
    return next((c for c in (gs.get("status") or {}).get("conditions") or [] if c["type"] == kind), None)


def events_for(core: client.CoreV1Api, namespace: str, name: str) -> list[str]:
    items = core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={name}").items
    return [e.reason for e in items]


def api_error(exc: ApiException) -> str:
    return f"{exc.status} {exc.body}"
