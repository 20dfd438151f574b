"""The operator's /metrics and /healthz endpoint."""

import httpx

from graphserving.operator.metrics import OperatorMetrics, serve


def test_metrics_and_health_are_served():
    metrics = OperatorMetrics()
    metrics.reconcile_total.labels("ok").inc(3)
    metrics.observe_graphserving("ns", "smol", "Progressing", {"r1": (1500.0, 100, 2, 1)})
    server = serve(metrics, 0, lambda: {"ok": True, "leader": True}, host="127.0.0.1")
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        text = httpx.get(f"{base}/metrics").text
        health = httpx.get(f"{base}/healthz")
    finally:
        server.shutdown()
    assert 'graphserving_operator_reconcile_total{result="ok"} 3.0' in text
    assert 'graphserving_operator_traffic_weight_ratio{name="smol",namespace="ns",revision="r1"} 1.0' in text
    assert 'graphserving_operator_rollout_phase{name="smol",namespace="ns",phase="Progressing"} 1.0' in text
    assert health.status_code == 200 and health.json() == {"ok": True, "leader": True}


def test_series_of_a_vanished_revision_are_removed():
    metrics = OperatorMetrics()
    metrics.observe_graphserving("ns", "smol", "Progressing", {"old": (1.0, 50, 1, 0), "new": (1.0, 50, 1, 0)})
    metrics.observe_graphserving("ns", "smol", "Complete", {"new": (2.0, 100, 2, 0)})
    value = metrics.registry.get_sample_value
    assert value("graphserving_operator_traffic_weight_ratio", {"namespace": "ns", "name": "smol", "revision": "old"}) is None
    assert value("graphserving_operator_traffic_weight_ratio", {"namespace": "ns", "name": "smol", "revision": "new"}) == 1.0
