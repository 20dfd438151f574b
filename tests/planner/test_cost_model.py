"""Analytic and measured cost models."""

from __future__ import annotations

import json

import pytest

from graphserving.planner.cost_model import (
    MIB,
    AnalyticCostModel,
    CostModelError,
    MeasuredCostModel,
    interpolate,
)


def test_analytic_step_time_counts_padded_rows_like_real_ones():
    model = AnalyticCostModel()
    assert model.step_time(3, 8) == 8.0
    assert model.eager_step_time(300) == 300.0
    assert model.graph_memory_bytes(16) == 32 * MIB
    assert model.capture_seconds(100) == pytest.approx(0.25)


def test_interpolation_is_linear_between_points_flat_below_and_extrapolated_above():
    xs, ys = [2.0, 4.0, 8.0], [10.0, 20.0, 24.0]
    assert interpolate(xs, ys, 3) == 15.0
    assert interpolate(xs, ys, 6) == 22.0
    assert interpolate(xs, ys, 1) == 10.0
    assert interpolate(xs, ys, 12) == 28.0  # slope 1 per size from the last two points
    assert interpolate([4.0], [8.0], 8) == 16.0  # a single point scales with rows


def _write(tmp_path, data) -> str:
    path = tmp_path / "cost.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_measured_model_interpolates_unmeasured_sizes(tmp_path):
    path = _write(
        tmp_path,
        {
            "schema": "graphserving.cost-model/v1",
            "sizes": [
                {"capture_size": 8, "step_seconds": 0.004, "graph_memory_bytes": 8e6, "capture_seconds": 0.3},
                {"capture_size": 1, "step_seconds": 0.002, "graph_memory_bytes": 1e6, "capture_seconds": 0.2},
            ],
            "eager": [{"batch_size": 1, "step_seconds": 0.01}, {"batch_size": 9, "step_seconds": 0.018}],
        },
    )
    model = MeasuredCostModel.from_json(path)
    assert model.step_time(2, 4) == pytest.approx(0.002 + 0.002 * 3 / 7)
    assert model.graph_memory_bytes(4) == pytest.approx(4e6)
    assert model.capture_seconds(8) == pytest.approx(0.3)
    assert model.eager_step_time(5) == pytest.approx(0.014)
    assert model.time_unit == "s"


def test_measured_model_without_eager_rows_uses_graph_time_at_the_batch_size(tmp_path):
    path = _write(
        tmp_path,
        {
            "schema": "graphserving.cost-model/v1",
            "sizes": [{"capture_size": 4, "step_seconds": 0.004, "graph_memory_bytes": 0, "capture_seconds": 0}],
        },
    )
    assert MeasuredCostModel.from_json(path).eager_step_time(8) == pytest.approx(0.008)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"schema": "other", "sizes": []}, "schema"),
        ({"schema": "graphserving.cost-model/v1", "sizes": []}, "sizes"),
        (
            {"schema": "graphserving.cost-model/v1", "sizes": [{"capture_size": 0, "step_seconds": 1,
                                                                "graph_memory_bytes": 0, "capture_seconds": 0}]},
            r"sizes\.0\.capture_size",
        ),
    ],
)
def test_bad_cost_model_files_name_the_field(tmp_path, data, message):
    with pytest.raises(CostModelError, match=message):
        MeasuredCostModel.from_json(_write(tmp_path, data))


@pytest.mark.parametrize(("field", "value"), [("step_seconds", "Infinity"), ("graph_memory_bytes", "Infinity"),
                                              ("capture_seconds", "NaN")])
def test_cost_model_with_a_non_finite_number_names_the_field(tmp_path, field, value):
    # Python's json reads Infinity and NaN; they made plan-buckets --json print Infinity/NaN (not JSON).
    row = {"capture_size": 4, "step_seconds": 0.004, "graph_memory_bytes": 0, "capture_seconds": 0}
    text = json.dumps({"schema": "graphserving.cost-model/v1", "sizes": [row]}).replace(
        f'"{field}": {json.dumps(row[field])}', f'"{field}": {value}'
    )
    path = tmp_path / "cost.json"
    path.write_text(text)
    with pytest.raises(CostModelError) as info:
        MeasuredCostModel.from_json(path)
    assert str(info.value) == f"cost model {str(path)!r}: sizes.0.{field}: Input should be a finite number"


def test_cost_model_that_is_not_utf8_is_refused(tmp_path):
    path = tmp_path / "cost.json"
    path.write_bytes(b'{"schema": "\xff"}')
    with pytest.raises(CostModelError, match="is not UTF-8 text: invalid start byte"):
        MeasuredCostModel.from_json(path)


def test_cost_model_that_is_not_json_is_refused(tmp_path):
    path = tmp_path / "cost.json"
    path.write_text("{not json")
    with pytest.raises(CostModelError, match="is not JSON"):
        MeasuredCostModel.from_json(str(path))
