"""The operator rejects reports it must not trust, naming why."""

from __future__ import annotations

from op_helpers import REVISION, make_report

from graphserving.contract.report import MAX_REPORT_BYTES
from graphserving.operator.report_validation import Expectation, validate_report

EXPECT = Expectation(pod_name="gs-1-abc", namespace="ns", model_name="smollm2", model_revision=REVISION)


def test_a_matching_report_is_accepted():
    result = validate_report(make_report().to_annotation(), EXPECT)
    assert result.accepted and result.reason == "ReportAccepted"


def test_a_missing_report_is_not_an_error_but_not_accepted():
    assert validate_report(None, EXPECT).reason == "ReportMissing"


def test_malformed_json_is_rejected():
    result = validate_report("{not json", EXPECT)
    assert result.reason == "ReportMalformed" and not result.accepted


def test_a_contract_violation_is_rejected_naming_the_field():
    text = make_report().to_annotation().replace('"coverage":1.0', '"coverage":1.5')
    result = validate_report(text, EXPECT)
    assert result.reason == "ReportMalformed"
    assert "coverage" in result.message


def test_an_oversized_value_is_rejected():
    result = validate_report("x" * (MAX_REPORT_BYTES + 1), EXPECT)
    assert result.reason == "ReportOversized"


def test_a_report_copied_from_another_pod_is_rejected():
    result = validate_report(make_report(pod="other-pod").to_annotation(), EXPECT)
    assert result.reason == "ReportForeignPod"
    assert "other-pod" in result.message


def test_a_report_about_other_weights_is_rejected():
    result = validate_report(make_report(model_revision="b" * 64).to_annotation(), EXPECT)
    assert result.reason == "ReportForeignRevision"


def test_an_older_generation_of_the_same_instance_is_stale():
    expect = Expectation(**{**EXPECT.__dict__, "accepted": "i-1/5"})
    result = validate_report(make_report(instance="i-1", generation=4).to_annotation(), expect)
    assert result.reason == "ReportStale"
    assert "generation 4" in result.message


def test_a_restarted_worker_instance_may_start_its_generations_again():
    expect = Expectation(**{**EXPECT.__dict__, "accepted": "i-1/5"})
    assert validate_report(make_report(instance="i-2", generation=1).to_annotation(), expect).accepted


def test_a_report_that_names_no_verified_revision_is_rejected():
    result = validate_report(make_report(model_revision=None).to_annotation(), EXPECT)
    assert result.reason == "ReportForeignRevision" and not result.accepted


def test_a_report_that_names_no_namespace_is_rejected():
    result = validate_report(make_report(namespace=None).to_annotation(), EXPECT)
    assert result.reason == "ReportForeignPod" and not result.accepted
