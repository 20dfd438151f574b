"""Traffic weights follow measured capacity."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from graphserving.operator.routing import capacity_weights


def test_weights_are_proportional_to_capacity():
    assert capacity_weights({"old": 3000.0, "new": 1000.0}, "new") == {"old": 75, "new": 25}


def test_degraded_capacity_gets_its_smaller_share():
    assert capacity_weights({"a": 1000.0, "b": 1000.0, "c": 250.0}, "a") == {"a": 45, "b": 44, "c": 11}


def test_without_any_capacity_everything_goes_to_the_fallback():
    assert capacity_weights({"old": 0.0, "new": 0.0}, "new") == {"old": 0, "new": 100}


@given(st.dictionaries(st.text(min_size=1, max_size=4), st.floats(0, 1e6), min_size=1, max_size=6))
def test_weights_always_sum_to_100_and_miss_the_exact_share_by_less_than_one(capacity):
    fallback = sorted(capacity)[0]
    weights = capacity_weights(capacity, fallback)
    assert sum(weights.values()) == 100
    total = sum(capacity.values())
    if total > 0:
        for name, cap in capacity.items():
            assert abs(weights[name] - 100 * cap / total) < 1


def test_non_finite_or_huge_capacities_do_not_break_the_weights():
    from graphserving.operator.routing import capacity_weights

    assert capacity_weights({"a": float("inf"), "b": 1.0}, fallback="b") == {"a": 0, "b": 100}
    assert sum(capacity_weights({"a": 1e308, "b": 1e308}, fallback="a").values()) == 100
