"""A dead worker's report never counts: the worker container's restarts against its report."""

from __future__ import annotations

import datetime as dt

from op_helpers import T0, make_report, worker_status
from reconcile_scenarios import World, ready_report, worker_config

from graphserving.contract.report import Phase, WorkerIdentity
from graphserving.operator import naming
from graphserving.operator.restarts import (
    CONTAINER_START_TOLERANCE,
    WorkerContainer,
    judge,
    restart_event,
    worker_container,
)

S = dt.timedelta(seconds=1)


def _container(**kw) -> WorkerContainer:
    c = worker_container({"status": {"containerStatuses": [worker_status(**kw)]}})
    assert c is not None
    return c


def _started(report, at: dt.datetime, instance: str = "i-2", generation: int = 1):
    identity = WorkerIdentity(pod_name=report.worker.pod_name, namespace=report.worker.namespace,
                              instance=instance, started_at=at)
    return report.model_copy(update={"worker": identity, "generation": generation})


# ------------------------------------------------------------------------------- the decision

def test_a_report_of_the_running_container_counts():
    assert judge(make_report(), _container(running_since=T0)) is None


def test_a_report_from_before_the_container_restarted_is_stale_naming_exit_and_phase():
    restart = judge(make_report(phase=Phase.CANARY),
                    _container(restarts=1, running_since=T0 + 30 * S, last_exit=(137, "OOMKilled")))
    assert restart is not None
    assert (restart.reason, restart.message) == (
        "WorkerRestarted", "worker container restarted (exit 137, OOMKilled) during Canary; "
                           "no report from the new container yet")
    assert (restart.decision.ready, restart.decision.reason) == (False, "WorkerRestarted")


def test_any_report_while_the_container_is_not_running_is_stale():
    restart = judge(make_report(), _container(restarts=1, running_since=None, waiting="CrashLoopBackOff",
                                              last_exit=(137, "Error")))
    assert restart is not None and restart.reason == "WorkerRestarted"
    assert restart.message == ("worker container restarted (exit 137, Error) during Ready; "
                               "waiting to restart (CrashLoopBackOff)")


def test_the_container_start_may_be_one_second_after_the_workers_own_start():
    assert CONTAINER_START_TOLERANCE == S
    assert judge(make_report(), _container(running_since=T0 + S)) is None
    assert judge(make_report(), _container(restarts=1, running_since=T0 + 2 * S)).reason == "WorkerRestarted"


def test_restarts_with_no_report_since_the_previous_run_are_a_crash_loop():
    restart = judge(make_report(phase=Phase.LOADING),
                    _container(restarts=3, running_since=None, waiting="CrashLoopBackOff", last_exit=(1, "Error"),
                               last_started=T0 + 60 * S))
    assert restart is not None and restart.reason == "WorkerCrashLoop"
    assert restart.message == ("worker container crash-looping: 3 restarts since its last report (phase Loading), "
                               "last exit 1, Error; waiting to restart (CrashLoopBackOff)")


def test_a_worker_that_never_reported_and_restarted_twice_is_a_crash_loop():
    restart = judge(None, _container(restarts=2, running_since=T0, last_exit=(1, "Error"), last_started=T0 - 30 * S))
    assert restart is not None
    assert (restart.reason, restart.message) == (
        "WorkerCrashLoop", "worker container crash-looping: 2 restarts without a report, last exit 1, Error; "
                           "no report from the new container yet")


def test_a_restart_after_which_the_previous_run_had_reported_is_not_a_crash_loop():
    report = _started(make_report(phase=Phase.READY), T0 + 61 * S)
    restart = judge(report, _container(restarts=2, running_since=T0 + 120 * S, last_exit=(137, "OOMKilled"),
                                       last_started=T0 + 60 * S))
    assert restart is not None and restart.reason == "WorkerRestarted"


def test_a_first_restart_before_any_report_names_it():
    restart = judge(None, _container(restarts=1, running_since=T0, last_exit=(2, "Error")))
    assert restart is not None
    assert restart.message == ("worker container restarted (exit 2, Error) before its first report; "
                               "no report from the new container yet")


def test_without_a_container_status_or_restart_nothing_is_judged():
    assert judge(make_report(), None) is None
    assert judge(None, _container(running_since=None, waiting="ContainerCreating")) is None


def test_a_report_older_than_a_container_that_never_restarted_is_stale():
    restart = judge(make_report(), _container(running_since=T0 + 10 * S))
    assert restart is not None and restart.reason == "ReportStale"
    assert restart.message == ("report of a worker started 2025-01-01T00:00:00+00:00, before its container "
                               "(2025-01-01T00:00:10+00:00)")


def test_the_worker_container_is_found_among_sidecars_and_its_times_parsed():
    pod = {"status": {"containerStatuses": [
        {"name": "proxy", "restartCount": 9, "state": {"running": {"startedAt": "2025-01-01T00:00:00Z"}}},
        worker_status(restarts=1, running_since=T0 + 5 * S, last_exit=(137, "OOMKilled"), last_started=T0),
    ]}}
    assert worker_container(pod) == WorkerContainer(
        restart_count=1, running_since=T0 + 5 * S, waiting_reason=None, terminated=False,
        exit_code=137, exit_reason="OOMKilled", previous_started_at=T0)
    assert worker_container({"status": {}}) is None


# ---------------------------------------------------------------------------------- the Event

def test_a_restart_event_is_posted_once_per_restart_count():
    c = _container(restarts=1, running_since=T0 + 30 * S, last_exit=(137, "OOMKilled"))
    restart = judge(make_report(), c)
    assert restart_event(c, None, restart) == ("WorkerRestarted", restart.message)
    assert restart_event(c, "1", restart) is None
    again = _container(restarts=2, running_since=T0 + 90 * S, last_exit=(137, "OOMKilled"))
    assert restart_event(again, "1", judge(make_report(), again)) == (
        "WorkerRestarted", "worker container restarted (exit 137, OOMKilled) during Ready; "
                           "no report from the new container yet")


def test_a_restart_the_new_container_reported_after_still_posts_its_event():
    c = _container(restarts=1, running_since=T0 + 30 * S, last_exit=(137, "OOMKilled"))
    report = _started(make_report(), T0 + 31 * S)
    assert judge(report, c) is None
    assert restart_event(c, "0", None) == (
        "WorkerRestarted", "worker container restarted (exit 137, OOMKilled); the new container reported already")


# ------------------------------------------------------------------------------ the reconcile

def _gate(pod: dict) -> dict:
    return next(c for c in pod["status"]["conditions"] if c["type"] == naming.READINESS_GATE)


def test_a_restart_flips_the_gate_false_at_once_with_the_message_and_one_event():
    world = World.new()
    world.create()
    world.settle(3)
    (pod,) = world.kube.of_kind("Pod")
    name = pod["metadata"]["name"]
    pod["status"]["containerStatuses"] = [worker_status(running_since=T0 - 5 * S)]
    world.reconcile()
    assert _gate(pod)["status"] == "True" and world.status()["ready"] == "1/1"
    before = len(world.kube.events())

    pod["status"]["containerStatuses"] = [worker_status(restarts=1, running_since=T0 + 60 * S,
                                                        last_exit=(137, "OOMKilled"))]
    world.reconcile()
    message = "worker container restarted (exit 137, OOMKilled) during Ready; no report from the new container yet"
    assert (_gate(pod)["status"], _gate(pod)["reason"], _gate(pod)["message"]) == ("False", "WorkerRestarted", message)
    assert world.kube.events()[before:] == [("Warning", "WorkerRestarted", name)]
    assert pod["metadata"]["annotations"][naming.ANNOTATION_OBSERVED_RESTARTS] == "1"
    status = world.status()
    assert status["ready"] == "0/1" and status["capacity"] == "0 tok/s"
    assert f"WorkerRestarted: {message}" in world.condition("Ready")["message"]
    assert world.condition("GraphsCaptured")["reason"] == "AwaitingReports"  # the dead report is not shown

    world.reconcile()
    assert world.kube.events()[before:] == [("Warning", "WorkerRestarted", name)]  # once per restart

    (dep,) = world.kube.of_kind("Deployment")
    fresh = _started(ready_report(name, "", worker_config(dep)), T0 + 61 * S)
    pod["metadata"]["annotations"]["graphserving.io/report"] = fresh.model_dump_json(by_alias=True)
    world.reconcile()
    assert (_gate(pod)["status"], _gate(pod)["reason"]) == ("True", "GraphsReady")
    assert [e for e in world.kube.events()[before:] if e[1] == "WorkerRestarted"] == [("Warning", "WorkerRestarted", name)]
