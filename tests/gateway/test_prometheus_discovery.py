"""The dev cluster's Prometheus finds worker Pods as the chart's PodMonitor does and scrapes them,
scrapes processes outside Pods added as targets, and runs the dashboards' queries as Grafana would."""

from __future__ import annotations

import http.server
import json
import threading

import pytest
from gw_helpers import server_pod, start_servers

from graphserving.dev import prometheus as prometheus_mod
from graphserving.dev.pytest_fixtures import wait_for


#: The labels the operator puts on worker Pods (operator/naming.py), which the PodMonitor selects.
WORKER_LABELS = {"app.kubernetes.io/name": "graphserving", "app.kubernetes.io/managed-by": "graphserving-operator",
                 "app.kubernetes.io/component": "worker", "graphserving.io/name": "smollm2",
                 "graphserving.io/revision": "5d8f9c7b6a"}


@pytest.mark.cluster
@pytest.mark.slow
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


class _Exposition(http.server.BaseHTTPRequestHandler):
    """``/metrics`` of a process outside Pods: one series naming its own ``namespace``, as the
    operator's name their GraphServing."""

    body = (b"# HELP graphserving_devtest_local A process outside Pods.\n# TYPE graphserving_devtest_local gauge\n"
            b'graphserving_devtest_local{namespace="from-the-exposition"} 7\n')

    def do_GET(self):  # noqa: N802 (http.server's name)
        self.send_response(200 if self.path == "/metrics" else 404)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


@pytest.fixture
def local_exposition():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Exposition)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.mark.cluster
@pytest.mark.slow
def test_an_added_target_is_scraped_with_its_own_labels_honoured_until_removed(prometheus, local_exposition):
    prometheus.add_target("devtest-local", local_exposition, {"namespace": "from-the-target", "role": "test"})
    try:
        series = wait_for(lambda: prometheus.query('graphserving_devtest_local{target="devtest-local"}'), timeout=60,
                          message="graphserving_devtest_local from the added target")
        labels = series[0]["metric"]
        # honor_labels: the exposition's namespace wins over the target's, as for the operator's series
        assert {k: labels[k] for k in ("job", "instance", "namespace", "role")} == {
            "job": prometheus_mod.LOCAL_JOB, "instance": local_exposition, "namespace": "from-the-exposition",
            "role": "test"}
        assert series[0]["value"][1] == "7"
    finally:
        prometheus.remove_target("devtest-local")

    def scraped() -> set[str]:
        return {t["labels"].get("target") for t in prometheus.targets()["activeTargets"]
                if t["labels"]["job"] == prometheus_mod.LOCAL_JOB}
    wait_for(lambda: "devtest-local" not in scraped(), timeout=60,
             message=lambda: f"the removed target gone from the active targets: {scraped()}")


def test_grafana_variables_are_substituted_in_each_syntax():
    expr = ('rate(m{namespace=~"$namespace", graphserving=~"${graphserving}", x=~"${graphserving:regex}",'
            ' y="[[namespace]]"}[$__rate_interval]) + increase(m[$__range])')
    assert prometheus_mod.grafana_expr(expr, {"namespace": "ns", "graphserving": "(a|b)"}) == (
        'rate(m{namespace=~"ns", graphserving=~"(a|b)", x=~"(a|b)", y="ns"}[1m]) + increase(m[5m])')
    assert prometheus_mod.grafana_expr('label_replace(up, "a", "$1", "b", "(.*)")', {}) == \
        'label_replace(up, "a", "$1", "b", "(.*)")'  # a label_replace reference, not a variable
    with pytest.raises(ValueError, match=r"\$namespace, which has no value"):
        prometheus_mod.grafana_expr('up{namespace="$namespace"}', {})


def test_dashboard_queries_read_every_panel_target_with_its_legend(tmp_path):
    board = {"title": "B", "panels": [
        {"title": "Requests", "targets": [{"refId": "A", "expr": "sum(a)", "legendFormat": "{{pod}} {{ reason }}"},
                                          {"refId": "B", "expr": "sum(b)"}]},
        {"title": "Row", "type": "row", "panels": [{"title": "Inside", "targets": [{"refId": "A", "expr": "c"}]}]},
        {"title": "Text", "type": "text"},
    ]}
    (tmp_path / "b.json").write_text(json.dumps(board))
    queries = prometheus_mod.dashboard_queries(tmp_path / "b.json")
    assert [(q.dashboard, q.panel, q.ref_id, q.expr) for q in queries] == [
        ("B", "Requests", "A", "sum(a)"), ("B", "Requests", "B", "sum(b)"), ("B", "Inside", "A", "c")]
    assert prometheus_mod.panel_query(queries, "Requests", "B").expr == "sum(b)"
    assert queries[0].legend_for({"pod": "p-1", "reason": "stop"}) == "p-1 stop"
    assert queries[1].legend_for({"revision": "abc", "name": "n"}) == "name=n,revision=abc"
    with pytest.raises(KeyError, match="no panel 'Missing'"):
        prometheus_mod.panel_query(queries, "Missing")
