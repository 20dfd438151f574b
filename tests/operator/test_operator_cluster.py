"""The operator against the real control plane (etcd, kube-apiserver, controllers, node agent).

Workers here are the stand-in worker process (tests/operator/standin_worker.py, a test fixture):
it publishes reports whose content each test controls. The end-to-end test with the real
``graphserving-worker`` lives with the demo.
"""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from kubernetes import client, config
from kubernetes.client.rest import ApiException
from op_cluster import (
    OperatorProcess,
    create_gs,
    events_for,
    get_gs,
    gs_condition,
    patch_gs,
    pod_condition,
    pods,
    ready_pods,
    standin_spec,
    wait_rollout_complete,
)

from graphserving.contract import graphserving_types as api
from graphserving.dev.pytest_fixtures import wait_for
from graphserving.operator import children, naming

pytestmark = pytest.mark.cluster
GATE = naming.READINESS_GATE




# ------------------------------------------------------------------------------------ the API

@pytest.mark.parametrize(
    ("graphs", "field", "text"),
    [
        ({"captureSizes": [1, 4, 2]}, "spec.graphs.captureSizes", "must be strictly increasing"),
        ({"captureSizes": [1, 16]}, "spec.graphs.captureSizes", "capture sizes must be <= runtime.engine.maxNumSeqs"),
        ({"captureSize": [1, 2]}, "spec.graphs.captureSize", "unknown field"),
        ({"readiness": {"requiredModes": ["PIECEWISE"]}}, "spec.graphs.readiness.requiredModes",
         "requiredModes names graphs that graphs.mode does not capture"),
        ({"readiness": {"requiredModes": ["FULL", "FULL"]}}, "spec.graphs.readiness.requiredModes[1]",
         "Duplicate value"),
    ],
    ids=["decreasing", "above-engine-maximum", "unknown-field", "required-mode-not-captured",
         "duplicate-required-mode"],
)
def test_the_api_server_rejects_an_invalid_graphserving_naming_the_field(custom, namespace, go_dir, graphs, field, text):
    spec = standin_spec(go_dir)
    spec["graphs"] = {"mode": "FULL", **graphs}
    with pytest.raises(ApiException) as info:
        create_gs(custom, namespace, "bad", spec)
    assert info.value.status in (400, 422)
    message = json.loads(info.value.body)["message"]
    assert field in message and text in message


def test_the_api_server_rejects_a_token_budget_below_max_num_seqs(custom, namespace, go_dir):
    spec = standin_spec(go_dir)
    spec.setdefault("runtime", {})["engine"] = {"maxNumSeqs": 64, "maxNumBatchedTokens": 32}
    with pytest.raises(ApiException) as info:
        create_gs(custom, namespace, "budget", spec)
    message = json.loads(info.value.body)["message"]
    assert info.value.status == 422 and "spec.runtime.engine.maxNumBatchedTokens" in message
    assert "maxNumBatchedTokens must be >= maxNumSeqs" in message


def test_the_api_server_fills_defaults_and_serves_the_scale_subresource(custom, namespace, go_dir):
    create_gs(custom, namespace, "defaults", standin_spec(go_dir))
    gs = get_gs(custom, namespace, "defaults")
    assert gs["spec"]["rollout"] == {"maxSurge": 1, "minAvailableCapacity": 1.0, "progressDeadlineSeconds": 1800,
                                     "paused": False, "autoRollback": True}
    assert gs["spec"]["runtime"]["engine"]["blockSize"] == 16
    custom.patch_namespaced_custom_object_scale(api.GROUP, api.VERSION, namespace, api.PLURAL, "defaults",
                                                {"spec": {"replicas": 3}},
                                                _content_type="application/merge-patch+json")
    assert get_gs(custom, namespace, "defaults")["spec"]["replicas"] == 3


# ------------------------------------------------------------------------- children and gates

@pytest.mark.slow
def test_a_pod_becomes_ready_only_after_a_valid_report(custom, core, apps, namespace, operator, go_dir):
    create_gs(custom, namespace, "smol", standin_spec(go_dir))
    pod = wait_for(lambda: next((p for p in pods(core, namespace, "smol")
                                 if (pod_condition(p, GATE) or {}).get("reason") == "ReportMissing"), None),
                   timeout=120, message=lambda: f"a worker pod with gate reason ReportMissing; {operator.log()}")
    assert pod_condition(pod, GATE)["status"] == "False"
    assert (pod_condition(pod, "Ready") or {}).get("status") != "True"

    (go_dir / "float32").touch()
    ready = wait_for(lambda: ready_pods(core, namespace, "smol"), timeout=120,
                     message=lambda: f"a Ready worker; {operator.log()}")
    assert pod_condition(ready[0], GATE)["reason"] == "GraphsReady"
    gs = wait_for(lambda: (g := get_gs(custom, namespace, "smol"))["status"].get("readyReplicas") == 1 and g,
                  timeout=60, message="status.readyReplicas 1")
    status = gs["status"]
    rev = status["currentRevision"]
    assert status["ready"] == "1/1" and status["coverage"] == "100%"
    assert status["capacity"] == "1000 tok/s"
    assert gs_condition(gs, "Ready")["status"] == "True"
    assert gs_condition(gs, "GraphsCaptured")["status"] == "True"
    assert gs_condition(gs, "CanaryPassed")["status"] == "True"
    assert status["revisions"][0]["trafficWeight"] == 100
    # Children: per-revision Deployment, Services, PDB, all owned by the GraphServing.
    dep = apps.read_namespaced_deployment(f"smol-{rev}", namespace)
    assert dep.metadata.owner_references[0].uid == gs["metadata"]["uid"]
    assert core.read_namespaced_service("smol", namespace).spec.selector == naming.selector_labels("smol")
    core.read_namespaced_service(f"smol-{rev}", namespace)
    client.PolicyV1Api(core.api_client).read_namespaced_pod_disruption_budget("smol", namespace)
    # kopf left nothing of its own on the object.
    assert not gs["metadata"].get("finalizers")
    assert not [k for k in (gs["metadata"].get("annotations") or {}) if "kopf" in k]
    # The stable Service's EndpointSlice points at a process that answers.
    def ready_address():
        slices = client.DiscoveryV1Api(core.api_client).list_namespaced_endpoint_slice(
            namespace, label_selector="kubernetes.io/service-name=smol").items
        return next((a for s in slices for e in (s.endpoints or []) if e.conditions.ready for a in e.addresses), None)
    address = wait_for(ready_address, timeout=60, message="a ready address in the stable Service's EndpointSlice")
    answer = httpx.post(f"http://{address}:8000/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=10)
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"]


@pytest.mark.slow
def test_degraded_workers_are_ready_when_allowed_and_status_says_why(custom, core, namespace, operator, go_dir):
    (go_dir / "float32").touch()
    create_gs(custom, namespace, "cpu", standin_spec(go_dir, behavior="degraded", allow_degraded=True, capacity=250))
    wait_for(lambda: ready_pods(core, namespace, "cpu"), timeout=120, message=lambda: f"a Ready pod; {operator.log()}")
    gs = wait_for(lambda: (g := get_gs(custom, namespace, "cpu"))["status"].get("degradedReplicas") == 1 and g,
                  timeout=60, message="status.degradedReplicas 1")
    degraded = gs_condition(gs, "Degraded")
    assert degraded["status"] == "True" and "no CUDA" in degraded["message"]
    assert (gs_condition(gs, "Reconciled")["status"], gs_condition(gs, "Reconciled")["reason"]) == (
        "False", "GraphModeWithoutGPU")
    assert gs["status"]["capacity"] == "250 tok/s"


@pytest.mark.slow
def test_degraded_workers_stay_out_when_not_allowed(custom, core, namespace, operator, go_dir):
    (go_dir / "float32").touch()
    create_gs(custom, namespace, "strict", standin_spec(go_dir, behavior="degraded", allow_degraded=False))
    pod = wait_for(lambda: next((p for p in pods(core, namespace, "strict")
                                 if (pod_condition(p, GATE) or {}).get("reason") == "DegradedNotAllowed"), None),
                   timeout=120, message=lambda: f"gate reason DegradedNotAllowed; {operator.log()}")
    assert "no CUDA" in pod_condition(pod, GATE)["message"]
    gs = wait_for(lambda: (g := get_gs(custom, namespace, "strict")).get("status") and
                  "DegradedNotAllowed" in (gs_condition(g, "Ready") or {}).get("message", "") and g,
                  timeout=60, message="Ready condition naming DegradedNotAllowed")
    assert gs_condition(gs, "Ready")["status"] == "False"
    assert (pod_condition(pods(core, namespace, "strict")[0], "Ready") or {}).get("status") != "True"


@pytest.mark.slow
def test_a_report_copied_from_another_pod_is_rejected_with_an_event(custom, core, namespace, operator, go_dir):
    (go_dir / "float32").touch()
    create_gs(custom, namespace, "two", standin_spec(go_dir, replicas=2))
    wait_for(lambda: len(ready_pods(core, namespace, "two")) == 2, timeout=120,
             message=lambda: f"two Ready pods; {operator.log()}")
    a, b = pods(core, namespace, "two")[:2]
    stolen = a["metadata"]["annotations"]["graphserving.io/report"]
    # The admin (not a worker) copies it: the operator must still not trust it.
    forged = json.loads(stolen)
    forged["generation"] += 100
    core.patch_namespaced_pod(b["metadata"]["name"], namespace,
                              {"metadata": {"annotations": {"graphserving.io/report": json.dumps(forged)}}},
                              _content_type="application/merge-patch+json")
    wait_for(lambda: (pod_condition(_raw_pod(core, namespace, b["metadata"]["name"]), GATE) or {}).get("reason")
             == "ReportForeignPod", timeout=60, message="gate reason ReportForeignPod")
    wait_for(lambda: "ReportForeignPod" in events_for(core, namespace, b["metadata"]["name"]), timeout=30,
             message="a ReportForeignPod Event")


def _raw_pod(core, namespace, name):
    return json.loads(core.read_namespaced_pod(name, namespace, _preload_content=False).data)


# ------------------------------------------------------------------------------- admission

@pytest.mark.slow
def test_a_worker_token_cannot_patch_another_pod(cluster, core, namespace, installed):
    for obj in children.worker_rbac(namespace):
        kind = obj["kind"]
        if kind == "ServiceAccount":
            core.create_namespaced_service_account(namespace, obj)
        elif kind == "Role":
            client.RbacAuthorizationV1Api(installed).create_namespaced_role(namespace, obj)
        else:
            client.RbacAuthorizationV1Api(installed).create_namespaced_role_binding(namespace, obj)
    made = {}
    for name in ("worker-a", "worker-b"):
        made[name] = core.create_namespaced_pod(namespace, {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"serviceAccountName": naming.WORKER_SERVICE_ACCOUNT, "nodeSelector": {"no-such-node": "x"},
                     "containers": [{"name": "c", "image": "none", "command": ["true"]}]}})
    token = core.create_namespaced_service_account_token(naming.WORKER_SERVICE_ACCOUNT, namespace, {
        "spec": {"expirationSeconds": 600, "boundObjectRef": {
            "apiVersion": "v1", "kind": "Pod", "name": "worker-a", "uid": made["worker-a"].metadata.uid}}}).status.token
    cfg = client.Configuration()
    config.load_kube_config(config_file=str(cluster.kubeconfig), client_configuration=cfg)
    cfg.cert_file = cfg.key_file = None
    cfg.api_key = {"authorization": f"Bearer {token}"}
    worker = client.CoreV1Api(client.ApiClient(cfg))

    def patch(pod, annotations=None, labels=None):
        meta = {}
        if annotations:
            meta["annotations"] = annotations
        if labels:
            meta["labels"] = labels
        return worker.patch_namespaced_pod(pod, namespace, {"metadata": meta},
                                           _content_type="application/merge-patch+json")

    def denied_for_b():
        try:
            patch("worker-b", {"graphserving.io/report": "{}"})
        except ApiException as exc:
            return exc if exc.status == 403 else None
        return None

    # The policy takes effect once the API server has loaded it.
    exc = wait_for(denied_for_b, timeout=60, message="the admission policy denying worker-a's token on worker-b")
    assert "may only patch its own Pod" in exc.body and "worker-a" in exc.body
    patch("worker-a", {"graphserving.io/report": "{}"})  # its own report: allowed
    with pytest.raises(ApiException) as other:
        patch("worker-a", {"graphserving.io/accepted-report": "x/1"})
    assert other.value.status == 403 and "only the graphserving.io/report annotation" in other.value.body
    with pytest.raises(ApiException) as relabel:
        patch("worker-a", labels={"graphserving.io/revision": "forged"})
    assert relabel.value.status == 403


# ------------------------------------------------------------------------------ rollouts

@pytest.mark.slow
def test_a_dtype_change_rolls_out_without_losing_capacity_even_across_an_operator_restart(
        cluster, custom, core, apps, namespace, operator, go_dir, tmp_path):
    (go_dir / "float32").touch()
    create_gs(custom, namespace, "roll", standin_spec(go_dir, replicas=2))
    wait_for(lambda: get_gs(custom, namespace, "roll").get("status", {}).get("readyReplicas") == 2, timeout=180,
             message=lambda: f"2 ready replicas; {operator.log()}")
    old_rev = get_gs(custom, namespace, "roll")["status"]["currentRevision"]
    floor = 2000.0
    samples: list[float] = []
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            ready = ready_pods(core, namespace, "roll")
            samples.append(1000.0 * len(ready))
            stop.wait(0.3)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        patch_gs(custom, namespace, "roll", {"spec": {"model": {"dtype": "bfloat16"}}})
        gs = wait_for(lambda: (g := get_gs(custom, namespace, "roll"))["status"]["rollout"].get("phase") == "Progressing"
                      and g["status"]["currentRevision"] != old_rev and g, timeout=60, message="rollout Progressing")
        new_rev = gs["status"]["currentRevision"]
        wait_for(lambda: apps.read_namespaced_deployment(f"roll-{new_rev}", namespace), timeout=60,
                 message="the new revision's Deployment")
        operator.kill()  # mid-rollout: the new pods have not reported yet
        restarted = OperatorProcess(cluster.kubeconfig, namespace, tmp_path / "operator-2.log").start()
        try:
            (go_dir / "bfloat16").touch()
            wait_rollout_complete(custom, core, namespace, "roll", old_rev, restarted, timeout=300, interval=0.25)
        finally:
            restarted.stop()
    finally:
        stop.set()
        sampler.join()
    gs = get_gs(custom, namespace, "roll")
    assert min(samples) >= floor, f"capacity dipped to {min(samples)} (floor {floor})"
    assert [r["hash"] for r in gs["status"]["revisions"]] == [new_rev]
    wait_for(lambda: not [d for d in apps.list_namespaced_deployment(namespace).items
                          if d.metadata.name == f"roll-{old_rev}"], timeout=60, message="old Deployment deleted")
    reasons = events_for(core, namespace, "roll")
    assert "RolloutStarted" in reasons and "RolloutComplete" in reasons


@pytest.mark.slow
def test_canary_failures_on_the_new_revision_roll_back(custom, core, apps, namespace, operator, go_dir):
    (go_dir / "float32").touch()
    spec = standin_spec(go_dir, replicas=2)
    create_gs(custom, namespace, "canary", spec)
    wait_for(lambda: get_gs(custom, namespace, "canary").get("status", {}).get("readyReplicas") == 2, timeout=180,
             message=lambda: f"2 ready replicas; {operator.log()}")
    old_rev = get_gs(custom, namespace, "canary")["status"]["currentRevision"]
    env = [e for e in spec["podTemplate"]["env"] if e["name"] != "STANDIN_BEHAVIOR"]
    env.append({"name": "STANDIN_BEHAVIOR", "value": "canary-fail"})
    patch_gs(custom, namespace, "canary", {"spec": {"podTemplate": {"env": env}}})
    gs = wait_for(lambda: (g := get_gs(custom, namespace, "canary"))["status"]["rollout"].get("phase") == "RolledBack" and g,
                  timeout=180, message=lambda: f"rollout RolledBack; {operator.log()}")
    failed = gs["status"]["rollout"]["failedRevision"]
    assert failed != old_rev and gs["status"]["rollout"]["previousRevision"] == old_rev
    wait_for(lambda: not [d for d in apps.list_namespaced_deployment(namespace).items
                          if d.metadata.name == f"canary-{failed}" and d.spec.replicas > 0],
             timeout=60, message="the failed revision scaled to zero (or deleted)")
    assert len(ready_pods(core, namespace, "canary")) == 2
    assert gs_condition(gs, "Progressing")["reason"] == "RolledBack"
    assert "RolledBack" in events_for(core, namespace, "canary")
    first_hash = gs["status"]["rollout"]["failedGraphConfigHash"]

    # a graph-only change (the revision hash stays) retries the failed revision; the stand-in fails again
    patch_gs(custom, namespace, "canary", {"spec": {"graphs": {"captureSizes": [1, 8]}}})
    gs = wait_for(lambda: (g := get_gs(custom, namespace, "canary"))["status"]["rollout"].get("phase") == "RolledBack"
                  and g["status"]["rollout"].get("failedGraphConfigHash") not in (None, first_hash) and g,
                  timeout=180, message=lambda: f"retried and RolledBack again; {operator.log()}")
    assert gs["status"]["rollout"]["failedRevision"] == failed
    assert "RolloutRetried" in events_for(core, namespace, "canary")
    assert len(ready_pods(core, namespace, "canary")) == 2


@pytest.mark.slow
def test_capture_size_changes_recapture_in_place(custom, core, apps, namespace, operator, go_dir):
    (go_dir / "float32").touch()
    create_gs(custom, namespace, "recap", standin_spec(go_dir))
    wait_for(lambda: ready_pods(core, namespace, "recap"), timeout=120, message=lambda: f"Ready; {operator.log()}")
    before = get_gs(custom, namespace, "recap")["status"]
    pod_before = ready_pods(core, namespace, "recap")[0]
    patch_gs(custom, namespace, "recap", {"spec": {"graphs": {"captureSizes": [1, 8]}}})

    def recaptured():
        g = get_gs(custom, namespace, "recap")
        ready = ready_pods(core, namespace, "recap")
        rev = (g["status"].get("revisions") or [{}])[0]
        return g if ready and rev.get("readyReplicas") == 1 and g["status"]["observedGeneration"] == g["metadata"]["generation"] \
            and "RecaptureRequested" in events_for(core, namespace, pod_before["metadata"]["name"]) else None

    gs = wait_for(recaptured, timeout=120, message=lambda: f"recaptured and Ready; {operator.log()}")
    assert gs["status"]["currentRevision"] == before["currentRevision"]
    assert ready_pods(core, namespace, "recap")[0]["metadata"]["uid"] == pod_before["metadata"]["uid"]
    report = ready_pods(core, namespace, "recap")[0]["metadata"]["annotations"]["graphserving.io/report"]
    assert '"configured":[1,8]' in report


@pytest.mark.slow
def test_routing_writes_capacity_weights_to_an_httproute(custom, core, namespace, operator, go_dir):
    (go_dir / "float32").touch()
    create_gs(custom, namespace, "routed", standin_spec(go_dir, routing={"parentRefs": [{"name": "gw"}]}))
    wait_for(lambda: ready_pods(core, namespace, "routed"), timeout=120, message=lambda: f"Ready; {operator.log()}")
    rev = get_gs(custom, namespace, "routed")["status"]["currentRevision"]
    route = wait_for(lambda: custom.get_namespaced_custom_object("gateway.networking.k8s.io", "v1", namespace,
                                                                  "httproutes", "routed"), timeout=60, message="HTTPRoute")
    assert route["spec"]["parentRefs"][0]["name"] == "gw"
    # the real HTTPRoute schema defaults group and kind
    assert route["spec"]["rules"][0]["backendRefs"] == [
        {"group": "", "kind": "Service", "name": f"routed-{rev}", "port": 8000, "weight": 100}]


def test_the_operator_exits_cleanly_on_sigterm(cluster, namespace, installed, tmp_path):
    proc = OperatorProcess(cluster.kubeconfig, namespace, tmp_path / "operator.log").start()
    try:
        wait_for(lambda: "Activity 'startup'" in proc.log() or proc.metrics_url(), timeout=120,
                 message=lambda: f"the operator started; {proc.log()}")
        proc.proc.terminate()
        assert proc.proc.wait(timeout=60) == 0, proc.log()
    finally:
        proc.kill()
