"""The reconciler's steps against an in-memory API (fake_kube): what it writes, in which order.

The cluster tests (test_operator_cluster.py) check the same behaviour against a real API server;
these run in milliseconds and pin the order of the steps (read, sync pods, recapture, rollout,
apply children, write status), the error handling of refused children and the metrics.
"""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path

import pytest
from fake_kube import api_error
from op_helpers import spec_dict
from prometheus_client import generate_latest
from reconcile_scenarios import REV_B, REV_C, World, failing_canary, refuse_service

from graphserving.contract.report import RECAPTURE_ANNOTATION
from graphserving.operator import children, decisions, kube, naming
from graphserving.operator.rollout import RolloutPhase

OPERATOR = Path(__file__).resolve().parents[2] / "operator"
ROUTE = {"parentRefs": [{"name": "gw"}]}


def _model(revision: str) -> dict:
    return {**spec_dict()["model"], "revision": revision}


def _target(world: World) -> str:
    return world.status()["currentRevision"]


def test_a_new_graphserving_gets_its_children_in_dependency_order_then_status():
    # The ServiceAccount before the Deployment: a ReplicaSet's Pods naming a missing one are
    # refused (a FailedCreate Warning on the first deploy); the HTTPRoute after its backend
    # Services and before the Deployments (it stops naming a revision before that one goes).
    world = World.new()
    world.create(replicas=2, routing=ROUTE)
    assert world.reconcile() == decisions.ACTIVE_REQUEUE_SECONDS
    rev = naming.revision_name("gs", _target(world))
    assert world.kube.written() == [
        ("apply ServiceAccount", naming.WORKER_SERVICE_ACCOUNT),
        ("apply Role", naming.WORKER_SERVICE_ACCOUNT),
        ("apply RoleBinding", naming.WORKER_SERVICE_ACCOUNT),
        ("apply Service", "gs"),
        ("apply Service", rev),
        ("apply PodDisruptionBudget", "gs"),
        ("apply HTTPRoute", "gs"),
        ("apply Deployment", rev),
        ("patch_namespaced_custom_object_status", "gs"),
    ]
    assert world.kube.events() == [("Normal", "RolloutStarted", "gs")]
    assert world.status()["rollout"]["phase"] == RolloutPhase.PROGRESSING
    assert world.kube.get("Deployment", rev)["spec"]["replicas"] == 2


def test_an_unchanged_graphserving_is_not_written_again():
    world = World.new()
    world.create()
    world.reconcile()
    before = len(world.kube.written())
    world.reconcile()
    assert world.kube.written()[before:] == []  # children cached, status unchanged


def test_ready_workers_open_their_gates_and_complete_the_rollout():
    world = World.new()
    world.create(replicas=2)
    world.settle(3)
    pods = world.kube.of_kind("Pod")
    assert len(pods) == 2
    for pod in pods:
        gate = next(c for c in pod["status"]["conditions"] if c["type"] == naming.READINESS_GATE)
        assert (gate["status"], gate["reason"]) == ("True", "GraphsReady")
        annotations = pod["metadata"]["annotations"]
        assert annotations[naming.POD_DELETION_COST] == "1000"
        assert annotations[naming.ANNOTATION_ACCEPTED_REPORT] == "i-1/3"
    assert [e[1] for e in world.kube.events()] == ["RolloutStarted", "GraphsReady", "GraphsReady", "RolloutComplete"]
    assert world.status()["rollout"]["phase"] == RolloutPhase.COMPLETE
    assert world.status()["ready"] == "2/2"
    assert world.condition("Ready")["status"] == "True"
    assert world.requeues[-1] == decisions.IDLE_RESYNC_SECONDS
    text = generate_latest(world.metrics.registry).decode()
    assert 'graphserving_operator_rollout_phase{name="gs",namespace="ns",phase="Complete"} 1.0' in text
    assert 'graphserving_operator_readiness_gate_updates_total{status="True"} 2.0' in text


def test_a_new_model_revision_rolls_every_pod_and_deletes_the_old_revision():
    world = World.new()
    world.create(replicas=2, routing=ROUTE)
    world.settle(3)
    old = naming.revision_name("gs", _target(world))
    world.edit(model=_model(REV_B))
    world.settle(8)
    new = naming.revision_name("gs", _target(world))
    assert new != old
    assert world.status()["rollout"]["phase"] == RolloutPhase.COMPLETE
    assert ("delete Deployment", old) in world.kube.written() and ("delete Service", old) in world.kube.written()
    assert [d["metadata"]["name"] for d in world.kube.of_kind("Deployment")] == [new]
    backends = world.kube.get("HTTPRoute", "gs")["spec"]["rules"][0]["backendRefs"]
    assert [(b["name"], b["weight"]) for b in backends] == [(new, 100)]
    scales = [n for m, n in world.kube.written() if m == "scale Deployment"]
    assert scales and set(scales) <= {old, new}
    # the route stopped naming the old revision before its Service went (a gateway refuses a
    # backendRef to a missing Service), and gave it no weight from the reconcile that scaled it to 0
    calls = world.kube.calls
    routes = [(i, {b["name"]: b["weight"] for b in body["spec"]["rules"][0]["backendRefs"]})
              for i, (m, _, body) in enumerate(calls) if m == "apply HTTPRoute"]
    deleted = next(i for i, (m, n, _) in enumerate(calls) if (m, n) == ("delete Service", old))
    to_zero = next(i for i, (m, n, b) in enumerate(calls)
                   if (m, n) == ("scale Deployment", old) and b["body"]["spec"]["replicas"] == 0)
    assert old not in max((r for r in routes if r[0] < deleted), key=lambda r: r[0])[1]
    assert max((r for r in routes if r[0] < to_zero), key=lambda r: r[0])[1].get(old) == 0


def test_a_graph_only_change_asks_each_worker_to_recapture_once():
    world = World.new()
    world.create(replicas=2)
    world.settle(3)
    target = _target(world)
    world.edit(graphs={"mode": "FULL", "captureSizes": [1, 2, 4]})
    world.reconcile()
    world.reconcile()
    assert _target(world) == target  # no new revision: the graphs change in place
    assert [e[1] for e in world.kube.events()].count("RecaptureRequested") == 2
    assert len(world.recaptures) == 2
    ip, port, payload = world.recaptures[0]
    assert (ip, port) == ("10.0.0.1", 8000) and json.loads(payload)["graphs"]["capture_sizes"] == [1, 2, 4]
    for pod in world.kube.of_kind("Pod"):
        assert json.loads(pod["metadata"]["annotations"][RECAPTURE_ANNOTATION]) == json.loads(payload)
        gate = next(c for c in pod["status"]["conditions"] if c["type"] == naming.READINESS_GATE)
        assert gate["reason"] == "RecapturePending"


def test_status_names_the_stable_service_as_url_and_address_and_reconciled_holds():
    world = World.new()
    world.create(graphs={"mode": "NONE"}, runtime={"engine": {"maxNumSeqs": 8, "maxNumBatchedTokens": 256},
                                                   "port": 9000})
    world.settle(3)
    status = world.status()
    assert (status["url"], status["address"]) == ("http://gs.ns.svc:9000/v1", "gs.ns.svc:9000")
    reconciled = world.condition("Reconciled")
    assert (reconciled["status"], reconciled["reason"]) == ("True", "AsSpecified")
    assert [c["type"] for c in status["conditions"]] == [
        "Ready", "Progressing", "Degraded", "GraphsCaptured", "CanaryPassed", "Reconciled"]


def test_a_refused_stable_service_leaves_url_and_address_unset():
    world = World.new()
    world.create()
    refuse_service(world, "gs")
    world.reconcile()
    status = world.status()
    assert "url" not in status and "address" not in status
    assert world.condition("Reconciled")["reason"] == "ServiceRejected"


def test_a_refused_child_goes_to_the_reconciled_condition_last_failure_and_one_event():
    world = World.new()
    world.create()
    world.settle(3)
    rev = naming.revision_name("gs", _target(world))
    world.reconciler.child_changed("Service", "ns", rev)
    refuse_service(world, rev)
    world.reconcile()
    world.reconciler.child_changed("Service", "ns", rev)
    world.reconcile()
    reconciled = world.condition("Reconciled")
    assert reconciled["status"] == "False" and reconciled["reason"] == "ServiceRejected"
    assert reconciled["message"].startswith(f'Service {rev}: 422 Service "{rev}" is invalid: spec.ports; ')
    assert "GraphModeWithoutGPU" not in reconciled["reason"] and "without GPUs" in reconciled["message"]
    assert world.status()["lastFailure"]["reason"] == "ServiceRejected"
    assert world.kube.events().count(("Warning", "ServiceRejected", "gs")) == 1
    # the PodDisruptionBudget after the refused Service is still applied, status still written
    assert world.kube.get("PodDisruptionBudget", "gs") is not None
    assert world.requeues[-2:] == [decisions.IDLE_RESYNC_SECONDS] * 2


def test_a_refusal_other_than_400_404_422_fails_the_reconcile_and_counts_the_error():
    world = World.new()
    world.create()
    world.kube.refuse("apply Service", "gs", api_error(500))
    with pytest.raises(Exception) as info:
        world.reconcile()
    assert getattr(info.value, "status", None) == 500
    text = generate_latest(world.metrics.registry).decode()
    assert 'graphserving_operator_reconcile_errors_total{error="ApiException"} 1.0' in text
    assert 'graphserving_operator_reconcile_total{result="error"} 1.0' in text


def test_unsetting_routing_deletes_the_route_it_owns_only():
    world = World.new()
    world.create(routing=ROUTE)
    world.reconcile()
    world.edit(routing=None)
    world.reconcile()
    world.reconcile()  # remembered as absent: not looked up again
    assert world.kube.get("HTTPRoute", "gs") is None
    assert [m for m, _ in world.kube.written() if "HTTPRoute" in m] == ["apply HTTPRoute", "delete HTTPRoute"]

    other = World.new()
    other.create()
    other.kube.put("HTTPRoute", {"metadata": {"name": "gs", "namespace": "ns", "uid": "someone-else"}})
    other.reconcile()
    assert other.kube.get("HTTPRoute", "gs") is not None


def test_failed_canaries_roll_back_to_the_previous_revision():
    world = World.new()
    world.create(replicas=2)
    world.settle(3)
    previous = _target(world)
    world.edit(model=_model(REV_C))
    world.reconcile()
    bad = _target(world)
    world.settle(4, failing_canary(bad))
    rollout = world.status()["rollout"]
    assert (rollout["phase"], rollout["failedRevision"], rollout["previousRevision"]) == (
        RolloutPhase.ROLLED_BACK, bad, previous,
    )
    assert ("Warning", "RolledBack", "gs") in world.kube.events()
    assert world.status()["lastFailure"]["reason"] == "RolledBack"
    assert world.condition("Progressing")["reason"] == "RolledBack"


def test_gone_deleting_and_invalid_graphservings_are_left_alone():
    world = World.new()
    assert world.reconcile("nope") is None
    gs = world.create("del")
    gs["metadata"]["deletionTimestamp"] = "2025-01-01T00:00:00Z"
    assert world.reconcile("del") is None
    world.create("bad", replicas=-1)
    assert world.reconcile("bad") is None
    assert world.reconcile("bad") is None
    assert world.kube.written() == [("patch_namespaced_custom_object_status", "bad")]
    assert world.kube.events() == [("Warning", "InvalidSpec", "bad")]
    assert world.status("bad")["lastFailure"]["message"].startswith("spec rejected by the operator: spec.replicas")


def test_unresolved_auto_capture_sizes_warn_and_fall_back_then_resolve():
    world = World.new()
    world.create(graphs={"mode": "FULL", "autoCaptureSizes": {"histogramConfigMap": "hist"}})
    world.reconcile()
    reconciled = world.condition("Reconciled")  # the spec's own warnings first, in order
    assert (reconciled["status"], reconciled["reason"]) == ("False", "GraphModeWithoutGPU")
    assert reconciled["message"].endswith("will not become ready; ConfigMap ns/hist: 404 Not Found; using the default grid")
    assert world.status()["lastFailure"]["reason"] == "CaptureSizesUnresolved"
    world.kube.put("ConfigMap", {"metadata": {"name": "hist", "namespace": "ns"},
                                 "data": {"histogram.csv": "batch_size,count\n1,10\n3,40\n8,5\n"}})
    world.reconcile()
    assert world.status()["captureSizes"][-1] == 8


def test_a_pod_gone_before_its_gate_is_written_is_skipped():
    world = World.new()
    world.create()
    world.reconcile()
    world.kube.add_pod("gs", _target(world), "gs-gone", None)
    world.kube.refuse("patch_namespaced_pod_status", "gs-gone", api_error(404))
    world.reconcile()
    assert ("patch_namespaced_pod", "gs-gone") not in world.kube.written()


def test_every_kind_the_operator_renders_has_its_apply_call():
    gs_body = World.new().create(routing=ROUTE)
    from graphserving.contract import graphserving_types as api

    gs = api.GraphServing.model_validate(gs_body)
    rendered = [children.deployment(gs, "r", 1, gs.spec.graphs.to_worker()), children.stable_service(gs),
                children.pod_disruption_budget(gs), *children.worker_rbac("ns")]
    kinds = {o["kind"] for o in rendered} | {"HTTPRoute"}
    assert kinds == set(kube.PATCH_BY_KIND)
    world = World.new()
    with pytest.raises(ValueError, match="cannot apply kind ConfigMap"):
        world.reconciler._apply({"kind": "ConfigMap", "metadata": {"name": "x", "namespace": "ns"}})


def _imports(module: str) -> set[str]:
    tree = ast.parse((OPERATOR / f"{module}.py").read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            found |= {node.module} if node.module else {a.name for a in node.names}
    return found


def test_handlers_and_main_do_not_import_each_other_both_ways():
    assert "main" not in _imports("handlers")
    assert "handlers" in _imports("main")
    assert not {"main", "handlers", "reconcile"} & _imports("kube")
    assert "kube" in _imports("handlers") and "kube" in _imports("main")


def _observed(world: World) -> decisions.Observed:
    seen = world.reconciler._read("ns", "gs")
    assert seen is not None
    return seen


def test_outcome_puts_refused_children_first_and_records_the_last_warning_event():
    from graphserving.operator.rollout import Event

    world = World.new()
    world.create()
    seen = _observed(world)
    decision = decisions.decide_rollout(seen)
    rejected = [("ServiceRejected", "Service gs: 422 no"), ("PodDisruptionBudgetRejected", "PodDisruptionBudget gs: 404")]
    warnings, failure, to_post = decisions.outcome(seen, decision, rejected)
    assert warnings[:2] == rejected and warnings[2][0] == "GraphModeWithoutGPU"
    assert failure is not None and (failure.reason, failure.revision) == ("ServiceRejected", seen.desired.target)
    assert to_post == [("Warning", "ServiceRejected", "Service gs: 422 no"),
                       ("Normal", "RolloutStarted", f"rolling out revision {seen.desired.target}")]
    late = dataclasses.replace(decision, events=(Event("Warning", "ProgressDeadlineExceeded", "late"),))
    _, failure, _ = decisions.outcome(seen, late, rejected)
    assert failure is not None and failure.reason == "ProgressDeadlineExceeded"


def test_requeue_is_soon_while_a_rollout_moves_or_old_revisions_remain():
    world = World.new()
    world.create()
    seen = _observed(world)
    decision = decisions.decide_rollout(seen)
    assert decision.state.phase == RolloutPhase.PROGRESSING
    assert decisions.requeue_after(decision, seen.infos) == decisions.ACTIVE_REQUEUE_SECONDS
    for phase in RolloutPhase:
        done = dataclasses.replace(decision, state=decision.state.model_copy(update={"phase": phase}))
        moving = phase in (RolloutPhase.PROGRESSING, RolloutPhase.DEADLINE_EXCEEDED)
        assert decisions.requeue_after(done, seen.infos) == (
            decisions.ACTIVE_REQUEUE_SECONDS if moving else decisions.IDLE_RESYNC_SECONDS
        )
        assert decisions.requeue_after(done, {**seen.infos, "old": seen.infos[seen.desired.target]}) == (
            decisions.ACTIVE_REQUEUE_SECONDS
        )
