"""Every panel of the shipped dashboards has data in a live Prometheus under a real workload (issue 17).

Three GraphServings of the SmolLM2 CPU sample share one namespace:

* ``smollm2`` as shipped: its real worker finds no CUDA and serves degraded;
* ``emulated``: its worker captures on the emulated graph backend (``GRAPHSERVING_EMULATE_GRAPHS=1``
  through ``spec.podTemplate.env``), so it is Ready without degradation, with graph keys, capture
  times and replays;
* ``over-quota``: a ResourceQuota refuses its Deployment, so the operator's reconciles of it fail
  for real (the reconcile-error panels).

Both serving GraphServings route through the dev gateway (Traefik) by hostname. Prometheus (the
session's, 1 s scrapes) discovers the workers and scrapes the operator
(:meth:`~graphserving.dev.prometheus.Prometheus.add_target`). After completions and chat
completions, streaming and not, through the gateway, every panel target of
``charts/graphserving/dashboards/*.json`` (read now, so new panels are covered) is queried with its
Grafana variables substituted; the test fails listing each one that stays empty, or that
Prometheus refuses, for :data:`EMPTY_FOR` seconds.
"""

from __future__ import annotations

import collections
import math
import time
from pathlib import Path

import httpx
import pytest
from op_cluster import create_gs, get_gs, gs_condition
from test_e2e_real_workers import sample_spec

from graphserving.dev import gateway as gateway_mod
from graphserving.dev import prometheus as prometheus_mod
from graphserving.dev.demo import GatewayLoad, describe, route_accepted, route_weights
from graphserving.dev.pytest_fixtures import wait_for

REPO = Path(__file__).resolve().parents[2]
DASHBOARDS = sorted((REPO / "charts/graphserving/dashboards").glob("*.json"))
MODEL = "smollm2-135m-instruct"
#: GraphServing -> the HTTPRoute hostname its requests carry.
SERVING = {"smollm2": "smollm2.dashboards.test", "emulated": "emulated.dashboards.test"}
#: Seconds a query may stay empty before it is listed (rates need two scrapes in their window).
EMPTY_FOR = 60.0
#: Seconds of workload through the gateway, and the fewest requests per GraphServing.
WORKLOAD_SECONDS, WORKLOAD_MIN_REQUESTS = 12.0, 24
#: (dashboard title, panel title, refId) -> why it cannot have data even with the setup above. None
#: needs to be here: the emulated backend gives graph keys and replays, the quota real reconcile errors.
ALLOWED_EMPTY: dict[tuple[str, str, str], str] = {}


def _specs() -> dict[str, dict]:
    route = lambda name: {"parentRefs": [gateway_mod.parent_ref()], "hostnames": [SERVING[name]]}  # noqa: E731
    return {
        "smollm2": sample_spec(routing=route("smollm2")),
        "emulated": sample_spec(**{"routing": route("emulated"), "graphs.piecewiseCaptureSizes": [16, 64],
                                   "podTemplate.env": [{"name": "GRAPHSERVING_EMULATE_GRAPHS", "value": "1"}]}),
    }


def _ready(custom, namespace: str, name: str) -> dict | None:
    gs = get_gs(custom, namespace, name)
    return gs if (gs_condition(gs, "Ready") or {}).get("status") == "True" else None


def _answers_through_gateway(url: str, host: str) -> bool:
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 1}
    return httpx.post(f"{url}/v1/completions", json=body, headers={"Host": host}, timeout=30).status_code == 200


def _refuse_deployments_beyond(core, namespace: str, count: int) -> None:
    """A ResourceQuota allowing ``count`` Deployments (those there now), used by the quota controller."""
    quota = {"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "deployments"},
             "spec": {"hard": {"count/deployments.apps": str(count)}}}
    core.create_namespaced_resource_quota(namespace, quota)
    wait_for(lambda: (core.read_namespaced_resource_quota("deployments", namespace).status.used or {})
             .get("count/deployments.apps") == str(count), timeout=60, message="the quota's usage counted")


def _workload(url: str) -> list[GatewayLoad]:
    """One client per serving GraphServing, through the gateway, until both answered enough."""
    loads = [GatewayLoad(url, MODEL, clients=1, max_tokens=8, host=host).start() for host in SERVING.values()]
    deadline = time.monotonic() + WORKLOAD_SECONDS
    try:
        wait_for(lambda: time.monotonic() >= deadline and all(sum(load.served.values()) >= WORKLOAD_MIN_REQUESTS
                                                                for load in loads),
                 timeout=WORKLOAD_SECONDS + 120, interval=0.5, message="the workload's requests answered")
    finally:
        for load in loads:
            load.stop()
    return loads


def _problems(prometheus, queries, variables) -> dict[prometheus_mod.PanelQuery, str]:
    """The queries whose result is empty now, or that Prometheus (or the substitution) refuses."""
    found = {}
    for query in queries:
        try:
            series = prometheus.query(prometheus_mod.grafana_expr(query.expr, variables))
        except (ValueError, RuntimeError) as exc:
            found[query] = f"refused: {exc}"
            continue
        if not series:
            found[query] = "empty"
        elif all(math.isnan(float(s["value"][1])) for s in series):
            found[query] = "NaN only (Grafana shows no value)"
    return found


def _start_graphservings(custom, core, namespace: str, operator) -> dict[str, dict]:
    """The two serving GraphServings, Ready (name -> object), then ``over-quota``."""
    for name, spec in _specs().items():
        create_gs(custom, namespace, name, spec)
    ready = wait_for(lambda: all(_ready(custom, namespace, n) for n in SERVING) and
                     {n: _ready(custom, namespace, n) for n in SERVING},
                     timeout=600, interval=2, message=lambda: f"both GraphServings Ready; {operator.log()}")
    _refuse_deployments_beyond(core, namespace, len(SERVING))
    create_gs(custom, namespace, "over-quota", sample_spec())
    return ready


def _without_data(prometheus, queries, variables) -> dict[prometheus_mod.PanelQuery, str]:
    """:func:`_problems`, asked again every 2 s for up to :data:`EMPTY_FOR` s."""
    started = time.monotonic()
    problems = _problems(prometheus, queries, variables)
    while problems and time.monotonic() < started + EMPTY_FOR:
        time.sleep(2)
        problems = _problems(prometheus, list(problems), variables)
    print(f"{len(queries)} panel queries: {len(problems)} without data after {time.monotonic() - started:.1f} s")
    return problems


@pytest.mark.cluster
@pytest.mark.slow
def test_every_dashboard_panel_has_live_data_under_a_real_workload(
        cluster, gateway, prometheus, custom, core, namespace, operator):
    address = wait_for(operator.metrics_url, timeout=60,
                       message=lambda: f"the operator's metrics address; {operator.log()}")
    target = f"operator-{namespace}"
    prometheus.add_target(target, address.removeprefix("http://"))
    try:
        ready = _start_graphservings(custom, core, namespace, operator)
        assert (gs_condition(ready["smollm2"], "Degraded") or {}).get("status") == "True"
        assert (gs_condition(ready["emulated"], "Degraded") or {}).get("status") == "False"
        for host in SERVING.values():
            wait_for(lambda h=host: _answers_through_gateway(gateway.url, h), timeout=60,
                     message=f"a 200 through the gateway for Host {host}")

        loads = _workload(gateway.url)
        assert [load.failures for load in loads] == [[], []]  # every request answered completely
        revisions = {name: gs["status"]["currentRevision"] for name, gs in ready.items()}
        assert [set(load.served) for load in loads] == [{revisions[n]} for n in SERVING]
        assert all(len(load.kinds) == 4 for load in loads), [dict(load.kinds) for load in loads]

        queries = [q for path in DASHBOARDS for q in prometheus_mod.dashboard_queries(path)]
        assert {q.dashboard for q in queries} == {f"GraphServing / {d}" for d in ("Capacity", "Graphs", "Serving")}
        variables = {"namespace": namespace, "graphserving": f"({'|'.join(SERVING)})"}  # a multi-value regex
        problems = _without_data(prometheus, queries, variables)
    finally:
        prometheus.remove_target(target)
    listed = sorted((q.dashboard, q.panel, q.ref_id, why, q.expr) for q, why in problems.items()
                    if (q.dashboard, q.panel, q.ref_id) not in ALLOWED_EMPTY)
    assert not listed, "panels without data:\n" + "\n".join(
        f"  {board} / {panel} ({ref}): {why}\n    {expr}" for board, panel, ref, why, expr in listed)


def test_the_demos_status_line_shows_route_weights_and_the_shares_served():
    route = {"spec": {"rules": [{"backendRefs": [{"name": "smollm2-aaaa", "weight": 75},
                                                 {"name": "smollm2-bbbb", "weight": 25}]}]},
             "status": {"parents": [{"conditions": [{"type": "Accepted", "status": "True"},
                                                    {"type": "ResolvedRefs", "status": "True"}]}]}}
    gs = {"status": {"revisions": [{"hash": "aaaa", "dtype": "float32", "replicas": 2, "readyReplicas": 2},
                                   {"hash": "bbbb", "dtype": "bfloat16", "replicas": 1, "readyReplicas": 1}]}}
    weights = route_weights(route)
    assert weights == {"aaaa": 75, "bbbb": 25} and route_accepted(route)
    lines = describe(gs, weights, collections.Counter({"aaaa": 6, "bbbb": 3, "cccc": 1}), 2).splitlines()
    assert lines[0] == "Ready=? (no condition yet) rollout=Idle"
    assert lines[1] == "    revision aaaa dtype=float32 desired=2 ready=2 degraded=0 capacity=0 tok/s route=75% served=60%"
    assert lines[2].endswith("route=25% served=30%")
    assert lines[3:] == ["    revision cccc (gone) served=10%", "    since the previous line: 10 answered, 2 failed"]
    assert not route_accepted({"status": {"parents": [{"conditions": [{"type": "Accepted", "status": "False"}]}]}})
