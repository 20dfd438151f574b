"""The worker report contract: schema-versioned, bounded, importable without torch."""

from __future__ import annotations

import json
import subprocess
import sys

import pydantic
import pytest
from op_helpers import make_report

from graphserving.contract.report import MAX_REPORT_BYTES, Phase, WorkerReport


def test_a_report_round_trips_through_its_annotation_text():
    report = make_report()
    text = report.to_annotation()
    assert json.loads(text)["schemaVersion"] == 1
    assert WorkerReport.from_annotation(text) == report


def test_annotation_json_uses_camel_case_field_names():
    data = json.loads(make_report().to_annotation())
    assert {"graphConfigHash", "graphKeyContractVersion", "effectiveCapacityTokensPerSecond", "kvCache"} <= set(data)


def test_a_large_report_is_compacted_under_the_bound_keeping_aggregates():
    sizes = tuple(range(1, 513))
    report = make_report(sizes=sizes, canary_fail=(7,))
    assert len(report.to_json().encode()) > MAX_REPORT_BYTES
    text = report.to_annotation()
    assert len(text.encode()) <= MAX_REPORT_BYTES
    compact = WorkerReport.from_annotation(text)
    assert compact.truncated is True
    assert compact.keys == []
    assert compact.canary_failures == 1
    assert compact.canary_passed() is False
    assert compact.capture_seconds_max == pytest.approx(51.2)
    assert compact.coverage == report.coverage


def test_an_oversized_annotation_is_refused_before_parsing():
    with pytest.raises(ValueError, match=f"the bound is {MAX_REPORT_BYTES}"):
        WorkerReport.from_annotation(" " * (MAX_REPORT_BYTES + 1))


def test_degraded_reports_must_say_why():
    with pytest.raises(pydantic.ValidationError, match="degradedReason is required"):
        make_report(phase=Phase.DEGRADED)


def test_unknown_schema_versions_are_rejected():
    data = json.loads(make_report().to_annotation())
    data["schemaVersion"] = 2
    with pytest.raises(pydantic.ValidationError, match="schemaVersion"):
        WorkerReport.model_validate(data)


def test_the_contract_imports_without_torch():
    code = (
        "import sys; import graphserving.contract.report, graphserving.contract.graphserving_types; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"



@pytest.mark.parametrize("capacity", [float("inf"), float("nan"), 1e30])
def test_a_report_with_a_non_finite_or_absurd_capacity_is_rejected(report_factory, capacity):
    from graphserving.contract.report import WorkerReport

    data = json.loads(report_factory().to_json())
    data["effectiveCapacityTokensPerSecond"] = capacity
    with pytest.raises(pydantic.ValidationError, match="effectiveCapacityTokensPerSecond"):
        WorkerReport.from_annotation(json.dumps(data))
