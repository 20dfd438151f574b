"""The capture-size DP: exact, within budget, always capturing the maximum."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from graphserving.planner.cost_model import MIB, AnalyticCostModel
from graphserving.planner.histogram import BatchSizeHistogram
from graphserving.planner.optimize import Budget, PlanError, candidate_sizes, objective, plan_capture_sizes

MODEL = AnalyticCostModel()

histograms = st.dictionaries(
    st.integers(min_value=1, max_value=40), st.integers(min_value=1, max_value=20), min_size=1, max_size=7
).map(BatchSizeHistogram)


def brute_force(histogram, maximum, budget, lam):
    """Best objective over every subset of the candidates that contains the maximum."""
    sizes = candidate_sizes(histogram, maximum)
    best = None
    for r in range(len(sizes)):
        for subset in itertools.combinations(sizes[:-1], r):
            chosen = [*subset, maximum]
            if budget.max_graphs is not None and len(chosen) > budget.max_graphs:
                continue
            memory = sum(MODEL.graph_memory_bytes(c) for c in chosen)
            seconds = sum(MODEL.capture_seconds(c) for c in chosen)
            if budget.max_graph_memory_bytes is not None and memory > budget.max_graph_memory_bytes * (1 + 1e-9):
                continue
            if budget.max_capture_seconds is not None and seconds > budget.max_capture_seconds * (1 + 1e-9):
                continue
            value = objective(histogram, chosen, MODEL, lam)
            best = value if best is None else min(best, value)
    return best


budgets = st.builds(
    Budget,
    max_graphs=st.one_of(st.none(), st.integers(min_value=1, max_value=4)),
    max_graph_memory_bytes=st.one_of(st.none(), st.floats(min_value=40 * MIB, max_value=200 * MIB)),
    max_capture_seconds=st.one_of(st.none(), st.floats(min_value=0.2, max_value=0.8)),
)


@settings(max_examples=150, deadline=None)
@given(histograms, budgets, st.sampled_from([0.0, 0.5, 5.0]), st.integers(min_value=0, max_value=5))
def test_dp_objective_equals_brute_force_on_small_instances(histogram, budget, lam, headroom):
    maximum = histogram.max_size + headroom
    expected = brute_force(histogram, maximum, budget, lam)
    if expected is None:
        with pytest.raises(PlanError, match="budget too small"):
            plan_capture_sizes(histogram, MODEL, budget=budget, lam=lam, maximum=maximum)
        return
    plan = plan_capture_sizes(histogram, MODEL, budget=budget, lam=lam, maximum=maximum)
    assert plan.objective == pytest.approx(expected, rel=1e-9, abs=1e-12)
    assert objective(histogram, plan.capture_sizes, MODEL, lam) == pytest.approx(plan.objective, rel=1e-9)


@settings(max_examples=100, deadline=None)
@given(histograms, budgets)
def test_plan_respects_the_budget_and_always_ends_at_the_maximum(histogram, budget):
    try:
        plan = plan_capture_sizes(histogram, MODEL, budget=budget)
    except PlanError:
        return
    assert plan.capture_sizes[-1] == histogram.max_size
    assert plan.capture_sizes == sorted(set(plan.capture_sizes))
    if budget.max_graphs is not None:
        assert len(plan.capture_sizes) <= budget.max_graphs
    if budget.max_graph_memory_bytes is not None:
        used = sum(MODEL.graph_memory_bytes(c) for c in plan.capture_sizes)
        assert used <= budget.max_graph_memory_bytes * (1 + 1e-9)


@settings(max_examples=100, deadline=None)
@given(histograms, st.integers(min_value=1, max_value=6), st.floats(min_value=40 * MIB, max_value=200 * MIB))
def test_objective_never_gets_worse_when_the_budget_grows(histogram, graphs, memory):
    small = Budget(max_graphs=graphs, max_graph_memory_bytes=memory)
    larger = [
        Budget(max_graphs=graphs + 1, max_graph_memory_bytes=memory),
        Budget(max_graphs=graphs, max_graph_memory_bytes=memory * 1.5),
        Budget(max_graphs=None, max_graph_memory_bytes=None),
    ]
    try:
        base = plan_capture_sizes(histogram, MODEL, budget=small).objective
    except PlanError:
        return
    for budget in larger:
        assert plan_capture_sizes(histogram, MODEL, budget=budget).objective <= base * (1 + 1e-12)


@settings(max_examples=100, deadline=None)
@given(histograms)
def test_with_lambda_zero_and_no_budget_every_observed_size_is_captured(histogram):
    plan = plan_capture_sizes(histogram, MODEL)
    assert plan.capture_sizes == histogram.sizes


@settings(max_examples=50, deadline=None)
@given(histograms, st.integers(min_value=1, max_value=30))
def test_the_maximum_is_always_captured_even_when_nothing_reaches_it(histogram, headroom):
    maximum = histogram.max_size + headroom
    plan = plan_capture_sizes(histogram, MODEL, budget=Budget(max_graphs=1), maximum=maximum)
    assert plan.capture_sizes == [maximum]


def test_one_graph_budget_pads_everything_to_the_maximum():
    histogram = BatchSizeHistogram({1: 3, 4: 1})
    plan = plan_capture_sizes(histogram, MODEL, budget=Budget(max_graphs=1))
    assert plan.capture_sizes == [4]
    assert plan.objective == pytest.approx(4.0)  # every batch computes 4 rows


def test_two_graphs_go_where_the_mass_is():
    # 1: 10 batches, 2: 1 batch, 3: 10 batches, 8: 1 batch.
    histogram = BatchSizeHistogram({1: 10, 2: 1, 3: 10, 8: 1})
    plan = plan_capture_sizes(histogram, MODEL, budget=Budget(max_graphs=2))
    assert plan.capture_sizes == [3, 8]
    assert plan.objective == pytest.approx((21 * 3 + 8) / 22)


def test_batches_above_the_maximum_are_eager_and_do_not_change_the_choice():
    histogram = BatchSizeHistogram({1: 4, 2: 4, 100: 2})
    plan = plan_capture_sizes(histogram, MODEL, maximum=8)
    assert plan.capture_sizes == [1, 2, 8]
    assert plan.objective == pytest.approx((4 * 1 + 4 * 2 + 2 * 100) / 10)


def test_lambda_trades_graphs_for_padding():
    histogram = BatchSizeHistogram({1: 1, 2: 1, 3: 1, 4: 1})
    assert plan_capture_sizes(histogram, MODEL, lam=0.0).capture_sizes == [1, 2, 3, 4]
    # A graph of size c costs lam * c * 2 MiB / GiB; at lam = 1024 that is 2c row-times, more than
    # the padding any smaller graph saves.
    assert plan_capture_sizes(histogram, MODEL, lam=1024.0).capture_sizes == [4]


def test_memory_budget_that_binds_uses_the_exact_budgeted_method():
    histogram = BatchSizeHistogram({s: 1 for s in range(1, 33)})
    budget = Budget(max_graphs=8, max_graph_memory_bytes=60 * 2 * MIB)
    plan = plan_capture_sizes(histogram, MODEL, budget=budget)
    assert plan.method == "dp-pareto"
    assert sum(plan.capture_sizes) <= 60
    assert plan.capture_sizes[-1] == 32


def test_errors_name_the_problem():
    histogram = BatchSizeHistogram({4: 1})
    with pytest.raises(PlanError, match="max_graphs must be >= 1"):
        Budget(max_graphs=0)
    with pytest.raises(PlanError, match="lambda must be a finite number >= 0, got -1.0"):
        plan_capture_sizes(histogram, MODEL, lam=-1.0)
    # An infinite λ gave objective inf for every list (and NaN with a zero-memory graph).
    with pytest.raises(PlanError, match="lambda must be a finite number >= 0, got inf"):
        plan_capture_sizes(histogram, MODEL, lam=float("inf"))
    with pytest.raises(PlanError, match="budget too small"):
        plan_capture_sizes(histogram, MODEL, budget=Budget(max_graph_memory_bytes=1 * MIB))
    with pytest.raises(PlanError, match="histogram is empty"):
        plan_capture_sizes(BatchSizeHistogram({}), MODEL)
