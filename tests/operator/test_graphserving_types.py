"""The GraphServing spec validates in Python with the same rules the CRD gives the API server."""

from __future__ import annotations

import pydantic
import pytest
from op_helpers import spec_dict

from graphserving.contract import graphserving_types as api
from graphserving.contract.graph_policy import GraphMode


def _error(spec: dict) -> str:
    with pytest.raises(pydantic.ValidationError) as info:
        api.GraphServingSpec.model_validate(spec)
    return str(info.value)


def test_a_minimal_spec_gets_the_documented_defaults():
    spec = api.GraphServingSpec.model_validate(spec_dict())
    assert spec.replicas == 1
    assert spec.rollout.max_surge == 1
    assert spec.rollout.min_available_capacity == 1.0
    assert spec.graphs.readiness.allow_degraded is False
    assert spec.runtime.gpus == 0


def test_json_is_camel_case_and_round_trips():
    spec = api.GraphServingSpec.model_validate(spec_dict())
    data = spec.to_api()
    assert data["runtime"]["engine"]["maxNumSeqs"] == 8
    assert data["graphs"]["captureSizes"] == [1, 2, 4, 8]
    assert api.GraphServingSpec.model_validate(data) == spec


def test_decreasing_capture_sizes_are_rejected_naming_both_values():
    message = _error(spec_dict(graphs={"mode": "FULL", "captureSizes": [1, 4, 2]}))
    assert "strictly increasing, got 4 then 2" in message


def test_a_capture_size_above_max_num_seqs_is_rejected_naming_the_limit():
    message = _error(spec_dict(graphs={"mode": "FULL", "captureSizes": [1, 16]}))
    assert "capture size 16 exceeds runtime.engine.maxNumSeqs=8" in message


def test_unknown_fields_are_rejected_with_their_name():
    message = _error(spec_dict(graphs={"mode": "FULL", "captureSize": [1]}))
    assert "graphs.captureSize" in message and "Extra inputs are not permitted" in message


def test_explicit_and_auto_capture_sizes_are_exclusive():
    message = _error(
        spec_dict(graphs={"captureSizes": [1], "autoCaptureSizes": {"histogramConfigMap": "h"}})
    )
    assert "captureSizes or autoCaptureSizes, not both" in message


def test_no_surge_with_full_capacity_floor_is_rejected():
    message = _error(spec_dict(rollout={"maxSurge": 0, "minAvailableCapacity": 1.0}))
    assert "maxSurge: 0 with minAvailableCapacity 1.0" in message


def test_min_available_capacity_is_a_fraction():
    assert "less than or equal to 1" in _error(spec_dict(rollout={"minAvailableCapacity": 1.5}))


def test_model_source_needs_exactly_one_location():
    message = _error(spec_dict(model={"name": "m", "revision": "a" * 64, "source": {}}))
    assert "exactly one of path, pvc, image" in message


def test_graph_mode_without_gpus_is_valid():
    spec = api.GraphServingSpec.model_validate(spec_dict(graphs={"mode": "FULL_AND_PIECEWISE"}))
    assert spec.graphs.mode is GraphMode.FULL_AND_PIECEWISE and spec.runtime.gpus == 0


def test_graphs_render_to_the_workers_graph_config():
    spec = api.GraphServingSpec.model_validate(spec_dict())
    worker = spec.graphs.to_worker()
    assert worker.capture_sizes == [1, 2, 4, 8]
    assert worker.mode is GraphMode.FULL
    assert spec.graphs.to_worker([1, 8]).capture_sizes == [1, 8]


@pytest.mark.parametrize(
    ("mode", "required", "uncaptured"),
    [("FULL", ["PIECEWISE"], ["PIECEWISE"]), ("PIECEWISE", ["FULL_DECODE_ONLY"], ["FULL_DECODE_ONLY"]),
     ("NONE", ["FULL_AND_PIECEWISE", "NONE"], ["FULL_AND_PIECEWISE"])],
)
def test_required_modes_the_graph_mode_never_captures_are_rejected(mode, required, uncaptured):
    message = _error(spec_dict(graphs={"mode": mode, "readiness": {"requiredModes": required}}))
    assert f"requiredModes {uncaptured} need graphs that graphs.mode {mode} does not capture" in message


def test_required_modes_within_the_graph_mode_are_accepted():
    spec = api.GraphServingSpec.model_validate(
        spec_dict(graphs={"mode": "FULL_AND_PIECEWISE", "readiness": {"requiredModes": ["FULL", "PIECEWISE"]}}))
    assert spec.graphs.readiness.to_worker().required_modes == [GraphMode.FULL, GraphMode.PIECEWISE]


def test_a_token_budget_below_max_num_seqs_is_rejected_naming_both_values():
    message = _error(spec_dict(runtime={"engine": {"maxNumSeqs": 64, "maxNumBatchedTokens": 32}}))
    assert "maxNumBatchedTokens (32) must be >= maxNumSeqs (64)" in message
    engine = api.Engine.model_validate({"maxNumSeqs": 64, "maxNumBatchedTokens": 64}).to_worker()
    assert (engine.max_num_seqs, engine.max_num_batched_tokens) == (64, 64)
