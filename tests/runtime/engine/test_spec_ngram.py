"""Prompt-lookup drafting: the longest earlier match of the context's suffix, its continuation."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphserving.runtime.engine.spec_decode.drafter import PAD_DRAFT, DraftRequest
from graphserving.runtime.engine.spec_decode.ngram import DEFAULT_MAX_N, DEFAULT_MIN_N, NgramDrafter, propose_ngram


def reference(context: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The rule written out with loops: longest suffix first, its most recent earlier occurrence
    (followed by a token), the continuation extended by its own drafts."""
    if k == 0:
        return []
    for n in range(max_n, min_n - 1, -1):
        if n >= len(context):
            continue
        suffix = context[-n:]
        starts = [i for i in range(len(context) - n) if context[i:i + n] == suffix]
        if starts:
            extended = list(context)
            for i in range(k):
                extended.append(extended[starts[-1] + n + i])
            return extended[len(context):]
    return []


def test_the_continuation_of_an_earlier_copy_is_proposed():
    assert propose_ngram([1, 2, 3, 4, 5, 9, 1, 2, 3], 2) == [4, 5]


def test_a_longer_match_wins_over_a_more_recent_shorter_one():
    # suffix (7, 8, 9) occurs at the start; (8, 9) alone occurs later, followed by 5
    assert propose_ngram([7, 8, 9, 1, 2, 8, 9, 5, 7, 8, 9], 2) == [1, 2]


def test_among_equal_matches_the_most_recent_wins():
    assert propose_ngram([4, 5, 1, 4, 5, 2, 4, 5], 1, max_n=2) == [2]


def test_a_match_near_the_end_repeats_its_period():
    assert propose_ngram([3, 1, 2, 1, 2], 5) == [1, 2, 1, 2, 1]


def test_no_earlier_occurrence_gives_no_drafts():
    assert propose_ngram([1, 2, 3, 4], 3) == []
    assert propose_ngram([], 3) == [] and propose_ngram([6], 3) == []


def test_min_n_ignores_shorter_matches():
    context = [1, 2, 3, 9, 3]  # only a 1-token match: (3) at position 2
    assert propose_ngram(context, 2, min_n=1) == [9, 3]
    assert propose_ngram(context, 2, min_n=2) == []


def test_k_zero_proposes_nothing():
    assert propose_ngram([1, 1, 1], 0) == []


@pytest.mark.parametrize("args", [dict(min_n=0), dict(min_n=3, max_n=2), dict(k=-1)])
def test_bad_lengths_are_refused(args):
    with pytest.raises(ValueError):
        propose_ngram([1, 2, 1], **{"k": 2, **args})


def test_defaults_are_documented_choices():
    assert (DEFAULT_MIN_N, DEFAULT_MAX_N) == (1, 3)


contexts = st.lists(st.integers(0, 4), max_size=40)


@settings(max_examples=400, deadline=None)
@given(contexts, st.integers(0, 8), st.integers(1, 4), st.integers(0, 3))
def test_equals_the_rule_written_out(context, k, min_n, extra):
    max_n = min_n + extra
    assert propose_ngram(context, k, min_n, max_n) == reference(context, k, min_n, max_n)


@settings(max_examples=300, deadline=None)
@given(contexts, st.integers(1, 8))
def test_drafts_are_all_or_nothing_and_continue_an_earlier_occurrence(context, k):
    drafts = propose_ngram(context, k)
    assert len(drafts) in (0, k)
    matches = [n for n in range(1, 4) if n < len(context)
               and any(context[i:i + n] == context[-n:] for i in range(len(context) - n))]
    assert bool(drafts) == bool(matches)
    if drafts:
        n = max(matches)  # the longest suffix that occurs earlier decides
        starts = [i for i in range(len(context) - n) if context[i:i + n] == context[-n:]]
        assert drafts[0] == context[starts[-1] + n]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=6), st.integers(2, 5), st.integers(1, 8))
def test_a_repeated_pattern_is_continued_exactly(pattern, repeats, k):
    period = len(pattern)
    context = pattern * repeats
    drafts = propose_ngram(context, k, max_n=3)
    if period == 1 or len(set(pattern)) == period:  # distinct tokens: the period is the pattern
        assert drafts == [context[(len(context) + i) % period] for i in range(k)]


def test_the_drafter_pads_to_k_and_respects_max_drafts():
    drafter = NgramDrafter(3)
    requests = [DraftRequest([1, 2, 3, 1, 2], 3), DraftRequest([1, 2, 3, 1, 2], 1), DraftRequest([1, 2, 3, 1, 2], 0),
                DraftRequest([1, 2, 3], 3)]
    proposal = drafter.propose(requests, "cpu")
    assert proposal.token_ids.tolist() == [[3, 1, 2], [3, PAD_DRAFT, PAD_DRAFT], [PAD_DRAFT] * 3, [PAD_DRAFT] * 3]
    assert proposal.num_drafts.tolist() == [3, 1, 0, 0]
    assert proposal.probs is None and proposal.token_ids.dtype == torch.int64
    assert proposal.num_speculative_tokens == 3


@pytest.mark.parametrize("k", [0, 9])
def test_k_outside_1_to_8_is_refused(k):
    with pytest.raises(ValueError, match="1..8"):
        NgramDrafter(k)
