"""The dev cluster's Prometheus finds worker Pods as the chart's PodMonitor does and scrapes them."""

from __future__ import annotations

import pytest
from gw_helpers import server_pod, start_servers

from graphserving.dev.pytest_fixtures import wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

#: The labels the operator puts on worker Pods (operator/naming.py), which the PodMonitor selects.
WORKER_LABELS = {"app.kubernetes.io/name": "graphserving", "app.kubernetes.io/managed-by": "graphserving-operator",
                 "app.kubernetes.io/component": "worker", "graphserving.io/name": "smollm2",
                 "graphserving.io/revision": "5d8f9c7b6a"}


def test_a_worker_pods_metrics_are_scraped_and_queryable_with_the_dashboards_labels(
        core, namespace, prometheus):
    start_servers(core, namespace, [
        server_pod("worker-like", WORKER_LABELS),
        # the same server without the worker labels, and a worker whose port is not the "http" one
        server_pod("not-a-worker", {"app": "other"}),
        server_pod("other-port", WORKER_LABELS, port_name="debug"),
    ])
    def discovered() -> dict[str, set[str]]:
        """Per kind of target (active, dropped), the Pods of this namespace that service discovery saw."""
        targets = prometheus.targets()
        return {kind: {t["discoveredLabels"]["__meta_kubernetes_pod_name"] for t in targets[f"{kind}Targets"]
                       if t["discoveredLabels"].get("__meta_kubernetes_namespace") == namespace}
                for kind in ("active", "dropped")}

    pods = {"worker-like", "not-a-worker", "other-port"}
    seen = wait_for(lambda: (d := discovered())["active"] | d["dropped"] == pods and d, timeout=60,
                    message=lambda: f"the namespace's three Pods discovered: {discovered()}")
    assert seen["active"] == {"worker-like"}
    series = wait_for(lambda: prometheus.query(f'graphserving_devtest_up{{namespace="{namespace}"}}'), timeout=60,
                      message="graphserving_devtest_up from the worker-like Pod through /api/v1/query")
    assert len(series) == 1
    labels = series[0]["metric"]
    assert {k: labels[k] for k in ("job", "graphserving", "revision", "namespace", "pod", "server")} == {
        "job": "graphserving-workers", "graphserving": "smollm2", "revision": "5d8f9c7b6a",
        "namespace": namespace, "pod": "worker-like", "server": "worker-like"}
    assert series[0]["value"][1] == "1"
    targets = prometheus.query(f'up{{namespace="{namespace}"}}')
    assert [(t["metric"]["pod"], t["value"][1]) for t in targets] == [("worker-like", "1")]
