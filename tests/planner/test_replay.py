"""Trace replay through the real scheduler, block manager and dispatch(), on a simulated clock."""

from __future__ import annotations

import json

import pytest

from graphserving.cli import main
from graphserving.contract.graph_policy import GraphMode
from graphserving.planner.cost_model import AnalyticCostModel
from graphserving.planner.replay import (
    AnalyticStepCost,
    ReplayError,
    compare,
    make_config,
    planned_capture_sizes,
    replay_trace,
)
from graphserving.planner.traces import TraceRequest, trace_to_csv

COST = AnalyticStepCost()  # 8 ms + 20 us per computed row


def step(rows: int) -> float:
    return COST.base_s + COST.row_s * rows


def three_at_once(prompt: int = 4, output: int = 3) -> list[TraceRequest]:
    return [TraceRequest(0.0, prompt, output) for _ in range(3)]


def small(trace, **kw):
    kw.setdefault("max_num_seqs", 8)
    kw.setdefault("max_num_batched_tokens", 64)
    return make_config(trace, **kw)


def test_three_simultaneous_requests_decode_as_three_padded_to_four_with_the_vllm_list():
    result = replay_trace(three_at_once(), small(three_at_once())).to_json()
    assert result["config"]["capture_sizes"] == [1, 2, 4, 8]
    # Step 1 prefills 3 x 4 tokens (piecewise 12 -> 16); steps 2 and 3 decode 3 rows (full 3 -> 4).
    assert result["steps"] == 3
    assert result["decode_batch_sizes"] == {"3": 2}
    assert result["bucket_hits"]["full-t4-r4"] == {"key": "full-t4-r4", "mode": "full", "passes": 2,
                                                   "real_rows": 6, "padded_rows": 2}
    assert result["bucket_hits"]["piecewise-t16"]["passes"] == 1
    assert result["bucket_hits"]["piecewise-t16"]["padded_rows"] == 4
    assert result["passes"] == {"eager": 0, "full": 2, "piecewise": 1}
    assert result["padded_rows"] == 6 and result["real_rows"] == 18
    assert result["padding_ratio"] == pytest.approx(6 / 18)
    assert result["requests"] == {"total": 3, "completed": 3, "prompt_tokens": 12, "output_tokens": 9,
                                  "preemptions": 0}


def test_simulated_latencies_follow_the_step_costs():
    result = replay_trace(three_at_once(), small(three_at_once())).to_json()
    prefill, decode = step(16), step(4)
    assert result["ttft_s"]["p50"] == pytest.approx(prefill)
    assert result["tpot_s"]["p50"] == pytest.approx(decode)
    assert result["e2e_s"]["p99"] == pytest.approx(prefill + 2 * decode)
    assert result["simulated_seconds"] == pytest.approx(prefill + 2 * decode)
    assert result["iteration_s"]["p50"] == pytest.approx(decode)


def test_requests_arrive_by_the_trace_clock():
    trace = [TraceRequest(0.0, 4, 2), TraceRequest(1.0, 4, 2)]
    result = replay_trace(trace, small(trace)).to_json()
    # Each request runs alone: the second arrives after the first finished; the clock jumps to it.
    assert result["decode_batch_sizes"] == {"1": 2}
    assert result["ttft_s"]["p99"] == pytest.approx(step(4))
    assert result["simulated_seconds"] == pytest.approx(1.0 + step(4) + step(1))


def test_full_only_mode_runs_prefill_eagerly_with_its_reason():
    cfg = small(three_at_once(), mode=GraphMode.FULL)
    result = replay_trace(three_at_once(), cfg).to_json()
    assert result["passes"] == {"eager": 1, "full": 2, "piecewise": 0}
    assert result["fallback_reasons"] == {"not_uniform_decode": 1}
    assert result["eager_rows"] == 12
    assert result["ttft_s"]["p50"] == pytest.approx(step(12))  # eager: no padding


def test_mode_none_runs_everything_eagerly():
    result = replay_trace(three_at_once(), small(three_at_once(), mode=GraphMode.NONE)).to_json()
    assert result["passes"] == {"eager": 3, "full": 0, "piecewise": 0}
    assert result["fallback_reasons"] == {"mode_none": 3}
    assert result["padded_rows"] == 0 and result["bucket_hits"] == {}
    assert result["graph_memory_bytes"]["total"] == 0


def test_long_prompts_are_chunked_by_the_token_budget():
    trace = [TraceRequest(0.0, 40, 2)]
    result = replay_trace(trace, small(trace, max_num_batched_tokens=16)).to_json()
    # Prompt chunks of 16, 16 and 8 tokens (piecewise 16, 16, 8), then one decode.
    hits = {k: h["passes"] for k, h in result["bucket_hits"].items()}
    assert hits == {"full-t1-r1": 1, "piecewise-t8": 1, "piecewise-t16": 2}
    assert result["ttft_s"]["p50"] == pytest.approx(2 * step(16) + step(8))


def test_a_small_kv_cache_preempts_and_still_completes_every_request():
    trace = [TraceRequest(0.0, 4, 5), TraceRequest(0.0, 4, 5)]
    # 3 usable blocks of 4 tokens: two sequences of up to 9 tokens cannot both stay resident.
    result = replay_trace(trace, small(trace, block_size=4, num_kv_blocks=4)).to_json()
    # Step 1 prefills both (one block each). Step 2: the second needs a new block, none is free,
    # so it (the youngest) is preempted; the first decodes alone through step 5. Step 6 prefills
    # the second again (prompt + its first output: 5 tokens), steps 7-9 decode it.
    assert result["requests"]["completed"] == 2
    assert result["requests"]["output_tokens"] == 10
    assert result["requests"]["preemptions"] == 1
    assert result["steps"] == 9
    assert {k: h["passes"] for k, h in result["bucket_hits"].items()} == {"full-t1-r1": 7, "piecewise-t8": 2}


def test_a_request_that_never_fits_is_refused_by_name():
    trace = [TraceRequest(0.0, 4, 2), TraceRequest(0.5, 100, 10)]
    with pytest.raises(ReplayError, match="trace request 1 .*100 prompt"):
        replay_trace(trace, small(trace, num_kv_blocks=4))


def test_a_cost_model_in_rows_is_refused():
    with pytest.raises(ReplayError, match="seconds"):
        replay_trace(three_at_once(), small(three_at_once()), AnalyticCostModel())


def test_the_planner_list_captures_the_observed_decode_size():
    results = compare(three_at_once(), ["vllm", "auto"], max_num_seqs=8, max_num_batched_tokens=64)
    vllm, auto = results["vllm"].to_json(), results["auto"].to_json()
    assert auto["config"]["capture_sizes"] == [3, 8]
    assert auto["bucket_hits"]["full-t3-r3"]["passes"] == 2
    assert auto["padded_rows_by_mode"]["full"] == 0
    assert vllm["padded_rows_by_mode"]["full"] == 2
    assert auto["config"]["num_full_graphs"] <= vllm["config"]["num_full_graphs"]


def test_planned_sizes_stay_within_the_baseline_graph_budget():
    from collections import Counter

    cfg = small(three_at_once(), max_num_seqs=16)  # vLLM list [1, 2, 4, 8, 16]
    sizes = planned_capture_sizes(Counter({1: 5, 3: 5, 5: 5, 7: 5, 9: 5, 11: 5, 13: 5}), cfg, COST)
    assert len(sizes) <= 5 and sizes[-1] == 16
    assert sum(sizes) <= sum(cfg.capture_sizes)  # analytic memory is proportional to rows


def test_a_measured_cost_model_sets_the_step_times(tmp_path):
    path = tmp_path / "cost.json"
    path.write_text(json.dumps({"schema": "graphserving.cost-model/v1", "sizes": [
        {"capture_size": 4, "step_seconds": 0.002, "graph_memory_bytes": 1000, "capture_seconds": 0.1},
        {"capture_size": 16, "step_seconds": 0.005, "graph_memory_bytes": 4000, "capture_seconds": 0.2},
    ]}))
    trace_file = tmp_path / "trace.csv"
    trace_file.write_text(trace_to_csv(three_at_once()))
    out = _cli(["--trace", str(trace_file), "--max-num-seqs", "8", "--max-num-batched-tokens", "64",
                "--cost-model", str(path), "--json"])
    report = json.loads(out)
    assert report["tpot_s"]["p50"] == pytest.approx(0.002)  # full-t4-r4
    assert report["ttft_s"]["p50"] == pytest.approx(0.005)  # piecewise-t16
    assert report["cost_model"].startswith("measured")


def _cli(argv, code=0):
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["replay-trace", *argv])
    assert rc == code, err.getvalue()
    return out.getvalue() if code == 0 else err.getvalue()


@pytest.fixture
def trace_file(tmp_path):
    path = tmp_path / "trace.csv"
    path.write_text(trace_to_csv(three_at_once()))
    return str(path)


def test_cli_compare_prints_both_runs_and_the_reduction(trace_file):
    report = json.loads(_cli(["--trace", trace_file, "--max-num-seqs", "8", "--max-num-batched-tokens", "64",
                              "--compare", "vllm,auto", "--json"]))
    assert list(report["runs"]) == ["vllm", "auto"]
    assert report["comparison"]["auto"]["full_padded_rows"] == 0
    assert report["comparison"]["auto"]["full_padded_rows_reduction"] == 1.0


def test_cli_compare_accepts_an_explicit_list(trace_file):
    report = json.loads(_cli(["--trace", trace_file, "--max-num-seqs", "8", "--max-num-batched-tokens", "64",
                              "--compare", "vllm,2,6", "--json"]))
    assert list(report["runs"]) == ["vllm", "2,6"]
    assert report["runs"]["2,6"]["config"]["capture_sizes"] == [2, 6, 8]
    assert report["runs"]["2,6"]["bucket_hits"]["full-t6-r6"]["padded_rows"] == 6


def test_cli_table_names_the_buckets(trace_file):
    text = _cli(["--trace", trace_file, "--max-num-seqs", "8", "--max-num-batched-tokens", "64"])
    assert "full-t4-r4 2" in text
    assert "padding ratio" in text


def test_cli_bad_capture_sizes_exit_2_with_one_line(trace_file):
    err = _cli(["--trace", trace_file, "--max-num-seqs", "8", "--capture-sizes", "1,16"], code=2)
    assert err.startswith("replay-trace: ") and "max_num_seqs=8" in err and err.count("\n") == 1


def test_cli_missing_trace_exit_2(tmp_path):
    err = _cli(["--trace", str(tmp_path / "nope.csv")], code=2)
    assert "cannot read trace" in err


def test_cli_trace_with_a_nan_timestamp_exits_2_naming_the_line(tmp_path):
    # Before: RuntimeError "the scheduler scheduled nothing with 0 running and 0 waiting sequences".
    path = tmp_path / "nan.csv"
    path.write_text("timestamp,input_tokens,output_tokens\n0,5,2\nnan,5,2\n")
    err = _cli(["--trace", str(path), "--json"], code=2)
    assert err == f"replay-trace: {path}: line 3: timestamp must be a finite number, got 'nan'\n"


def test_cli_compare_without_a_list_exits_2(trace_file):
    # Before: StopIteration from the comparison of an empty set of runs.
    err = _cli(["--trace", trace_file, "--compare", " , "], code=2)
    assert err == "replay-trace: --compare needs at least one list (vllm, auto or 1,2,4,...), got ' , '\n"
