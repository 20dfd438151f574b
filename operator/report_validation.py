"""Validate a worker report annotation before the operator trusts it (pure).

A report is accepted only when it parses under the contract
(:class:`graphserving.contract.report.WorkerReport`), fits :data:`MAX_REPORT_BYTES`, was written by
the Pod it sits on, is about the model and revision the Pod's revision serves, speaks the graph key
contract version the operator knows, and is not older than a report already accepted from the same
worker instance. Every rejection has a machine reason (an Event reason) and a message naming the
offending field and value.
"""

from __future__ import annotations

import dataclasses
import enum

import pydantic

from graphserving.contract.report import GRAPH_KEY_CONTRACT_VERSION, MAX_REPORT_BYTES, WorkerReport


class ReportReason(enum.StrEnum):
    """``reason`` of a :class:`Validation` (and of the Event and metric of a rejection)."""

    MISSING = "ReportMissing"
    OVERSIZED = "ReportOversized"
    MALFORMED = "ReportMalformed"
    FOREIGN_POD = "ReportForeignPod"
    FOREIGN_MODEL = "ReportForeignModel"
    FOREIGN_REVISION = "ReportForeignRevision"
    CONTRACT_MISMATCH = "ReportContractMismatch"
    STALE = "ReportStale"
    ACCEPTED = "ReportAccepted"


#: Reasons of a report that is there but refused: each gets a Warning Event and a rejection metric
#: (a missing report is only not there yet).
REJECTIONS = frozenset(set(ReportReason) - {ReportReason.MISSING, ReportReason.ACCEPTED})


@dataclasses.dataclass(frozen=True)
class Expectation:
    """What a report on a given Pod must agree with."""

    pod_name: str
    namespace: str
    model_name: str
    model_revision: str
    #: ``instance/generation`` last accepted for this Pod (the operator's pod annotation), if any.
    accepted: str | None = None


@dataclasses.dataclass(frozen=True)
class Validation:
    """Outcome: ``report`` when accepted, else ``reason`` (CamelCase) and ``message``."""

    report: WorkerReport | None
    reason: str
    message: str

    @property
    def accepted(self) -> bool:
        return self.report is not None


def _reject(reason: str, message: str) -> Validation:
    return Validation(None, reason, message)


def accepted_marker(report: WorkerReport) -> str:
    """The ``instance/generation`` marker recorded when ``report`` is accepted."""
    return f"{report.worker.instance}/{report.generation}"


def validate_report(raw: str | None, expect: Expectation) -> Validation:
    """Check the annotation text ``raw`` against the contract and ``expect``.

    Returns a :class:`Validation`; never raises on bad input. Reasons: ``ReportMissing``,
    ``ReportOversized``, ``ReportMalformed``, ``ReportForeignPod``, ``ReportForeignModel``,
    ``ReportForeignRevision``, ``ReportContractMismatch``, ``ReportStale``, ``ReportAccepted``.
    """
    if raw is None or raw == "":
        return _reject(ReportReason.MISSING, "no graphserving.io/report annotation yet")
    size = len(raw.encode())
    if size > MAX_REPORT_BYTES:
        return _reject(ReportReason.OVERSIZED, f"report is {size} bytes; the bound is {MAX_REPORT_BYTES}")
    try:
        report = WorkerReport.model_validate_json(raw)
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(document)"
        return _reject(ReportReason.MALFORMED, f"{exc.error_count()} error(s); first at {where}: {first['msg']}")
    if report.worker.pod_name != expect.pod_name or report.worker.namespace != expect.namespace:
        return _reject(
            ReportReason.FOREIGN_POD,
            f"report names pod {report.worker.namespace}/{report.worker.pod_name}, "
            f"it sits on {expect.namespace}/{expect.pod_name}",
        )
    if report.model_name != expect.model_name:
        return _reject(ReportReason.FOREIGN_MODEL, f"report modelName {report.model_name!r}, expected {expect.model_name!r}")
    if report.model_revision != expect.model_revision:  # a report must name the revision it verified
        return _reject(
            ReportReason.FOREIGN_REVISION,
            f"report modelRevision {report.model_revision}, this pod's revision serves {expect.model_revision}",
        )
    if report.graph_key_contract_version != GRAPH_KEY_CONTRACT_VERSION:
        return _reject(
            ReportReason.CONTRACT_MISMATCH,
            f"graphKeyContractVersion {report.graph_key_contract_version}, operator knows "
            f"{GRAPH_KEY_CONTRACT_VERSION}",
        )
    if expect.accepted:
        instance, _, generation = expect.accepted.rpartition("/")
        if instance == report.worker.instance and generation.isdigit() and report.generation < int(generation):
            return _reject(
                ReportReason.STALE,
                f"generation {report.generation} of instance {instance} is older than the accepted {generation}",
            )
    return Validation(report, ReportReason.ACCEPTED, f"generation {report.generation}, phase {report.phase.value}")
