"""Batch-size histograms from CSV, from observed sizes and from Prometheus text."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from graphserving.planner.histogram import (
    BatchSizeHistogram,
    HistogramError,
    from_batch_sizes,
    load_csv,
    parse_csv,
    parse_prometheus_text,
    scrape_prometheus,
)


def test_csv_round_trip_sums_repeated_sizes_and_drops_zero_counts():
    histogram = parse_csv("batch_size,count\n4,2\n1,3\n4,5\n9,0\n")
    assert histogram.items() == [(1, 3.0), (4, 7.0)]
    assert parse_csv(histogram.to_csv()).items() == histogram.items()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty file"),
        ("size,count\n1,2\n", "header must be 'batch_size,count'"),
        ("batch_size,count\n1\n", "line 2: expected 2 columns"),
        ("batch_size,count\nx,2\n", "line 2: batch_size must be an integer, got 'x'"),
        ("batch_size,count\n0,2\n", "line 2: batch_size must be >= 1, got 0"),
        ("batch_size,count\n3,-1\n", "line 2: count must be >= 0, got -1"),
        ("batch_size,count\n3,lots\n", "line 2: count must be a number"),
    ],
)
def test_bad_csv_is_refused_with_the_line_and_value(text, message):
    with pytest.raises(HistogramError, match=message):
        parse_csv(text)


def test_from_batch_sizes_counts_occurrences():
    assert from_batch_sizes([3, 1, 3, 3]).items() == [(1, 1.0), (3, 3.0)]


def _exposition(observations: dict[str, list[int]], buckets: list[float]) -> str:
    registry = CollectorRegistry()
    metric = Histogram("graphserving_batch_size", "rows per pass", ["mode"], buckets=buckets, registry=registry)
    for mode, values in observations.items():
        for value in values:
            metric.labels(mode=mode).observe(value)
    return generate_latest(registry).decode()


def test_prometheus_cumulative_buckets_become_per_bucket_counts():
    text = _exposition({"full": [1, 1, 2, 3, 4, 4, 4, 7]}, [1, 2, 4, 8])
    histogram = parse_prometheus_text(text)
    # (0,1]: 2, (1,2]: 1, (2,4]: 4 attributed to 4, (4,8]: 1 attributed to 8.
    assert histogram.items() == [(1, 2.0), (2, 1.0), (4, 4.0), (8, 1.0)]
    assert histogram.overflow == 0.0


def test_prometheus_series_are_summed_unless_a_label_selects_one():
    text = _exposition({"full": [1, 2], "piecewise": [2, 2]}, [1, 2])
    assert parse_prometheus_text(text).items() == [(1, 1.0), (2, 3.0)]
    assert parse_prometheus_text(text, labels={"mode": "piecewise"}).items() == [(2, 2.0)]


def test_prometheus_observations_above_the_last_bound_are_overflow():
    text = _exposition({"full": [1, 300, 500]}, [1, 256])
    histogram = parse_prometheus_text(text, "graphserving_batch_size")
    assert histogram.items() == [(1, 1.0)]
    assert histogram.overflow == 2.0
    assert histogram.total == 3.0


def test_prometheus_fractional_bounds_go_to_their_largest_integer():
    text = _exposition({"full": [1, 2, 3]}, [0.5, 1.5, 2.5, 3.5])
    assert parse_prometheus_text(text).items() == [(1, 1.0), (2, 1.0), (3, 1.0)]


def test_prometheus_unknown_metric_names_the_histograms_present():
    text = _exposition({"full": [1]}, [1])
    with pytest.raises(HistogramError, match=r"no histogram named 'nope'.*graphserving_batch_size"):
        parse_prometheus_text(text, "nope")


def test_prometheus_label_filter_without_matches_is_an_error():
    text = _exposition({"full": [1]}, [1])
    with pytest.raises(HistogramError, match="no bucket series matching labels"):
        parse_prometheus_text(text, labels={"mode": "eager"})


@pytest.mark.parametrize(
    ("bucket", "shown"),
    [('le="NaN"', "{'le': 'NaN'}"), ('le="many"', "{'le': 'many'}"), ('mode="full"', "{'mode': 'full'}")],
)
def test_prometheus_bucket_without_a_numeric_le_is_refused(bucket, shown):
    # Before: ValueError "cannot convert float NaN to integer", ValueError from float(), KeyError 'le'.
    text = (
        "# TYPE graphserving_batch_size histogram\n"
        'graphserving_batch_size_bucket{le="1"} 2\n'
        f"graphserving_batch_size_bucket{{{bucket}}} 3\n"
    )
    with pytest.raises(HistogramError) as info:
        parse_prometheus_text(text)
    assert str(info.value) == (
        f"histogram 'graphserving_batch_size': bucket {shown} needs an 'le' label that is a number or +Inf"
    )


def test_scraping_an_invalid_url_is_a_histogram_error():
    # http.client.InvalidURL is a ValueError, not an OSError: it escaped as a traceback.
    with pytest.raises(HistogramError, match="cannot scrape 'http://127.0.0.1:port/metrics': nonnumeric port"):
        scrape_prometheus("http://127.0.0.1:port/metrics")


def test_csv_file_that_is_not_utf8_is_refused_and_a_byte_order_mark_is_skipped(tmp_path):
    bad = tmp_path / "latin1.csv"
    bad.write_bytes(b"batch_size,count\n1,3\xff\n")
    with pytest.raises(HistogramError, match=r"histogram file '.*latin1.csv' is not UTF-8 text: invalid start byte"):
        load_csv(bad)
    bom = tmp_path / "bom.csv"
    bom.write_bytes(b"\xef\xbb\xbfbatch_size,count\n1,3\n4,2\n")
    assert load_csv(bom).items() == [(1, 3.0), (4, 2.0)]


def test_histogram_refuses_invalid_sizes_and_counts():
    with pytest.raises(HistogramError, match="batch_size must be an integer >= 1"):
        BatchSizeHistogram({0: 1})
    with pytest.raises(HistogramError, match="count for batch_size 2 must be finite and >= 0"):
        BatchSizeHistogram({2: -1})
