"""Real traffic through the dev cluster's gateway (Traefik) during a rolling upgrade of the CPU sample.

The operator runs as a process; the workers are the real ``graphserving-worker`` on the SmolLM2
GGUF; the GraphServing routes through the Gateway ``graphserving-gateway/graphserving``, so the
operator's capacity-weighted HTTPRoute is what Traefik balances by. A client load runs for the whole
rollout (tests/operator/traffic_load.py). Issue 17's goals: no failed request, capacity never below
the floor, and per window of constant weights each revision's measured share within 10 points of
its weight. The measured figures are in docs/rollout-traffic.md.
"""

from __future__ import annotations

import threading
import time

import pytest
from op_cluster import create_gs, get_gs, patch_gs, pods
from test_e2e_real_workers import sample_spec, serving_capacity
from traffic_load import Load, RouteWeights, table, windows

from graphserving.dev import gateway as gateway_mod
from graphserving.dev.pytest_fixtures import wait_for
from graphserving.operator import naming

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

NAME = "smollm2"
MODEL = "smollm2-135m-instruct"
#: The issue's bound (issue 17): a revision's measured share within 10 points of its weight.
TOLERANCE = 0.10
#: Windows with fewer requests say little about a split (a ±10-point bound needs a few dozen).
MIN_WINDOW_REQUESTS = 30


def routed_spec(**changes) -> dict:
    spec = sample_spec(**changes)
    spec["replicas"] = 2
    spec["routing"] = {"parentRefs": [gateway_mod.parent_ref()]}
    return spec


def wait_routed(custom, gateway, namespace: str, operator) -> None:
    """Until the GraphServing is Ready and a request through the gateway is answered by a worker."""
    import httpx

    def answered() -> bool:
        response = httpx.post(f"{gateway.url}/v1/completions", timeout=60,
                              json={"model": MODEL, "prompt": "Hi", "max_tokens": 1})
        return response.status_code == 200 and bool(response.headers.get("x-graphserving-revision"))

    wait_for(lambda: (g := get_gs(custom, namespace, NAME)) and
             next((c for c in g["status"].get("conditions") or [] if c["type"] == "Ready"), {}).get("status") == "True",
             timeout=600, interval=2, message=lambda: f"GraphServing Ready; {operator.log()}")
    wait_for(answered, timeout=120, interval=1, message="an answer through the gateway")


def test_a_rolling_upgrade_under_load_through_the_gateway_loses_no_request(custom, core, namespace, operator, gateway):
    create_gs(custom, namespace, NAME, routed_spec())
    wait_routed(custom, gateway, namespace, operator)
    gs = get_gs(custom, namespace, NAME)
    old = gs["status"]["currentRevision"]
    capacity: list[float] = []
    stop = threading.Event()

    def sample_capacity() -> None:
        while not stop.is_set():
            capacity.append(serving_capacity(get_gs(custom, namespace, NAME)))
            stop.wait(1.0)

    sampler = threading.Thread(target=sample_capacity, daemon=True)
    origin = time.monotonic()
    with RouteWeights(custom, namespace, NAME) as weights, Load(gateway.url, MODEL, clients=4) as load:
        sampler.start()
        time.sleep(10)  # the steady state before the upgrade
        patch_gs(custom, namespace, NAME, {"spec": {"model": {"dtype": "bfloat16"}}})
        try:
            gs = wait_for(
                lambda: (g := get_gs(custom, namespace, NAME))["status"].get("rollout", {}).get("phase") == "Complete"
                and g["status"]["currentRevision"] != old
                and not [p for p in pods(core, namespace, NAME) if p["metadata"]["labels"][naming.LABEL_REVISION] == old]
                and g,
                timeout=900, interval=2, message=lambda: f"rollout Complete, old pods gone; {operator.log()}")
            time.sleep(10)  # the steady state after it
        finally:
            stop.set()
            sampler.join()
    end = time.monotonic()
    found = windows(weights.changes, load.outcomes, end)
    report = (f"{len(load.outcomes)} requests in {end - origin:.0f} s "
              f"({len(load.outcomes) / (end - origin):.1f}/s), {len(load.failures())} failed\n"
              f"{table(found, origin)}")
    print(report)
    assert not load.failures(), f"{report}\nfailed: {load.failures()[:10]}"
    floor = gs["spec"]["rollout"]["minAvailableCapacity"] * gs["status"]["rollout"]["baselineCapacityTokensPerSecond"]
    assert min(capacity) >= floor * 0.999, f"capacity dipped to {min(capacity):.1f} tok/s (floor {floor:.1f})"
    judged = [w for w in found if w.total >= MIN_WINDOW_REQUESTS]
    assert {old, gs["status"]["currentRevision"]} <= {r for w in judged for r in w.served}, report
    assert all(w.deviation() <= TOLERANCE for w in judged), report
