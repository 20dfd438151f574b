"""Acceptance counts: proposed, accepted and emitted tokens, per draft position."""

import pytest

from graphserving.runtime.engine.spec_decode.acceptance import AcceptanceStats


def test_counts_and_rates_per_position():
    stats = AcceptanceStats(3)
    stats.observe([3, 3, 2, 0], [3, 1, 0, 0])
    assert (stats.verifications, stats.proposed_tokens, stats.accepted_tokens, stats.emitted_tokens) == (4, 8, 4, 8)
    assert stats.proposed_per_position == [3, 3, 2]
    assert stats.accepted_per_position == [2, 1, 1]
    assert stats.acceptance_rate == 0.5
    assert stats.acceptance_rate_per_position == [2 / 3, 1 / 3, 0.5]
    assert stats.mean_acceptance_length == 2.0


def test_rates_are_none_before_anything_was_proposed():
    stats = AcceptanceStats(2)
    assert stats.acceptance_rate is None and stats.mean_acceptance_length is None
    stats.observe([0], [0])
    assert stats.acceptance_rate is None and stats.acceptance_rate_per_position == [None, None]
    assert stats.mean_acceptance_length == 1.0


def test_steps_accumulate():
    stats = AcceptanceStats(2)
    stats.observe([2], [2])
    stats.observe([2, 1], [0, 1])
    assert stats.to_json() == {
        "num_speculative_tokens": 2, "verifications": 3, "proposed_tokens": 5, "accepted_tokens": 3,
        "emitted_tokens": 6, "acceptance_rate": 0.6, "acceptance_rate_per_position": [2 / 3, 0.5],
        "mean_acceptance_length": 2.0,
    }


@pytest.mark.parametrize("drafts,accepted", [([2], [3]), ([4], [0]), ([1], [-1]), ([1, 1], [1])])
def test_impossible_counts_are_refused(drafts, accepted):
    with pytest.raises(ValueError):
        AcceptanceStats(3).observe(drafts, accepted)
