"""50 GraphServings on kwok fake nodes (no processes) reconcile without errors.

The test plays the workers' part: once a pod runs on a fake node it writes a contract-valid report
on it (as the admin). Printed, not asserted: the operator's reconcile p50/p99 (from its histogram)
and its resident memory.
"""

from __future__ import annotations

import datetime as dt
import json

import httpx
import pytest
from kubernetes import client
from op_cluster import OperatorProcess, create_gs, get_gs, install_api, standin_spec
from op_helpers import make_report
from prometheus_client.parser import text_string_to_metric_families

from graphserving.contract import graphserving_types as api
from graphserving.contract.report import REPORT_ANNOTATION
from graphserving.dev import kwok
from graphserving.dev.pytest_fixtures import wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
COUNT = 50


def _quantile(buckets: list[tuple[float, float]], q: float) -> float:
    """Quantile from cumulative histogram buckets (upper bound, count), interpolated linearly."""
    total = buckets[-1][1]
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if bound == float("inf"):
                return lower_bound
            width = count - lower_count
            return lower_bound + (bound - lower_bound) * ((rank - lower_count) / width if width else 0)
        lower_bound, lower_count = bound, count
    return lower_bound


def test_fifty_graphservings_on_fake_nodes_reconcile_without_errors(cluster, kwok_cluster, kube_api, namespace,
                                                                     tmp_path):
    install_api(kube_api)
    core = client.CoreV1Api(kube_api)
    custom = client.CustomObjectsApi(kube_api)
    nodes = [f"kwok-op-{i}" for i in range(5)]
    for node in nodes:
        try:
            core.create_node(kwok.fake_node(node))
        except client.ApiException as exc:
            if exc.status != 409:
                raise
    operator = OperatorProcess(cluster.kubeconfig, namespace, tmp_path / "operator.log").start()
    try:
        for i in range(COUNT):
            spec = standin_spec(tmp_path, podTemplate={"nodeSelector": {"type": "kwok"},
                                                       "tolerations": [kwok.FAKE_TOLERATION]})
            create_gs(custom, namespace, f"gs-{i:02d}", spec)
        model = api.GraphServingSpec.model_validate(spec)
        graphs = model.graphs.to_worker()
        reported: set[str] = set()

        def report_running_pods() -> int:
            for pod in pods_all(core, namespace):
                name = pod["metadata"]["name"]
                if name in reported or (pod.get("status") or {}).get("phase") != "Running":
                    continue
                report = make_report(pod=name, namespace=namespace, graphs=graphs, sizes=(1, 2, 4, 8),
                                     model_revision=model.model.revision)
                # the worker process starts after its container (a report from before it is stale)
                now = dt.datetime.now(dt.timezone.utc)
                worker = report.worker.model_copy(update={"started_at": now})
                report = report.model_copy(update={"model_name": model.model.name, "worker": worker,
                                                   "updated_at": now})
                core.patch_namespaced_pod(name, namespace, {"metadata": {"annotations": {
                    REPORT_ANNOTATION: report.to_annotation()}}}, _content_type="application/merge-patch+json")
                reported.add(name)
            ready = [get_gs(custom, namespace, f"gs-{i:02d}").get("status", {}).get("readyReplicas") for i in range(COUNT)]
            return sum(1 for r in ready if r == 1)

        wait_for(lambda: report_running_pods() == COUNT, timeout=600, interval=2,
                 message=lambda: f"{COUNT} GraphServings Ready; {operator.log()}")
        url = operator.metrics_url()
        text = httpx.get(f"{url}/metrics", timeout=10).text
        rss = operator.rss_bytes()
    finally:
        operator.stop()
        # Fake nodes are cluster-scoped: left behind, later tests' kwok pods would land on them.
        for node in nodes:
            core.delete_node(node)
    families = {f.name: f for f in text_string_to_metric_families(text)}
    errors = sum(s.value for s in families["graphserving_operator_reconcile_errors"].samples if s.name.endswith("_total"))
    assert errors == 0, operator.log()
    buckets = sorted(
        (float(s.labels["le"]), s.value)
        for s in families["graphserving_operator_reconcile_duration_seconds"].samples if s.name.endswith("_bucket")
    )
    reconciles = [s.value for s in families["graphserving_operator_reconcile_duration_seconds"].samples
                  if s.name.endswith("_count")][0]
    print(f"\n{COUNT} GraphServings: {reconciles:.0f} reconciles, p50 {_quantile(buckets, 0.5) * 1000:.0f} ms, "
          f"p99 {_quantile(buckets, 0.99) * 1000:.0f} ms, operator RSS {rss / 2**20:.0f} MiB")
    assert reconciles >= COUNT


def pods_all(core, namespace):
    raw = core.list_namespaced_pod(namespace, label_selector="app.kubernetes.io/managed-by=graphserving-operator",
                                   _preload_content=False)
    return json.loads(raw.data)["items"]
