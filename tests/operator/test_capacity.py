"""Self-reported capacity counts only up to its plausibility bound (peers, the worker's own history)."""

from __future__ import annotations

import dataclasses

from op_helpers import REVISION, make_report
from reconcile_scenarios import World, ready_report, worker_config

from graphserving.contract.report import REPORT_ANNOTATION
from graphserving.contract.worker_config import ReadinessPolicy
from graphserving.operator import decisions, naming, status
from graphserving.operator.capacity import PLAUSIBLE_CAPACITY_FACTOR, AcceptedCapacity, Clamp, plausible_bound
from graphserving.operator.pods import routable_pods, view, with_capacity_bounds

FORGED = 1e9


# ------------------------------------------------------------------------------- the bound

def test_k_is_four():
    assert PLAUSIBLE_CAPACITY_FACTOR == 4.0


def test_a_report_far_above_its_peers_median_is_clamped_to_k_times_it():
    assert plausible_bound(FORGED, [1000, 1100, 900], None) == Clamp(FORGED, 4000, "the median 1000 tok/s of 3 peer(s)")


def test_a_report_within_k_times_its_peers_median_counts_as_reported():
    assert plausible_bound(3999, [1000], None) is None


def test_a_report_far_above_the_workers_own_first_accepted_capacity_is_clamped():
    assert plausible_bound(5000, [], 1000) == Clamp(5000, 4000, "its own first accepted 1000 tok/s")


def test_the_lowest_bound_applies():
    assert plausible_bound(FORGED, [2000], 500).bound == 2000
    assert plausible_bound(FORGED, [500], 2000).bound == 2000


def test_without_peers_or_history_a_report_counts_and_idle_peers_are_no_bound():
    assert plausible_bound(FORGED, [], None) is None
    assert plausible_bound(FORGED, [0.0, 0.0], None) is None


def test_the_accepted_capacity_annotation_round_trips_and_garbage_is_no_history():
    accepted = AcceptedCapacity("i-1", "abc", 1000.0)
    assert AcceptedCapacity.parse(accepted.to_annotation()) == accepted
    assert accepted.to_annotation() == '{"instance":"i-1","graphConfigHash":"abc","tokensPerSecond":1000.0}'
    for garbage in (None, "", "{", '{"instance":"i-1"}', '{"instance":"i","graphConfigHash":"h","tokensPerSecond":-1}'):
        assert AcceptedCapacity.parse(garbage) is None
    assert accepted.applies_to(make_report(instance="i-1").model_copy(update={"graph_config_hash": "abc"}))
    assert not accepted.applies_to(make_report(instance="i-2").model_copy(update={"graph_config_hash": "abc"}))


# ------------------------------------------------------------------ weights over two revisions

def _pod(name: str, revision: str, capacity: float) -> dict:
    report = make_report(pod=name, instance=f"i-{name}", capacity=capacity)
    return {
        "metadata": {"name": name, "namespace": "ns", "labels": {naming.LABEL_REVISION: revision},
                     "annotations": {REPORT_ANNOTATION: report.to_annotation()}},
        "status": {"conditions": [{"type": "Ready", "status": "True"}]},
    }


def test_a_forged_report_does_not_move_traffic_weights_beyond_the_bound():
    pods = [_pod("a-1", "rev-a", 1000), _pod("a-2", "rev-a", 1000), _pod("b-1", "rev-b", 1000),
            _pod("b-2", "rev-b", FORGED)]
    views = with_capacity_bounds([view(p, model_name="smollm2", model_revision=REVISION, policy=ReadinessPolicy(),
                                       desired_graph_config_hash=None) for p in pods])
    infos = {r: status.RevisionInfo(r, REVISION, None, None) for r in ("rev-a", "rev-b")}
    forged = next(v for v in views if v.name == "b-2")
    assert (forged.reported_capacity, forged.capacity) == (FORGED, 4000.0)
    # counted: rev-a 2000, rev-b 1000 + 4 x 1000; unbounded rev-b would take all 100
    assert decisions.traffic_weights(views, infos, "rev-b") == {"rev-a": 29, "rev-b": 71}


def test_a_revision_scaled_to_zero_in_this_reconcile_loses_its_weight_at_once():
    pods = [_pod("a-1", "rev-a", 1000), _pod("a-2", "rev-a", 1000), _pod("b-1", "rev-b", 1000)]
    views = with_capacity_bounds([view(p, model_name="smollm2", model_revision=REVISION, policy=ReadinessPolicy(),
                                       desired_graph_config_hash=None) for p in pods])
    infos = {r: status.RevisionInfo(r, REVISION, None, None) for r in ("rev-a", "rev-b")}
    assert decisions.traffic_weights(views, infos, "rev-b") == {"rev-a": 67, "rev-b": 33}
    # rev-a's Pods still report, but the decision stops them: its share goes before they do
    assert decisions.traffic_weights(views, infos, "rev-b", {"rev-a": 0, "rev-b": 2}) == {"rev-a": 0, "rev-b": 100}
    assert decisions.traffic_weights(views, infos, "rev-b", {"rev-a": 1, "rev-b": 2}) == {"rev-a": 67, "rev-b": 33}


# ------------------------------------------------------------------------------ the reconcile

def _forge(world: World, pod: dict, **kw) -> None:
    (dep,) = world.kube.of_kind("Deployment")
    report = ready_report(pod["metadata"]["name"], "", worker_config(dep), capacity=FORGED, **kw)
    pod["metadata"]["annotations"][REPORT_ANNOTATION] = report.model_dump_json(by_alias=True)


def test_a_forged_capacity_counts_at_k_times_its_peers_median_with_a_condition_and_one_event():
    world = World.new()
    world.create(replicas=3)
    world.settle(3)
    assert world.status()["capacity"] == "3000 tok/s"
    pod = world.kube.of_kind("Pod")[0]
    name = pod["metadata"]["name"]
    _forge(world, pod, instance="i-9", generation=1)  # a new instance: no history of its own
    world.reconcile()
    world.reconcile()
    st = world.status()
    assert (st["capacity"], st["effectiveCapacityTokensPerSecond"]) == ("6000 tok/s", 6000.0)
    assert st["revisions"][0]["effectiveCapacityTokensPerSecond"] == 6000.0
    message = f"pod {name} reported 1000000000 tok/s; counted 4000 tok/s (4x the median 1000 tok/s of 2 peer(s))"
    reconciled = world.condition("Reconciled")
    assert (reconciled["status"], reconciled["reason"]) == ("False", "CapacityClamped")
    assert reconciled["message"].startswith(message)
    assert world.kube.events().count(("Warning", "CapacityClamped", "gs")) == 1
    assert pod["metadata"]["annotations"][naming.POD_DELETION_COST] == "4000"


def test_a_lone_workers_capacity_is_bounded_by_its_own_first_accepted_one():
    world = World.new()
    world.create()
    world.settle(3)
    (pod,) = world.kube.of_kind("Pod")
    accepted = AcceptedCapacity.parse(pod["metadata"]["annotations"][naming.ANNOTATION_ACCEPTED_CAPACITY])
    assert (accepted.instance, accepted.tokens_per_second) == ("i-1", 1000.0)
    _forge(world, pod, instance="i-1", generation=4)
    world.reconcile()
    assert world.status()["capacity"] == "4000 tok/s"
    assert world.condition("Reconciled")["message"].startswith(
        f"pod {pod['metadata']['name']} reported 1000000000 tok/s; counted 4000 tok/s "
        "(4x its own first accepted 1000 tok/s)")
    # the history is the first accepted value: a clamped report does not raise it
    assert AcceptedCapacity.parse(pod["metadata"]["annotations"][naming.ANNOTATION_ACCEPTED_CAPACITY]) == accepted


def test_a_ready_worker_counts_only_once_its_service_endpoints_list_it():
    pods = [_pod("a-1", "rev-a", 1000), _pod("b-1", "rev-b", 1000)]
    views = [view(p, model_name="smollm2", model_revision=REVISION, policy=ReadinessPolicy(),
                  desired_graph_config_hash=None) for p in pods]
    slices = [{"metadata": {"labels": {"kubernetes.io/service-name": "gs-rev-a"}},
               "endpoints": [{"targetRef": {"kind": "Pod", "name": "a-1"}, "conditions": {"ready": True}}]},
              {"metadata": {"labels": {"kubernetes.io/service-name": "gs-rev-b"}},
               "endpoints": [{"targetRef": {"kind": "Pod", "name": "b-1"}, "conditions": {"ready": False}}]}]
    assert routable_pods(slices, "gs-rev-a") == {"a-1"} and routable_pods(slices, "gs-rev-b") == set()
    listed = {"rev-a": routable_pods(slices, "gs-rev-a"), "rev-b": routable_pods(slices, "gs-rev-b")}
    views = [dataclasses.replace(v, routable=v.name in listed[v.revision]) for v in views]
    b = next(v for v in views if v.name == "b-1")
    # b-1 is Ready with its gate True, but no gateway can reach it yet: no capacity, no weight,
    # and the reconcile comes back soon to look again (no Pod event follows the listing)
    assert (b.serving, b.capacity, b.awaiting_endpoints) == (False, 0.0, True)
    infos = {r: status.RevisionInfo(r, REVISION, None, None) for r in ("rev-a", "rev-b")}
    assert decisions.traffic_weights(views, infos, "rev-b") == {"rev-a": 100, "rev-b": 0}
