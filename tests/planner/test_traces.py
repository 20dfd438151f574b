"""Synthetic traces, CSV trace loading and the decode batch-size simulation."""

from __future__ import annotations

import statistics

import pytest

from graphserving.planner.traces import (
    StepTimeModel,
    TraceError,
    TraceRequest,
    load_csv_trace,
    parse_csv_trace,
    simulate_decode_batches,
    synthetic_trace,
    trace_to_csv,
)


def test_same_seed_gives_the_same_trace_and_another_seed_does_not():
    assert synthetic_trace(5.0, 50, seed=7) == synthetic_trace(5.0, 50, seed=7)
    assert synthetic_trace(5.0, 50, seed=7) != synthetic_trace(5.0, 50, seed=8)


def test_synthetic_trace_follows_its_distributions():
    trace = synthetic_trace(10.0, 4000, seed=1)
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(trace, trace[1:])]
    assert statistics.mean(gaps) == pytest.approx(0.1, rel=0.05)
    assert statistics.median(r.input_tokens for r in trace) == pytest.approx(256, rel=0.1)
    assert statistics.median(r.output_tokens for r in trace) == pytest.approx(128, rel=0.1)


def test_csv_trace_round_trips():
    trace = synthetic_trace(2.0, 20, seed=3)
    assert parse_csv_trace(trace_to_csv(trace)) == trace


def test_azure_style_trace_is_loaded_relative_to_the_first_arrival():
    text = (
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:47.0000000,10,3\n"
        "2023-11-16 18:15:46.5000000,20,4\n"
    )
    assert parse_csv_trace(text) == [TraceRequest(0.0, 20, 4), TraceRequest(0.5, 10, 3)]


def test_trace_without_an_output_column_names_the_expected_ones():
    with pytest.raises(TraceError, match="no output-token column"):
        parse_csv_trace("timestamp,input_tokens\n0,5\n")


def test_trace_with_zero_output_tokens_is_refused():
    with pytest.raises(TraceError, match="line 2: input tokens must be >= 0 and output tokens >= 1"):
        parse_csv_trace("timestamp,input_tokens,output_tokens\n0,5,0\n")


@pytest.mark.parametrize("stamp", ["nan", "NaN", "inf", "-inf"])
def test_trace_with_a_non_finite_timestamp_is_refused_by_line(stamp):
    # A NaN arrival is never "<= now": the simulation looped forever and the replay stopped with
    # "the scheduler scheduled nothing"; an infinite one put Infinity and NaN into the JSON report.
    text = f"timestamp,input_tokens,output_tokens\n0,5,2\n{stamp},5,2\n1,5,2\n"
    with pytest.raises(TraceError, match=f"line 3: timestamp must be a finite number, got '{stamp}'"):
        parse_csv_trace(text)


def test_trace_file_that_is_not_utf8_is_refused_and_a_byte_order_mark_is_skipped(tmp_path):
    bad = tmp_path / "latin1.csv"
    bad.write_bytes(b"timestamp,input_tokens,output_tokens\n0,5,2 \xe9\n")
    with pytest.raises(TraceError, match="is not UTF-8 text: invalid continuation byte at byte"):
        load_csv_trace(bad)
    bom = tmp_path / "bom.csv"
    bom.write_bytes(b"\xef\xbb\xbftimestamp,input_tokens,output_tokens\n0,5,2\n")
    assert load_csv_trace(bom) == [TraceRequest(0.0, 5, 2)]


def test_simulation_decodes_each_running_request_once_per_step():
    # Two requests arriving together: a prefill step, then both decode (4 and 2 more tokens).
    trace = [TraceRequest(0.0, 8, 5), TraceRequest(0.0, 8, 3)]
    assert simulate_decode_batches(trace) == [2, 2, 1, 1]


def test_simulation_never_exceeds_max_num_seqs():
    trace = [TraceRequest(0.0, 1, 4) for _ in range(5)]
    batches = simulate_decode_batches(trace, max_num_seqs=2, step_time=StepTimeModel())
    assert max(batches) == 2
    assert sum(batches) == 5 * 3  # every request decodes its 3 tokens after prefill


def test_shipped_traces_and_histograms_are_what_make_traces_writes(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[2] / "bench"
    subprocess.run([sys.executable, str(bench / "make_traces.py"), "--out", str(tmp_path)], check=True,
                   capture_output=True)
    for name in ("low", "moderate", "high"):
        for suffix in (".csv", ".hist.csv"):
            assert (tmp_path / f"{name}{suffix}").read_text() == (bench / "traces" / f"{name}{suffix}").read_text()
