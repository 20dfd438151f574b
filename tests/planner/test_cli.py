"""`graphserving plan-buckets` end to end through the real command entry point."""

from __future__ import annotations

import json

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from graphserving.cli import main


@pytest.fixture
def histogram_file(tmp_path):
    path = tmp_path / "hist.csv"
    path.write_text("batch_size,count\n1,10\n3,10\n5,1\n8,1\n")
    return str(path)


def run(capsys, *argv):
    code = main(["plan-buckets", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_json_output_has_the_chosen_capture_sizes(capsys, histogram_file):
    code, out, _ = run(capsys, "--histogram", histogram_file, "--max-graphs", "2", "--json")
    assert code == 0
    report = json.loads(out)
    assert report["capture_sizes"] == [3, 8]
    assert report["padded_rows"] == 10 * 2 + 3
    assert report["padding_ratio"] == pytest.approx(23 / (10 * 1 + 10 * 3 + 5 + 8))
    assert set(report["baselines"]) == {"vllm"}
    assert report["baselines"]["vllm"]["capture_sizes"] == [1, 2, 4, 8]


def test_without_a_budget_every_observed_size_is_captured(capsys, histogram_file):
    code, out, _ = run(capsys, "--histogram", histogram_file, "--json", "--baseline", "sglang")
    assert code == 0
    report = json.loads(out)
    assert report["capture_sizes"] == [1, 3, 5, 8]
    assert report["padded_rows"] == 0
    assert report["baselines"]["sglang"]["capture_sizes"] == [1, 2, 4, 8]


def test_maximum_above_the_histogram_is_captured(capsys, histogram_file):
    code, out, _ = run(capsys, "--histogram", histogram_file, "--max-graphs", "3", "--maximum", "64", "--json")
    assert code == 0
    assert json.loads(out)["capture_sizes"][-1] == 64


def test_memory_budget_accepts_quantities(capsys, histogram_file):
    # 2 MiB per row (analytic): 24Mi allows sizes summing to 12 rows, e.g. [3, 8] but not [1, 3, 5, 8].
    code, out, _ = run(capsys, "--histogram", histogram_file, "--max-graph-memory", "24Mi", "--json")
    assert code == 0
    report = json.loads(out)
    assert sum(report["capture_sizes"]) <= 12
    assert report["graph_memory_bytes"] <= 24 * 2**20


def test_table_output_and_plot(capsys, histogram_file, tmp_path):
    png = tmp_path / "plan.png"
    code, out, _ = run(capsys, "--histogram", histogram_file, "--max-graphs", "2", "--plot", str(png))
    assert code == 0
    assert out.startswith("capture sizes (2): [3, 8]")
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_plot_is_a_png_whatever_the_suffix(capsys, histogram_file, tmp_path):
    # Before: matplotlib picked the format from the suffix: ".txt" raised ValueError, ".pdf" wrote a PDF.
    for name in ("plan.txt", "plan.pdf"):
        path = tmp_path / name
        code, _, err = run(capsys, "--histogram", histogram_file, "--plot", str(path))
        assert (code, err) == (0, "")
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_into_a_missing_directory_exits_2(capsys, histogram_file, tmp_path):
    path = tmp_path / "absent" / "plan.png"
    code, out, err = run(capsys, "--histogram", histogram_file, "--json", "--plot", str(path))
    assert (code, out) == (2, "")
    assert err == f"plan-buckets: cannot write --plot {str(path)!r}: No such file or directory\n"


def test_prometheus_text_file_is_a_histogram_source(capsys, tmp_path):
    registry = CollectorRegistry()
    metric = Histogram("graphserving_batch_size", "rows", ["model_name"], buckets=[1, 2, 4, 8], registry=registry)
    for value in (1, 1, 2, 7):
        metric.labels(model_name="smollm2").observe(value)
    path = tmp_path / "metrics.txt"
    path.write_bytes(generate_latest(registry))
    code, out, _ = run(capsys, "--prometheus", str(path), "--label", "model_name=smollm2", "--json")
    assert code == 0
    assert json.loads(out)["capture_sizes"] == [1, 2, 8]


def test_trace_file_is_simulated_into_decode_batches(capsys, tmp_path):
    path = tmp_path / "trace.csv"
    path.write_text("timestamp,input_tokens,output_tokens\n0,8,5\n0,8,3\n")
    code, out, _ = run(capsys, "--trace", str(path), "--json")
    assert code == 0
    assert json.loads(out)["capture_sizes"] == [1, 2]


@pytest.mark.parametrize(
    ("content", "extra", "message"),
    [
        ("size,count\n1,2\n", [], "header must be 'batch_size,count'"),
        ("batch_size,count\n1,-4\n", [], "count must be >= 0, got -4"),
        ("batch_size,count\n1,4\n", ["--max-graphs", "0"], "--max-graphs must be >= 1"),
        ("batch_size,count\n1,4\n", ["--max-graph-memory", "lots"], "--max-graph-memory must be bytes"),
        ("batch_size,count\n1,4\n", ["--max-graph-memory", "1"], "budget too small"),
        ("batch_size,count\n1,4\n", ["--baseline", "trtllm"], "baseline must be"),
        ("batch_size,count\n1,4\n", ["--lambda", "inf", "--json"], "lambda must be a finite number >= 0, got inf"),
    ],
)
def test_bad_input_exits_2_with_one_line(capsys, tmp_path, content, extra, message):
    path = tmp_path / "hist.csv"
    path.write_text(content)
    code, out, err = run(capsys, "--histogram", str(path), *extra)
    assert code == 2
    assert out == ""
    assert message in err
    assert err.count("\n") == 1


def test_missing_histogram_file_exits_2(capsys, tmp_path):
    code, _, err = run(capsys, "--histogram", str(tmp_path / "absent.csv"))
    assert code == 2
    assert "cannot read histogram file" in err


def test_prometheus_text_file_that_is_not_utf8_exits_2(capsys, tmp_path):
    path = tmp_path / "metrics.txt"
    path.write_bytes(b"# TYPE graphserving_batch_size histogram\n\xff\n")
    code, out, err = run(capsys, "--prometheus", str(path))
    assert (code, out) == (2, "")
    assert err == f"plan-buckets: Prometheus text file {str(path)!r} is not UTF-8 text: invalid start byte at byte 41\n"
