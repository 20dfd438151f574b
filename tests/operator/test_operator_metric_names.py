"""The operator's /metrics follows the Prometheus naming conventions (promtool, or the port of its
rules in tests/metric_lint.py), has no ``_created`` series, and shows its known series at zero."""

from __future__ import annotations

import asyncio

import httpx
from metric_lint import lint, parse, silent_families

from graphserving.operator.metrics import OperatorMetrics, serve
from graphserving.operator.report_validation import REJECTIONS
from graphserving.operator.workqueue import WorkQueue

#: Families whose label values only events reveal: exception types, and per-GraphServing series.
EVENT_LABELLED = [
    "graphserving_operator_degraded_replicas", "graphserving_operator_effective_capacity_tokens_per_second",
    "graphserving_operator_ready_replicas", "graphserving_operator_reconcile_errors_total",
    "graphserving_operator_rollout_phase", "graphserving_operator_traffic_weight_ratio",
]


def scrape(metrics: OperatorMetrics) -> str:
    server = serve(metrics, 0, lambda: {"ok": True}, host="127.0.0.1")
    try:
        return httpx.get(f"http://127.0.0.1:{server.server_address[1]}/metrics").text
    finally:
        server.shutdown()


async def _run_queue(metrics: OperatorMetrics) -> None:
    calls: list[tuple] = []

    def reconcile(*key):
        calls.append(key)
        if len(calls) == 1:
            raise RuntimeError("API unavailable")  # retried with back-off (0.5 s)

    queue = WorkQueue(reconcile, workers=2, metrics=metrics.workqueue)
    queue.start()
    queue.add(("ns", "smol"))
    while not (len(calls) == 2 and queue.idle):
        await asyncio.sleep(0.01)
    await queue.stop()


def test_the_operator_exposition_passes_the_linter():
    metrics = OperatorMetrics()
    metrics.reconcile_total.labels("ok").inc()
    metrics.reconcile_errors.labels("ApiException").inc()
    metrics.reconcile_seconds.observe(0.02)
    metrics.observe_graphserving("ns", "smol", "Progressing", {"r1": (1500.0, 60, 2, 0), "r2": (1000.0, 40, 1, 1)})
    asyncio.run(_run_queue(metrics))
    text = scrape(metrics)
    assert lint(text) == []
    assert "_created" not in text


def test_traffic_weight_is_a_ratio():
    metrics = OperatorMetrics()
    metrics.observe_graphserving("ns", "smol", "Progressing", {"r1": (1500.0, 60, 2, 0), "r2": (1000.0, 40, 1, 1)})
    samples = parse(scrape(metrics))["graphserving_operator_traffic_weight_ratio"].samples
    assert {s[1]["revision"]: s[2] for s in samples} == {"r1": 0.6, "r2": 0.4}


def test_a_fresh_operator_registry_shows_every_known_series_at_zero():
    text = scrape(OperatorMetrics())
    assert silent_families(text) == EVENT_LABELLED
    families = parse(text)
    results = {s[1]["result"]: s[2] for s in families["graphserving_operator_reconcile_total"].samples}
    assert results == {"ok": 0.0, "error": 0.0}
    rejections = {s[1]["reason"]: s[2] for s in families["graphserving_operator_report_rejections_total"].samples}
    assert rejections == {reason.value: 0.0 for reason in REJECTIONS}
    gates = {s[1]["status"]: s[2] for s in families["graphserving_operator_readiness_gate_updates_total"].samples}
    assert gates == {"True": 0.0, "False": 0.0}
    for name in ("workqueue_depth", "workqueue_adds_total", "workqueue_retries_total",
                 "workqueue_unfinished_work_seconds", "workqueue_longest_running_processor_seconds"):
        assert families[name].samples == [(name, {"name": "graphserving"}, 0.0)], name
