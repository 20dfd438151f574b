"""What the operator says about a worker's online canary divergences (pure).

A worker's online canary re-runs sampled graph replays eagerly and compares them under the canary
thresholds (docs/reliability.md, "Graphs are watched while they serve"); a divergence takes that
key out of dispatch (it runs eagerly, ``eager_reason`` :data:`CANARY_DIVERGENCE`) and the worker lowers its coverage itself, so
the operator only reports it: the GraphServing's ``Degraded`` condition (reason
:data:`DIVERGED_REASON` when no Pod serves degraded otherwise) and a Warning Event on the Pod once
per increase of ``onlineCanaryDivergences`` (the count last posted about, per worker instance, kept
on the Pod in :data:`~.naming.ANNOTATION_OBSERVED_DIVERGENCES`).
"""

from __future__ import annotations

from graphserving.contract.report import WorkerReport

#: ``KeyReport.eager_reason`` of a key the online canary took out of dispatch (the worker's
#: ``FallbackReason.CANARY_DIVERGENCE``; src/graphserving/contract/report.py, ``OnlineCanary``).
CANARY_DIVERGENCE = "canary_divergence"
#: Reason of the Degraded condition and of the Pod's Event.
DIVERGED_REASON = "GraphsDiverged"


def diverged_keys(report: WorkerReport) -> list[str]:
    """``KIND/size`` of every key taken out of dispatch by a divergence (``FULL/8``), in report order."""
    return [f"{k.kind}/{k.size}" for k in report.keys if k.eager_reason == CANARY_DIVERGENCE]


def summary(report: WorkerReport) -> str:
    """One line: the totals and the keys that run eagerly now (the report's, never recounted)."""
    line = (f"{report.online_canary_divergences} online canary divergence(s) in "
            f"{report.online_canary_comparisons} comparison(s)")
    keys = diverged_keys(report)
    if keys:
        return f"{line}; {', '.join(keys)} out of dispatch (eager, {CANARY_DIVERGENCE})"
    if report.truncated:
        return f"{line}; keys not listed (report compacted)"
    return line


def marker(report: WorkerReport) -> str:
    """``<instance>/<divergences>``: the value of :data:`~.naming.ANNOTATION_OBSERVED_DIVERGENCES`."""
    return f"{report.worker.instance}/{report.online_canary_divergences}"


def divergence_event(report: WorkerReport | None, recorded: str | None) -> tuple[str, str] | None:
    """``(reason, message)`` of the Warning Event for divergences not posted about yet, else None.

    ``recorded`` is the Pod's :data:`~.naming.ANNOTATION_OBSERVED_DIVERGENCES`: a new worker
    instance starts from 0, so only a count above the one recorded for the same instance posts.
    """
    if report is None or report.online_canary_divergences == 0:
        return None
    instance, _, count = (recorded or "").rpartition("/")
    seen = int(count) if instance == report.worker.instance and count.isdigit() else 0
    if report.online_canary_divergences <= seen:
        return None
    return DIVERGED_REASON, summary(report)
