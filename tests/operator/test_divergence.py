"""Online canary divergences: the Degraded condition and one Warning Event on the Pod per increase."""

from __future__ import annotations

from op_helpers import make_report
from reconcile_scenarios import World, ready_report, worker_config

from graphserving.contract.report import REPORT_ANNOTATION, CanaryResult, OnlineCanary, WorkerReport
from graphserving.operator import naming
from graphserving.operator.divergence import diverged_keys, divergence_event, summary

DIVERGED = CanaryResult(passed=False, max_relative_logit_error=0.4, top1_agreement=0.5, reason="top-1 disagreement")


def _diverged(report: WorkerReport, sizes: tuple[int, ...], comparisons: int = 500) -> WorkerReport:
    """``report`` after its online canary took the FULL keys of ``sizes`` out of dispatch."""
    keys = [
        k.model_copy(update={
            "online_canary": OnlineCanary(comparisons=comparisons // len(report.keys),
                                          divergences=1 if k.size in sizes else 0,
                                          last_divergence=DIVERGED if k.size in sizes else None),
            "eager_reason": "canary_divergence" if k.size in sizes else None,
        })
        for k in report.keys
    ]
    return report.model_copy(update={
        "keys": keys, "online_canary_comparisons": comparisons, "online_canary_divergences": len(sizes),
        "coverage": 1 - len(sizes) / len(keys), "generation": report.generation + 1,
    })


def test_the_keys_out_of_dispatch_are_named_from_their_eager_reason():
    report = _diverged(make_report(sizes=(1, 2, 4, 8)), (2, 8))
    assert diverged_keys(report) == ["FULL/2", "FULL/8"]
    assert summary(report) == ("2 online canary divergence(s) in 500 comparison(s); FULL/2, FULL/8 out of dispatch "
                               "(eager, canary_divergence)")


def test_a_compacted_report_says_its_keys_are_not_listed():
    report = _diverged(make_report(), (8,)).compacted()
    assert summary(report) == "1 online canary divergence(s) in 500 comparison(s); keys not listed (report compacted)"


def test_an_event_is_due_once_per_increase_and_anew_for_a_new_instance():
    report = _diverged(make_report(instance="i-1"), (8,))
    assert divergence_event(make_report(), None) is None
    assert divergence_event(report, None) == ("GraphsDiverged", summary(report))
    assert divergence_event(report, "i-1/1") is None
    assert divergence_event(_diverged(make_report(instance="i-1"), (4, 8)), "i-1/1") is not None
    assert divergence_event(report, "i-0/5") is not None  # another instance's count does not hold it back


def _publish(pod: dict, report: WorkerReport) -> None:
    pod["metadata"]["annotations"][REPORT_ANNOTATION] = report.model_dump_json(by_alias=True)


def test_a_divergence_sets_degraded_graphs_diverged_and_posts_one_event_on_the_pod():
    world = World.new()
    world.create(graphs={"mode": "FULL", "captureSizes": [1, 2, 4, 8], "readiness": {"minCoverage": 0.5}})
    world.settle(3)
    (pod,) = world.kube.of_kind("Pod")
    name = pod["metadata"]["name"]
    (dep,) = world.kube.of_kind("Deployment")
    assert world.condition("Degraded")["status"] == "False"
    first = _diverged(ready_report(name, "", worker_config(dep)), (8,))
    _publish(pod, first)
    world.reconcile()
    world.reconcile()
    degraded = world.condition("Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "GraphsDiverged")
    assert degraded["message"] == f"{name}: {summary(first)}"
    assert world.status()["coverage"] == "75%"  # the worker's own coverage, not recounted
    assert world.kube.events().count(("Warning", "GraphsDiverged", name)) == 1
    assert pod["metadata"]["annotations"][naming.ANNOTATION_OBSERVED_DIVERGENCES] == "i-1/1"

    _publish(pod, _diverged(ready_report(name, "", worker_config(dep)), (4, 8)).model_copy(update={"generation": 9}))
    world.reconcile()
    assert world.kube.events().count(("Warning", "GraphsDiverged", name)) == 2
    assert pod["metadata"]["annotations"][naming.ANNOTATION_OBSERVED_DIVERGENCES] == "i-1/2"
