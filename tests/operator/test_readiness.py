"""The graphs-ready gate decision: report + policy -> condition."""

from __future__ import annotations

from op_helpers import REVISION, make_report

from graphserving.contract.graph_policy import GraphMode
from graphserving.contract.report import Phase, config_hash
from graphserving.contract.worker_config import GraphConfig, ReadinessPolicy
from graphserving.operator.readiness import decide
from graphserving.operator.report_validation import Expectation, validate_report

EXPECT = Expectation(pod_name="gs-1-abc", namespace="ns", model_name="smollm2", model_revision=REVISION)
GRAPHS = GraphConfig(mode=GraphMode.FULL, capture_sizes=[1, 2, 4, 8])
HASH = config_hash(GRAPHS)


def _decide(report, policy=ReadinessPolicy(), desired=HASH):
    return decide(validate_report(report.to_annotation(), EXPECT), policy, desired)


def test_full_coverage_with_passing_canaries_is_ready():
    d = _decide(make_report())
    assert (d.ready, d.reason) == (True, "GraphsReady")


def test_a_failed_canary_keeps_the_pod_out():
    d = _decide(make_report(canary_fail=(4,)), ReadinessPolicy(min_coverage=0.5))
    assert (d.ready, d.reason, d.canary_failed) == (False, "CanaryFailed", True)


def test_coverage_below_the_minimum_is_not_ready():
    d = _decide(make_report(coverage=0.5), ReadinessPolicy(min_coverage=0.75))
    assert (d.ready, d.reason) == (False, "CoverageBelowMinimum")
    assert "0.500 < minCoverage 0.750" in d.message


def test_degraded_is_ready_only_when_allowed():
    report = make_report(phase=Phase.DEGRADED, degraded_reason="no CUDA")
    allowed = _decide(report, ReadinessPolicy(allow_degraded=True))
    refused = _decide(report, ReadinessPolicy(allow_degraded=False))
    assert (allowed.ready, allowed.degraded, allowed.message) == (True, True, "degraded: no CUDA")
    assert (refused.ready, refused.reason) == (False, "DegradedNotAllowed")
    assert "no CUDA" in refused.message


def test_a_worker_still_capturing_is_not_ready_and_says_its_phase():
    d = _decide(make_report(phase=Phase.CAPTURING))
    assert (d.ready, d.reason) == (False, "Capturing")


def test_a_report_for_another_graph_config_waits_for_recapture():
    d = _decide(make_report(), desired="0" * 16)
    assert (d.ready, d.reason) == (False, "RecapturePending")


def test_an_old_revision_is_not_held_to_the_new_graph_config():
    assert _decide(make_report(), desired=None).ready


def test_a_required_mode_without_captured_graphs_is_not_ready():
    d = _decide(make_report(), ReadinessPolicy(required_modes=[GraphMode.PIECEWISE]))
    assert (d.ready, d.reason) == (False, "RequiredModeMissing")


def test_a_rejected_report_keeps_the_gate_false_with_the_rejection_reason():
    d = decide(validate_report("{", EXPECT), ReadinessPolicy(), HASH)
    assert (d.ready, d.reason) == (False, "ReportMalformed")
