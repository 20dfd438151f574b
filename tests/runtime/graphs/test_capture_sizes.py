"""Capture-size resolution: the scheduler maxima are always captured, nothing is truncated."""

import pytest

from graphserving.contract.graph_policy import (
    CaptureSizeError,
    default_capture_sizes,
    default_piecewise_capture_sizes,
    resolve_capture_sizes,
)


def test_default_grid_ends_at_an_off_grid_maximum():
    sizes = default_capture_sizes(100)
    assert sizes[:4] == [1, 2, 4, 8]
    assert sizes[-2:] == [96, 100]
    assert all(b > a for a, b in zip(sizes, sizes[1:]))


def test_default_grid_steps_by_16_above_256():
    assert default_capture_sizes(320)[-5:] == [248, 256, 272, 288, 304, 320][-5:]


def test_max_num_seqs_100_is_captured_by_default():
    assert 100 in resolve_capture_sizes(None, 100)


def test_explicit_list_with_off_grid_maximum_is_honoured_exactly():
    assert resolve_capture_sizes([1, 3, 7, 13], 13) == [1, 3, 7, 13]


def test_explicit_list_below_the_maximum_gets_the_maximum_appended():
    assert resolve_capture_sizes([1, 2, 4], 6) == [1, 2, 4, 6]


def test_explicit_size_above_the_maximum_is_rejected_naming_both_values():
    with pytest.raises(CaptureSizeError, match=r"capture size 64 exceeds max_num_seqs=32"):
        resolve_capture_sizes([1, 2, 64], 32)


@pytest.mark.parametrize("sizes", [[4, 2], [1, 1], [0, 2], []])
def test_malformed_lists_are_rejected(sizes):
    with pytest.raises(CaptureSizeError):
        resolve_capture_sizes(sizes, 8)


def test_piecewise_default_is_powers_of_two_then_the_maximum():
    assert default_piecewise_capture_sizes(300) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 300]
    assert default_piecewise_capture_sizes(256) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
