"""bench/serve.py: its load and summary logic, and a real run against a spawned CPU worker."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from graphserving.planner.traces import TraceRequest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "serve.py"


@pytest.fixture(scope="module")
def serve():
    spec = importlib.util.spec_from_file_location("serve_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["serve_bench"] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


TRACE = [TraceRequest(0.0, 8, 6), TraceRequest(1.0, 12, 5), TraceRequest(2.0, 5, 7), TraceRequest(4.0, 20, 4)]


def test_rate_scale_divides_the_trace_arrival_times(serve):
    workload = serve.build_workload(TRACE, num_requests=4, duration_s=100, rate_scale=2.0)
    assert [r.send_at_s for r in workload] == [0.0, 0.5, 1.0, 2.0]
    assert [len(r.prompt) for r in workload] == [8, 12, 5, 20]
    assert [r.max_tokens for r in workload] == [6, 5, 7, 4]


def test_requests_after_the_duration_are_not_sent(serve):
    workload = serve.build_workload(TRACE, num_requests=4, duration_s=1.5)
    assert [r.index for r in workload] == [0, 1]


def test_lengths_are_cut_to_fit_the_context(serve):
    workload = serve.build_workload(TRACE, num_requests=4, duration_s=100, max_model_len=10, max_output_tokens=6)
    assert [(len(r.prompt), r.max_tokens) for r in workload] == [(4, 6), (5, 5), (4, 6), (6, 4)]


def test_poisson_arrivals_are_seeded_and_start_at_zero(serve):
    a = serve.build_workload(TRACE, num_requests=4, duration_s=1e6, rate=2.0, seed=7)
    b = serve.build_workload(TRACE, num_requests=4, duration_s=1e6, rate=2.0, seed=7)
    assert [r.send_at_s for r in a] == [r.send_at_s for r in b]
    assert a[0].send_at_s == 0.0 and all(x.send_at_s < y.send_at_s for x, y in zip(a, a[1:]))


def test_goodput_counts_requests_meeting_both_slos(serve):
    R = serve.RequestResult
    results = [
        R(0, True, 0.0, ttft_s=0.1, e2e_s=1.0, tpot_s=0.01, output_tokens=10, requested_tokens=10),
        R(1, True, 0.0, ttft_s=0.3, e2e_s=1.0, tpot_s=0.01, output_tokens=10, requested_tokens=10),  # TTFT miss
        R(2, True, 0.0, ttft_s=0.1, e2e_s=1.0, tpot_s=0.05, output_tokens=10, requested_tokens=10),  # TPOT miss
        R(3, True, 0.0, ttft_s=0.1, e2e_s=0.1, tpot_s=None, output_tokens=1, requested_tokens=1),  # TTFT only
        R(4, False, 0.0, error="HTTP 500: boom"),
    ]
    summary = serve.summarize(results, 2.0, slo_ttft_s=0.2, slo_tpot_s=0.02)
    assert summary["completed"] == 4 and summary["failed"] == 1
    assert summary["good_requests"] == 2
    assert summary["goodput_rps"] == 1.0
    assert summary["output_throughput_tps"] == 31 / 2.0
    assert summary["errors"] == {"HTTP 500: boom": 1}


def test_worker_metrics_are_differences_between_scrapes(serve):
    before = serve.parse_metrics(
        'graphserving_graph_passes_total{model_name="m",mode="full",key="full-t4-r4",reason=""} 2\n'
        'graphserving_graph_real_rows_total{model_name="m"} 6\n'
        'graphserving_graph_padded_rows_total{model_name="m"} 2\n'
    )
    after = serve.parse_metrics(
        'graphserving_graph_passes_total{model_name="m",mode="full",key="full-t4-r4",reason=""} 5\n'
        'graphserving_graph_passes_total{model_name="m",mode="eager",key="",reason="too_many_tokens"} 1\n'
        'graphserving_graph_real_rows_total{model_name="m"} 15\n'
        'graphserving_graph_padded_rows_total{model_name="m"} 5\n'
    )
    delta = serve.metrics_delta(before, after)
    assert delta["passes"] == {"full": 3, "piecewise": 0, "eager": 1}
    assert delta["bucket_hits"] == {"full-t4-r4": 3}
    assert delta["fallback_reasons"] == {"too_many_tokens": 1}
    assert (delta["real_rows"], delta["padded_rows"]) == (9, 3)
    assert delta["padding_ratio"] == pytest.approx(1 / 3)


def test_only_loopback_urls_are_accepted(serve):
    assert serve.check_loopback("http://127.0.0.1:8000/") == "http://127.0.0.1:8000"
    with pytest.raises(serve.BenchError, match="loopback"):
        serve.check_loopback("http://10.0.0.1:8000")


@pytest.mark.slow
def test_spawned_cpu_worker_serves_the_whole_trace(tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text("timestamp,input_tokens,output_tokens\n0,8,6\n0.2,12,5\n0.4,5,7\n0.5,20,4\n")
    out = tmp_path / "serve.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--spawn", "--graph-mode", "NONE", "--trace", str(trace), "--num-requests", "4",
         "--max-num-seqs", "4", "--num-kv-blocks", "64", "--max-model-len", "256", "--startup-timeout-s", "600",
         "--json-out", str(out), "--log-dir", str(tmp_path / "logs")],
        capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    column = json.loads(out.read_text())["columns"]["worker"]
    client, worker = column["client"], column["worker"]
    assert client["completed"] == 4 and client["failed"] == 0
    assert client["exact_output_length"] == 4  # ignore_eos: exactly the trace's output lengths
    assert client["output_tokens"] == 6 + 5 + 7 + 4
    assert client["prompt_tokens"] == 8 + 12 + 5 + 20
    assert 0 < client["ttft_s"]["p99"] <= client["e2e_s"]["p99"]
    assert client["ttft_s"]["p50"] <= client["e2e_s"]["p50"]
    assert client["tpot_s"]["p50"] > 0
    assert worker["generation_tokens"] == 22
    assert worker["passes"]["eager"] == worker["steps"] > 0
    assert worker["fallback_reasons"] == {"mode_none": worker["steps"]}
    assert column["graphs"]["phase"] == "Ready" and column["graphs"]["mode"] == "NONE"
    assert "TPOT p50 ms" in proc.stdout


@pytest.mark.slow
def test_throughput_against_a_spawned_cpu_worker_reports_tokens_and_costs_per_request(tmp_path):
    out = tmp_path / "throughput.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--spawn", "--throughput", "--no-peer", "--graph-mode", "NONE",
         "--concurrency", "3", "--prompt-tokens", "4", "--new-tokens", "3", "--repeats", "2",
         "--num-kv-blocks", "64", "--max-model-len", "256", "--startup-timeout-s", "600",
         "--json-out", str(out), "--log-dir", str(tmp_path / "logs")],
        capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = {r["sequences"]: r for r in json.loads(out.read_text())["worker"]}
    assert sorted(rows) == [1, 3]
    assert rows[3]["output_tokens"] == 9 and rows[1]["output_tokens"] == 3  # ignore_eos: exactly new_tokens each
    expected_client = "aiohttp" if importlib.util.find_spec("aiohttp") else "httpx"
    for row in rows.values():
        assert row["client"] == expected_client
        assert len(row["all_tokens_per_s"]) == 2 and row["tokens_per_s"] == max(row["all_tokens_per_s"])
        assert row["client_cpu_ms_per_request"] > 0
        assert row["forward_passes_per_run"] >= 3  # the prefill, then one pass per further token
        if sys.platform == "linux":
            assert 0 <= row["worker_loop_cpu_ms_per_request"] <= row["worker_cpu_ms_per_request"]
    assert "per request: client CPU" in proc.stdout


def test_fixed_prompts_are_seeded_and_inside_the_token_range(serve):
    a = serve.fixed_prompts(4, 7, seed=3, token_range=(100, 110))
    assert a == serve.fixed_prompts(4, 7, seed=3, token_range=(100, 110))
    assert [len(p) for p in a] == [7] * 4 and all(100 <= t < 110 for p in a for t in p)


def test_a_worker_report_with_measured_full_keys_becomes_a_cost_model(serve):
    report = {"keys": [
        {"kind": "FULL", "size": 8, "captured": True, "decodeStepSeconds": 0.004, "memoryBytes": 800,
         "captureSeconds": 0.3},
        {"kind": "FULL", "size": 1, "captured": True, "decodeStepSeconds": 0.002, "memoryBytes": 100},
        {"kind": "FULL", "size": 4, "captured": False},
        {"kind": "PIECEWISE", "size": 64, "captured": True, "decodeStepSeconds": None},
    ]}
    model = serve.cost_model_from_report(report)
    assert model.step_time(3, 8) == 0.004
    assert model.step_time(1, 1) == 0.002
    assert model.graph_memory_bytes(8) == 800
    assert serve.cost_model_from_report({"keys": [{"kind": "FULL", "size": 1, "captured": True}]}) is None


def test_a_worker_that_cannot_start_is_reported_in_its_column(tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text("timestamp,input_tokens,output_tokens\n0,8,6\n")
    out = tmp_path / "serve.json"
    missing = tmp_path / "missing.gguf"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--spawn", "--model", str(missing), "--trace", str(trace),
         "--json-out", str(out), "--log-dir", str(tmp_path / "logs")],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 1
    column = json.loads(out.read_text())["columns"]["worker"]
    assert "exited with status 1" in column["error"] and "does not exist" in column["error"]
