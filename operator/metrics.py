"""The operator's Prometheus metrics and its ``/healthz`` + ``/metrics`` HTTP endpoint.

kopf exports no metrics of its own; everything here is ours, in a registry of its own so tests can
read exact values. Label cardinality is bounded by the number of GraphServings and revisions.
"""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from .rollout import RolloutPhase


class OperatorMetrics:
    """All operator metrics, registered in ``self.registry``."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        self.reconcile_total = Counter(
            "graphserving_operator_reconcile", "GraphServing reconciles, by result.", ["result"], registry=r
        )
        self.reconcile_errors = Counter(
            "graphserving_operator_reconcile_errors", "Reconciles that raised, by exception type.", ["error"], registry=r
        )
        self.reconcile_seconds = Histogram(
            "graphserving_operator_reconcile_duration_seconds",
            "Wall time of one GraphServing reconcile.",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=r,
        )
        self.report_rejections = Counter(
            "graphserving_operator_report_rejections", "Worker reports rejected, by reason.", ["reason"], registry=r
        )
        self.gate_updates = Counter(
            "graphserving_operator_readiness_gate_updates", "graphs-ready condition writes, by status.", ["status"], registry=r
        )
        self.rollout_phase = Gauge(
            "graphserving_operator_rollout_phase",
            "1 for the current rollout phase of each GraphServing, else 0.",
            ["namespace", "name", "phase"],
            registry=r,
        )
        self.capacity = Gauge(
            "graphserving_operator_effective_capacity_tokens_per_second",
            "Measured effective capacity served per revision.",
            ["namespace", "name", "revision"],
            registry=r,
        )
        self.traffic_weight = Gauge(
            "graphserving_operator_traffic_weight_percent",
            "Traffic weight per revision.",
            ["namespace", "name", "revision"],
            registry=r,
        )
        self.ready_replicas = Gauge(
            "graphserving_operator_ready_replicas", "graphs-ready workers per revision.", ["namespace", "name", "revision"], registry=r
        )
        self.degraded_replicas = Gauge(
            "graphserving_operator_degraded_replicas", "Degraded ready workers per revision.", ["namespace", "name", "revision"], registry=r
        )
        self.leader = Gauge("graphserving_operator_leader", "1 while this replica holds the leader Lease.", registry=r)
        self._series: dict[tuple[str, str], set[str]] = {}

    def observe_graphserving(
        self,
        namespace: str,
        name: str,
        phase: str,
        revisions: dict[str, tuple[float, int, int, int]],
    ) -> None:
        """Set the per-GraphServing gauges; ``revisions``: hash -> (capacity, weight, ready, degraded).

        ``phase`` is the rollout phase (:class:`~.rollout.RolloutPhase`; "" sets none). Series of
        revisions that disappeared are removed.
        """
        for p in RolloutPhase:
            self.rollout_phase.labels(namespace, name, p).set(1 if p == phase else 0)
        for rev, (capacity, weight, ready, degraded) in revisions.items():
            self.capacity.labels(namespace, name, rev).set(capacity)
            self.traffic_weight.labels(namespace, name, rev).set(weight)
            self.ready_replicas.labels(namespace, name, rev).set(ready)
            self.degraded_replicas.labels(namespace, name, rev).set(degraded)
        gone = self._series.get((namespace, name), set()) - set(revisions)
        for rev in gone:
            for gauge in (self.capacity, self.traffic_weight, self.ready_replicas, self.degraded_replicas):
                try:
                    gauge.remove(namespace, name, rev)
                except KeyError:
                    pass
        self._series[(namespace, name)] = set(revisions)

    def forget_graphserving(self, namespace: str, name: str) -> None:
        self.observe_graphserving(namespace, name, "", {})
        for p in RolloutPhase:
            try:
                self.rollout_phase.remove(namespace, name, p)
            except KeyError:
                pass
        self._series.pop((namespace, name), None)


def serve(metrics: OperatorMetrics, port: int, health: Callable[[], dict], host: str = "0.0.0.0") -> http.server.ThreadingHTTPServer:
    """Serve ``/metrics`` (Prometheus text) and ``/healthz`` (JSON ``health()``; 200 when its
    ``ok`` is true, else 503) on ``host:port`` in a daemon thread; returns the server (``shutdown()``)."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path == "/metrics":
                body, status, ctype = generate_latest(metrics.registry), 200, CONTENT_TYPE_LATEST
            elif self.path in ("/healthz", "/livez", "/readyz"):
                state = health()
                body = json.dumps(state).encode()
                status, ctype = (200 if state.get("ok") else 503), "application/json"
            else:
                body, status, ctype = b"not found\n", 404, "text/plain"
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, name="operator-http", daemon=True).start()
    return server
