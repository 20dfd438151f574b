"""The operator's Prometheus metrics and its ``/healthz`` + ``/metrics`` HTTP endpoint.

kopf exports no metrics of its own; everything here is ours, in a registry of its own so tests can
read exact values. Label cardinality is bounded by the number of GraphServings and revisions.

Names follow the Prometheus naming conventions (``promtool check metrics``, run by
tests/operator/test_operator_metric_names.py): counters are registered without ``_total``
(prometheus_client appends it), durations in seconds, fractions as ``_ratio`` in [0, 1]. No
``_created`` series; series with label values known in advance (results, rejection reasons, gate
statuses, the work queue) exist at zero from registration on. The work-queue metrics carry
controller-runtime's names and label (``workqueue_*``, ``name``), so dashboards and alerts written
for controller-runtime operators read them too (docs/dashboards.md, Operator).
"""

from __future__ import annotations

import http.server
import json
import threading
import time
from collections.abc import Callable, Hashable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from .report_validation import REJECTIONS
from .rollout import RolloutPhase

#: The work queue's ``name`` label (controller-runtime names it after the controller).
WORKQUEUE_NAME = "graphserving"
#: controller-runtime's work-queue duration buckets, seconds: ``ExponentialBuckets(10e-9, 10, 12)``.
WORKQUEUE_BUCKETS = tuple(float(f"1e{e}") for e in range(-8, 4))
#: Values of the ``status`` label of gate updates (the Pod condition's status).
GATE_STATUSES = ("True", "False")


class WorkQueueMetrics:
    """The work queue's metrics, recorded the way client-go's workqueue records them.

    - ``workqueue_depth``: keys waiting to be reconciled (queued, or marked to run again after the
      reconcile in progress).
    - ``workqueue_adds_total``: adds that made a key wait (adding a key that already waits is not
      one; a delayed add counts when its delay ends).
    - ``workqueue_queue_duration_seconds``: from a key's first uncounted add to its reconcile start.
    - ``workqueue_work_duration_seconds``: one reconcile's wall time.
    - ``workqueue_retries_total``: failed reconciles scheduled again with back-off.
    - ``workqueue_unfinished_work_seconds`` / ``workqueue_longest_running_processor_seconds``: the
      summed / longest age of the reconciles in progress, read at scrape time (stuck workers).

    Methods run on the queue's event-loop thread; the scrape reads under a lock. ``clock`` gives
    seconds (monotonic; tests pass their own).
    """

    def __init__(self, registry: CollectorRegistry, name: str = WORKQUEUE_NAME,
                 clock: Callable[[], float] = time.monotonic) -> None:
        r, n = registry, ["name"]
        self.depth = Gauge("workqueue_depth", "Keys waiting in the work queue.", n, registry=r).labels(name)
        self.adds = Counter("workqueue_adds", "Keys added to the work queue.", n, registry=r).labels(name)
        self.queue_duration = Histogram(
            "workqueue_queue_duration_seconds", "Time a key waits in the work queue before its reconcile starts.",
            n, buckets=WORKQUEUE_BUCKETS, registry=r,
        ).labels(name)
        self.work_duration = Histogram(
            "workqueue_work_duration_seconds", "Time one reconcile from the work queue takes.",
            n, buckets=WORKQUEUE_BUCKETS, registry=r,
        ).labels(name)
        self.retries = Counter("workqueue_retries", "Failed reconciles retried with back-off.", n, registry=r).labels(name)
        Gauge("workqueue_unfinished_work_seconds", "Summed age of the reconciles in progress; a value that grows "
              "while workqueue_work_duration_seconds sees nothing means stuck workers.", n, registry=r
              ).labels(name).set_function(self._unfinished_seconds)
        Gauge("workqueue_longest_running_processor_seconds", "Age of the longest-running reconcile in progress.",
              n, registry=r).labels(name).set_function(self._longest_seconds)
        self._clock = clock
        self._lock = threading.Lock()
        self._added_at: dict[Hashable, float] = {}
        self._started_at: dict[Hashable, float] = {}

    def added(self, key: Hashable) -> None:
        """``key`` now waits (it did not before)."""
        with self._lock:
            self._added_at.setdefault(key, self._clock())
        self.adds.inc()
        self.depth.inc()

    def started(self, key: Hashable) -> None:
        """A worker took ``key`` off the queue and starts its reconcile."""
        now = self._clock()
        with self._lock:
            added = self._added_at.pop(key, None)
            self._started_at[key] = now
        self.depth.dec()
        if added is not None:
            self.queue_duration.observe(now - added)

    def finished(self, key: Hashable) -> None:
        """``key``'s reconcile returned, raised or was cancelled."""
        with self._lock:
            started = self._started_at.pop(key, None)
        if started is not None:
            self.work_duration.observe(self._clock() - started)

    def retried(self) -> None:
        self.retries.inc()

    def _ages(self) -> list[float]:
        now = self._clock()
        with self._lock:
            return [now - t for t in self._started_at.values()]

    def _unfinished_seconds(self) -> float:
        return sum(self._ages())

    def _longest_seconds(self) -> float:
        return max(self._ages(), default=0.0)


class OperatorMetrics:
    """All operator metrics, registered in ``self.registry``; ``workqueue`` is the reconcile
    queue's (:class:`WorkQueueMetrics`).

    Building one turns off prometheus_client's ``_created`` series for the whole process (a global
    switch of the library; the operator builds this at start-up, before anything is scraped).
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        disable_created_metrics()
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
            "graphserving_operator_traffic_weight_ratio",
            "Share of the GraphServing's traffic routed to the revision (its HTTPRoute weight / 100), in [0, 1].",
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
        self.workqueue = WorkQueueMetrics(r)
        self._series: dict[tuple[str, str], set[str]] = {}
        for result in ("ok", "error"):
            self.reconcile_total.labels(result)
        for reason in sorted(REJECTIONS):
            self.report_rejections.labels(reason.value)
        for status in GATE_STATUSES:
            self.gate_updates.labels(status)

    def observe_graphserving(
        self,
        namespace: str,
        name: str,
        phase: str,
        revisions: dict[str, tuple[float, int, int, int]],
    ) -> None:
        """Set the per-GraphServing gauges; ``revisions``: hash -> (capacity tokens/s, traffic weight
        in percent as the status and HTTPRoute state it, ready workers, degraded workers).

        ``phase`` is the rollout phase (:class:`~.rollout.RolloutPhase`; "" sets none). Series of
        revisions that disappeared are removed.
        """
        for p in RolloutPhase:
            self.rollout_phase.labels(namespace, name, p).set(1 if p == phase else 0)
        for rev, (capacity, weight, ready, degraded) in revisions.items():
            self.capacity.labels(namespace, name, rev).set(capacity)
            self.traffic_weight.labels(namespace, name, rev).set(weight / 100)
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
