"""Evaluating capture-size lists: padding ratio, hit shares, baselines."""

from __future__ import annotations

import pytest

from graphserving.contract.graph_policy import default_capture_sizes
from graphserving.planner.cost_model import AnalyticCostModel
from graphserving.planner.histogram import BatchSizeHistogram
from graphserving.planner.optimize import plan_capture_sizes
from graphserving.planner.report import BaselineError, baseline_sizes, evaluate, format_table, plan_report, plot

MODEL = AnalyticCostModel()


def test_padding_ratio_is_padded_rows_per_real_row_of_graph_batches():
    # 3 batches of 1 and 1 of 3 in graph 4; 2 batches of 10 run eagerly above the maximum.
    histogram = BatchSizeHistogram({1: 3, 3: 1, 10: 2})
    result = evaluate(histogram, [4], MODEL)
    assert result.padded_rows == 3 * 3 + 1 * 1
    assert result.real_rows == 3 * 1 + 1 * 3
    assert result.padding_ratio == pytest.approx(10 / 6)
    assert result.padded_rows_per_step == pytest.approx(10 / 4)
    assert result.fallback_batches == 2
    assert result.fallback_share == pytest.approx(2 / 6)


def test_hit_shares_count_every_batch_including_fallbacks():
    histogram = BatchSizeHistogram({1: 2, 2: 1, 5: 1}, overflow=1)
    result = evaluate(histogram, [1, 4], MODEL)
    assert [(b.capture_size, b.hit_share) for b in result.buckets] == [(1, 0.4), (4, 0.2)]
    assert result.fallback_share == pytest.approx(0.4)


def test_expected_step_time_mixes_graph_and_eager_batches():
    histogram = BatchSizeHistogram({1: 1, 3: 1, 6: 2})
    # 1 -> graph 4, 3 -> graph 4, 6 -> eager 6 rows: (4 + 4 + 12) / 4.
    assert evaluate(histogram, [4], MODEL).expected_step_time == pytest.approx(5.0)


def test_named_baselines_use_the_same_maximum():
    assert baseline_sizes("vllm", 20) == ("vllm", default_capture_sizes(20))
    assert baseline_sizes("sglang", 20) == ("sglang", [1, 2, 4, 8, 12, 16, 20])
    assert baseline_sizes("1,8,64", 32) == ("1,8,64", [1, 8, 32])
    with pytest.raises(BaselineError, match="'vllm', 'sglang' or comma-separated integers"):
        baseline_sizes("trtllm", 32)


def test_report_compares_padded_rows_with_each_baseline():
    histogram = BatchSizeHistogram({3: 10, 16: 1})
    plan = plan_capture_sizes(histogram, MODEL)
    report = plan_report(plan, histogram, MODEL, [("vllm", [1, 2, 4, 8, 16])])
    assert report["capture_sizes"] == [3, 16]
    assert report["padded_rows"] == 0
    vllm = report["baselines"]["vllm"]
    assert vllm["padded_rows"] == 10  # every batch of 3 pads to 4
    assert vllm["padded_rows_reduction"] == pytest.approx(1.0)
    assert report["hit_shares"] == {"3": pytest.approx(10 / 11), "16": pytest.approx(1 / 11)}
    assert "vllm" in format_table(report)


def test_plot_writes_a_png(tmp_path):
    histogram = BatchSizeHistogram({1: 5, 7: 2, 30: 1})
    plan = plan_capture_sizes(histogram, MODEL)
    report = plan_report(plan, histogram, MODEL, [("vllm", default_capture_sizes(30))])
    out = tmp_path / "plan.png"
    plot(histogram, report, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
