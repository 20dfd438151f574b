"""Faults and forged reports against the real control plane (issue 19): a killed worker's report
stops counting at once, a forged capacity counts only up to its bound, a divergence is surfaced.

Workers are the stand-in worker process (tests/operator/standin_worker.py, a test fixture) run by
the local node agent, which restarts a killed container and reports it in the Pod's
``containerStatuses`` as the kubelet does.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from op_cluster import create_gs, ready_pods, events_for, get_gs, gs_condition, pod_condition, pods, standin_spec

from graphserving.contract.report import REPORT_ANNOTATION
from graphserving.dev.pytest_fixtures import wait_for
from graphserving.operator import naming

pytestmark = pytest.mark.cluster
GATE = naming.READINESS_GATE
MERGE = "application/merge-patch+json"




def _raw_pod(core, namespace, name):
    return json.loads(core.read_namespaced_pod(name, namespace, _preload_content=False).data)


def _worker(pod):
    return next(s for s in pod["status"]["containerStatuses"] if s["name"] == "worker")


def _patch_report(core, namespace, pod, **fields):
    """Rewrite ``pod``'s report as the admin would (a worker's token may do the same on its own Pod)."""
    report = json.loads(pod["metadata"]["annotations"][REPORT_ANNOTATION])
    report.update(fields, generation=report["generation"] + 1)
    core.patch_namespaced_pod(pod["metadata"]["name"], namespace,
                              {"metadata": {"annotations": {REPORT_ANNOTATION: json.dumps(report)}}},
                              _content_type=MERGE)


@pytest.mark.slow
def test_a_killed_worker_flips_its_gate_false_as_soon_as_the_restart_is_visible(
        custom, core, namespace, operator, go_dir):
    (go_dir / "float32").touch()
    create_gs(custom, namespace, "phoenix", standin_spec(go_dir))
    (pod,) = wait_for(lambda: ready_pods(core, namespace, "phoenix"), timeout=120,
                      message=lambda: f"a Ready worker; {operator.log()}")
    name = pod["metadata"]["name"]
    assert pod_condition(pod, GATE)["reason"] == "GraphsReady"
    (go_dir / "float32").unlink()  # the restarted stand-in waits, so the dead instance's report stays
    os.kill(int(_worker(pod)["containerID"].removeprefix("graphserving://")), signal.SIGKILL)

    seen: dict[str, float] = {}

    def restart_and_gate():
        p = _raw_pod(core, namespace, name)
        now = time.monotonic()
        if _worker(p)["restartCount"] >= 1:
            seen.setdefault("restart", now)
        if (pod_condition(p, GATE) or {}).get("status") == "False":
            seen.setdefault("gate", now)
        return p if len(seen) == 2 else None

    after = wait_for(restart_and_gate, timeout=60, interval=0.1,
                     message=lambda: f"the restart and a False gate; {operator.log()}")
    assert seen["gate"] - seen["restart"] < 5.0, seen  # was ~23 s: until the next report
    gate = pod_condition(after, GATE)
    assert gate["reason"] == "WorkerRestarted"
    assert gate["message"].startswith("worker container restarted (exit 137, Error) during Ready; "), gate
    wait_for(lambda: "WorkerRestarted" in events_for(core, namespace, name), timeout=30,
             message="a WorkerRestarted Event on the Pod")
    gs = wait_for(lambda: (g := get_gs(custom, namespace, "phoenix"))["status"].get("readyReplicas") == 0 and g,
                  timeout=30, message="status.readyReplicas 0")
    assert "WorkerRestarted: worker container restarted (exit 137, Error) during Ready" in \
        gs_condition(gs, "Ready")["message"]
    assert gs_condition(gs, "GraphsCaptured")["reason"] == "AwaitingReports"  # the dead report is not shown

    (go_dir / "float32").touch()  # the new container reports: its gate opens again
    wait_for(lambda: (pod_condition(_raw_pod(core, namespace, name), GATE) or {}).get("reason") == "GraphsReady",
             timeout=60, message=lambda: f"GraphsReady again; {operator.log()}")
    again = _raw_pod(core, namespace, name)
    assert again["metadata"]["annotations"][naming.ANNOTATION_OBSERVED_RESTARTS] == "1"
    assert events_for(core, namespace, name).count("WorkerRestarted") == 1


@pytest.mark.slow
def test_a_forged_capacity_counts_at_its_bound_and_a_divergence_is_surfaced(
        custom, core, namespace, operator, go_dir):
    (go_dir / "float32").touch()
    create_gs(custom, namespace, "forged", standin_spec(go_dir, replicas=2))
    wait_for(lambda: get_gs(custom, namespace, "forged").get("status", {}).get("readyReplicas") == 2, timeout=180,
             message=lambda: f"2 ready replicas; {operator.log()}")
    honest, liar = sorted(pods(core, namespace, "forged"), key=lambda p: p["metadata"]["name"])
    _patch_report(core, namespace, liar, effectiveCapacityTokensPerSecond=1e9)

    gs = wait_for(lambda: (g := get_gs(custom, namespace, "forged"))["status"].get("capacity") == "5000 tok/s" and g,
                  timeout=60, message=lambda: f"capacity 5000 tok/s; {operator.log()}")
    assert gs["status"]["revisions"][0]["effectiveCapacityTokensPerSecond"] == 5000.0
    reconciled = gs_condition(gs, "Reconciled")
    assert (reconciled["status"], reconciled["reason"]) == ("False", "CapacityClamped")
    assert reconciled["message"].startswith(f"pod {liar['metadata']['name']} reported 1000000000 tok/s; counted 4000 tok/s")
    wait_for(lambda: "CapacityClamped" in events_for(core, namespace, "forged"), timeout=30,
             message="a CapacityClamped Event on the GraphServing")
    assert _raw_pod(core, namespace, liar["metadata"]["name"])["metadata"]["annotations"][naming.POD_DELETION_COST] \
        == "4000"

    honest = _raw_pod(core, namespace, honest["metadata"]["name"])
    keys = json.loads(honest["metadata"]["annotations"][REPORT_ANNOTATION])["keys"]
    keys[-1]["eagerReason"] = "canary_divergence"
    _patch_report(core, namespace, honest, keys=keys, onlineCanaryComparisons=40, onlineCanaryDivergences=1)
    gs = wait_for(lambda: (gs_condition(get_gs(custom, namespace, "forged"), "Degraded") or {}).get("reason")
                  == "GraphsDiverged" and get_gs(custom, namespace, "forged"), timeout=60,
                  message=lambda: f"Degraded GraphsDiverged; {operator.log()}")
    assert f"FULL/{keys[-1]['size']} out of dispatch" in gs_condition(gs, "Degraded")["message"]
    wait_for(lambda: "GraphsDiverged" in events_for(core, namespace, honest["metadata"]["name"]), timeout=30,
             message="a GraphsDiverged Event on the Pod")
