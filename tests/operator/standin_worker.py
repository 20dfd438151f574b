"""TEST FIXTURE: a stand-in worker process for operator cluster tests. Not the product's worker.

It runs where the node agent starts a worker Pod's command, reads the same inputs as
``graphserving-worker`` (``GRAPHSERVING_WORKER_CONFIG``, ``POD_NAME``, ``POD_NAMESPACE``, the
kubeconfig the node agent provides), serves ``/healthz``, ``/readyz``, ``GET /v1/graphs`` and a fixed
``POST /v1/completions``, and publishes a contract-valid :class:`WorkerReport` on its own Pod. It
captures nothing: the operator tests need a process whose report they control. The end-to-end test
switches to the real ``graphserving-worker`` once it publishes reports.

Behaviour (environment):
  STANDIN_BEHAVIOR  ready (default) | degraded | canary-fail
  STANDIN_CAPACITY  effective capacity to report, tokens/s (default 1000)
  STANDIN_GO_FILE   if set, wait until this file exists before reporting
  STANDIN_GO_DIR    if set, wait until the file <dir>/<dtype> exists (dtype from the config)
It also honours the operator's recapture annotation (``graphserving.io/recapture``) by switching
to the requested graph configuration and reporting again.
"""

from __future__ import annotations

import datetime as dt
import http.server
import json
import os
import sys
import threading
import time
import uuid

from kubernetes import client, config

from graphserving.contract.report import (
    RECAPTURE_ANNOTATION,
    REPORT_ANNOTATION,
    CanaryResult,
    GraphMemory,
    KeyReport,
    ModeKeys,
    Phase,
    PhaseRecord,
    RecaptureRequest,
    WorkerIdentity,
    WorkerReport,
    config_hash,
)
from graphserving.contract.graph_policy import resolve_capture_sizes
from graphserving.contract.worker_config import GraphConfig, WorkerConfig

NOW = lambda: dt.datetime.now(dt.timezone.utc)  # noqa: E731


class StandIn:
    def __init__(self) -> None:
        self.config = WorkerConfig.model_validate_json(os.environ["GRAPHSERVING_WORKER_CONFIG"])
        self.graphs = self.config.graphs
        self.pod = os.environ.get("POD_NAME")
        self.namespace = os.environ.get("POD_NAMESPACE")
        self.behavior = os.environ.get("STANDIN_BEHAVIOR", "ready")
        self.capacity = float(os.environ.get("STANDIN_CAPACITY", "1000"))
        self.identity = WorkerIdentity(pod_name=self.pod, namespace=self.namespace, instance=uuid.uuid4().hex, started_at=NOW())
        self.generation = 0
        self.report: WorkerReport | None = None
        self.lock = threading.Lock()
        self.core: client.CoreV1Api | None = None
        if self.pod:
            config.load_config()
            self.core = client.CoreV1Api()

    def build(self, phase: Phase) -> WorkerReport:
        sizes = resolve_capture_sizes(self.graphs.capture_sizes, self.config.engine.max_num_seqs)
        fail = self.behavior == "canary-fail"
        keys = [
            KeyReport(kind="FULL", size=s, captured=True, capture_seconds=0.01, memory_bytes=s << 16,
                      canary=CanaryResult(passed=not fail, max_relative_logit_error=0.5 if fail else 1e-5,
                                          top1_agreement=0.5 if fail else 1.0))
            for s in sizes
        ] if self.behavior != "degraded" else []
        self.generation += 1
        return WorkerReport(
            worker=self.identity,
            model_name=self.config.model_name,
            model_revision=self.config.revision,
            dtype=self.config.dtype,
            device="cpu",
            graph_config_hash=config_hash(self.graphs),
            mode=self.graphs.mode,
            generation=self.generation,
            phase=phase,
            phases=[PhaseRecord(phase=Phase.LOADING, started_at=self.identity.started_at, duration_seconds=0.1)],
            modes=[ModeKeys(kind="FULL", configured=sizes, captured=[] if self.behavior == "degraded" else sizes)],
            coverage=0.0 if self.behavior != "ready" else 1.0,
            keys=keys,
            canary_failures=len(keys) if fail else 0,
            graph_memory=GraphMemory(actual_bytes=sum(k.memory_bytes or 0 for k in keys)),
            effective_capacity_tokens_per_second=self.capacity,
            degraded_reason="no CUDA" if phase is Phase.DEGRADED else None,
            failure_reason="canary failed on every key" if phase is Phase.FAILED else None,
            updated_at=NOW(),
        )

    def final_phase(self) -> Phase:
        return {"ready": Phase.READY, "degraded": Phase.DEGRADED, "canary-fail": Phase.FAILED}[self.behavior]

    def publish(self, phase: Phase) -> None:
        with self.lock:
            self.report = self.build(phase)
            text = self.report.to_annotation()
        if self.core is None:
            return
        for attempt in range(30):
            try:
                self.core.patch_namespaced_pod(self.pod, self.namespace, {"metadata": {"annotations": {REPORT_ANNOTATION: text}}},
                                               _content_type="application/merge-patch+json")
                return
            except Exception as exc:  # retried with back-off, like the real publisher
                print(f"standin: publish failed ({exc}); retrying", file=sys.stderr, flush=True)
                time.sleep(min(5.0, 0.2 * 2 ** attempt))

    def lifecycle(self) -> None:
        go = os.environ.get("STANDIN_GO_FILE")
        if os.environ.get("STANDIN_GO_DIR"):
            go = os.path.join(os.environ["STANDIN_GO_DIR"], self.config.dtype or "default")
        while go and not os.path.exists(go):
            time.sleep(0.2)
        self.publish(self.final_phase())
        while self.core is not None:  # recapture trigger
            time.sleep(0.5)
            try:
                pod = self.core.read_namespaced_pod(self.pod, self.namespace)
            except Exception:
                continue
            raw = (pod.metadata.annotations or {}).get(RECAPTURE_ANNOTATION)
            if not raw:
                continue
            request = RecaptureRequest.model_validate_json(raw)
            if request.graph_config_hash != config_hash(self.graphs):
                self.publish(Phase.RECAPTURING)
                self.graphs = GraphConfig.model_validate(request.graphs.model_dump())
                self.publish(self.final_phase())

    def serving(self) -> bool:
        return self.report is not None and self.report.phase in (Phase.READY, Phase.DEGRADED)


def main() -> int:
    worker = StandIn()

    class Handler(http.server.BaseHTTPRequestHandler):
        def _send(self, status: int, body: object) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802
            if self.path == "/healthz":
                self._send(200, {"ok": True})
            elif self.path == "/readyz":
                self._send(200 if worker.serving() else 503, {"ready": worker.serving()})
            elif self.path == "/v1/graphs":
                self._send(200, json.loads(worker.report.to_json()) if worker.report else {})
            else:
                self._send(404, {"error": "not found"})

        def do_POST(self) -> None:  # noqa: N802
            length = int(self.headers.get("Content-Length") or 0)
            self.rfile.read(length)
            if self.path == "/v1/completions":
                self._send(200, {"object": "text_completion", "model": worker.config.model_name,
                                 "choices": [{"index": 0, "text": f"stand-in {worker.pod}", "finish_reason": "stop"}]})
            else:
                self._send(404, {"error": "not found"})

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer((worker.config.host, worker.config.port), Handler)
    threading.Thread(target=worker.lifecycle, daemon=True).start()
    print(f"standin: serving on {worker.config.host}:{worker.config.port} as {worker.pod}", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
