"""A worker container's restarts against its report (pure): is the report still the live worker's?

A report is an annotation on the Pod, so it outlives the process that wrote it: after the worker
container restarts (killed during Canary, OOM-killed when Ready) the dead instance's report stays
until the new process publishes its own. The kubelet records each restart in the Pod's
``status.containerStatuses[]`` (``restartCount``, ``state``, ``lastState.terminated``), which only
the kubelet writes (a worker's token may not touch ``pods/status``: manifests/policy). A report is
**stale** when its ``worker.startedAt`` (the process start) is before the current container's
``state.running.startedAt`` (less :data:`CONTAINER_START_TOLERANCE`), or when the container is not
running at all. A stale report never counts: its gate decision is :attr:`Restart.decision`.

:func:`judge` is the decision; :func:`restart_event` the Event that goes with a restart the operator
has not recorded yet (once per ``restartCount``, remembered in
:data:`~.naming.ANNOTATION_OBSERVED_RESTARTS` on the Pod, so an operator restart posts none again).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Mapping
from typing import Any

from graphserving.contract.report import WorkerReport
from .readiness import GateDecision, GateReason
from .report_validation import ReportReason

#: The container the operator renders (:func:`.children.worker_container`).
WORKER_CONTAINER = "worker"

#: How far a report's ``worker.startedAt`` may lie before its container's ``startedAt`` and still be
#: the current container's. Both are read from the same node's clock (the container runtime records
#: the container start, the worker its process start after its imports), and the API stores the
#: container start at 1 s resolution, truncated, which only moves it earlier; so a current report is
#: never before it, and 1 s covers a clock step between the two readings. A restart cannot hide in
#: it: the old process started one back-off (10 s and up in the kubelet) plus its own run time before
#: the new container.
CONTAINER_START_TOLERANCE = dt.timedelta(seconds=1)

#: Restarts after which a container whose previous run reported nothing is called a crash loop.
CRASH_LOOP_RESTARTS = 2

CRASH_LOOP_BACK_OFF = "CrashLoopBackOff"


@dataclasses.dataclass(frozen=True)
class WorkerContainer:
    """The worker container's entry of ``status.containerStatuses`` (times timezone-aware, UTC)."""

    restart_count: int
    running_since: dt.datetime | None  # state.running.startedAt; None unless running
    waiting_reason: str | None  # state.waiting.reason, e.g. CrashLoopBackOff, ContainerCreating
    terminated: bool  # state.terminated: exited and not restarted (yet)
    exit_code: int | None  # of the last run that ended: state.terminated, else lastState.terminated
    exit_reason: str | None  # its reason: OOMKilled, Error, Completed
    previous_started_at: dt.datetime | None  # lastState.terminated.startedAt: the previous run's start

    @property
    def running(self) -> bool:
        return self.running_since is not None

    @property
    def exit(self) -> str:
        """``exit 137, OOMKilled``; ``exit unknown`` when the kubelet kept no record of it."""
        if self.exit_code is None:
            return "exit unknown"
        return f"exit {self.exit_code}, {self.exit_reason}" if self.exit_reason else f"exit {self.exit_code}"


def _time(value: Any) -> dt.datetime | None:
    if not isinstance(value, str) or not value:
        return None
    try:
        parsed = dt.datetime.fromisoformat(value)
    except ValueError:
        return None
    return _utc(parsed)


def _utc(t: dt.datetime) -> dt.datetime:
    return t.replace(tzinfo=dt.timezone.utc) if t.tzinfo is None else t


def worker_container(pod: Mapping[str, Any]) -> WorkerContainer | None:
    """The :data:`WORKER_CONTAINER` status of ``pod`` (raw JSON, camelCase); None when the kubelet
    has reported none yet (then nothing is judged)."""
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    raw = next((s for s in statuses if s.get("name") == WORKER_CONTAINER), None)
    if raw is None:
        return None
    state = raw.get("state") or {}
    running = state.get("running")
    terminated = state.get("terminated")
    last = (raw.get("lastState") or {}).get("terminated") or {}
    ended = terminated or last
    return WorkerContainer(
        restart_count=int(raw.get("restartCount") or 0),
        running_since=_time((running or {}).get("startedAt")) if running is not None else None,
        waiting_reason=(state.get("waiting") or {}).get("reason") if running is None else None,
        terminated=terminated is not None and running is None,
        exit_code=ended.get("exitCode"),
        exit_reason=ended.get("reason"),
        previous_started_at=_time(last.get("startedAt")),
    )


@dataclasses.dataclass(frozen=True)
class Restart:
    """Why a Pod's report (or its absence) is judged by its container: reason and message."""

    reason: str  # GateReason.WORKER_RESTARTED / WORKER_CRASH_LOOP, or ReportReason.STALE
    message: str

    @property
    def decision(self) -> GateDecision:
        return GateDecision(False, self.reason, self.message)


def _fresh(report: WorkerReport, c: WorkerContainer) -> bool:
    """``report`` was written by the container running now."""
    return c.running_since is not None and _utc(report.worker.started_at) >= c.running_since - CONTAINER_START_TOLERANCE


def _predates_previous_run(report: WorkerReport | None, c: WorkerContainer) -> bool:
    """The previous run ended without a report of its own (``report`` is older, or there is none)."""
    if report is None:
        return True
    start = c.previous_started_at
    return start is not None and _utc(report.worker.started_at) < start - CONTAINER_START_TOLERANCE


def _state(c: WorkerContainer) -> str:
    if c.running:
        return "no report from the new container yet"
    if c.waiting_reason == CRASH_LOOP_BACK_OFF:
        return f"waiting to restart ({CRASH_LOOP_BACK_OFF})"
    if c.terminated:
        return "the container has exited"
    return f"the container is waiting ({c.waiting_reason or 'no reason given'})"


def judge(report: WorkerReport | None, c: WorkerContainer | None) -> Restart | None:
    """Whether ``c``'s restarts make the Pod's gate decision, and with which reason and message.

    Args:
        report: the Pod's accepted report, or None (missing or rejected).
        c: the worker container's status (:func:`worker_container`); None: unknown, nothing judged.

    Returns:
        None when ``report`` is the running container's (it counts), or when there is no report
        and the container never restarted (the worker is still starting: ``ReportMissing``).
        Otherwise a :class:`Restart`: ``WorkerCrashLoop`` after :data:`CRASH_LOOP_RESTARTS` or more
        restarts of which the last run reported nothing; ``WorkerRestarted`` for another restart
        (``worker container restarted (exit 137, OOMKilled) during Canary; ...``, the phase being
        the stale report's); ``ReportStale`` for a report that predates a container which never
        restarted (or that is not running).
    """
    if c is None or (report is not None and _fresh(report, c)):
        return None
    if report is None and c.restart_count == 0:
        return None
    during = f"during {report.phase.value}" if report is not None else "before its first report"
    if c.restart_count >= CRASH_LOOP_RESTARTS and _predates_previous_run(report, c):
        since = f"since its last report (phase {report.phase.value})" if report is not None else "without a report"
        return Restart(
            GateReason.WORKER_CRASH_LOOP,
            f"worker container crash-looping: {c.restart_count} restarts {since}, last {c.exit}; {_state(c)}",
        )
    if c.restart_count > 0:
        return Restart(GateReason.WORKER_RESTARTED, f"worker container restarted ({c.exit}) {during}; {_state(c)}")
    assert report is not None
    started = report.worker.started_at.isoformat()
    if c.running_since is not None:
        message = f"report of a worker started {started}, before its container ({c.running_since.isoformat()})"
    else:
        message = f"report (phase {report.phase.value}) while the worker container is not running: {_state(c)}"
    return Restart(ReportReason.STALE, message)


def restart_event(c: WorkerContainer | None, recorded: str | None, restart: Restart | None) -> tuple[str, str] | None:
    """``(reason, message)`` of the Warning Event for restarts not recorded on the Pod yet, else None.

    Args:
        c: the worker container's status.
        recorded: the Pod's :data:`~.naming.ANNOTATION_OBSERVED_RESTARTS` (the ``restartCount``
            last posted about; absent or unreadable: 0).
        restart: :func:`judge`'s result for the Pod (None: the new container reported already).
    """
    if c is None or c.restart_count <= _recorded(recorded):
        return None
    if restart is not None and restart.reason != ReportReason.STALE:
        return restart.reason, restart.message
    return GateReason.WORKER_RESTARTED, f"worker container restarted ({c.exit}); the new container reported already"


def _recorded(value: str | None) -> int:
    return int(value) if value is not None and value.isdigit() else 0
