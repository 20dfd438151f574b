"""Engine limits against the memory they need (issue 19: ``maxNumSeqs`` / ``maxNumBatchedTokens`` of
100 000 were OOM-killed in warm-up instead of failing with one line).

The estimate and the decisions are pure and checked with exact numbers for SmolLM2's shape; the
memory probe reads a /proc and cgroup tree written to a temporary folder; the lifecycle runs the
real SmolLM2 model with the host's available memory replaced by a small number (as test_profiling.py
replaces ``torch.cuda.mem_get_info``), so a too-large limit fails the worker before warm-up.
"""

from __future__ import annotations

import logging
import threading

import pytest

torch = pytest.importorskip("torch")

from graphserving.contract.graph_policy import GraphMode  # noqa: E402
from graphserving.contract.report import Phase  # noqa: E402
from graphserving.contract.worker_config import EngineLimits, GraphConfig, WorkerConfig  # noqa: E402
from graphserving.runtime.lifecycle import profiling  # noqa: E402
from graphserving.runtime.lifecycle.phases import WorkerLifecycle  # noqa: E402
from graphserving.runtime.lifecycle.profiling import (  # noqa: E402
    EngineLimitsError,
    ForwardPassBytes,
    activation_bytes_per_token,
    check_forward_pass_memory,
    forward_pass_bytes,
    forward_pass_problem,
    host_available_bytes,
    kv_concurrency_problem,
    logits_bytes_per_row,
    size_kv_cache,
)
from graphserving.runtime.model.presets import preset_config  # noqa: E402

SMOLLM2 = preset_config("smollm2-135m")  # H 576, I 1536, Hq 9 x D 64, V 49152
#: 3 * 576 + 9 * 64 + 4 * 1536 = 8448 values per token row.
SMOLLM2_ROW_VALUES = 8448
GB = 10**9
CPU = torch.device("cpu")


# ---------------------------------------------------------------------- the estimate (pure)

def test_a_token_row_holds_the_widest_point_of_a_layer_in_the_model_dtype():
    assert activation_bytes_per_token(SMOLLM2, 4) == SMOLLM2_ROW_VALUES * 4 == 33792
    assert activation_bytes_per_token(SMOLLM2, 2) == 16896


def test_a_logits_row_counts_the_float32_logits_whatever_the_model_dtype():
    assert logits_bytes_per_row(SMOLLM2, 4) == 49152 * 4
    assert logits_bytes_per_row(SMOLLM2, 2) == 49152 * 4  # written in float32 directly on CUDA


def test_a_forward_pass_of_100000_rows_of_smollm2_needs_23_gb_the_size_that_was_oom_killed():
    need = forward_pass_bytes(SMOLLM2, 100000, 100000, 4)
    assert need == ForwardPassBytes(activations=3_379_200_000, logits=19_660_800_000)
    assert need.total == 23_040_000_000


# ---------------------------------------------------------------------- the decision (pure)

def test_limits_whose_forward_pass_fits_pass():
    limits = EngineLimits(max_num_seqs=64, max_num_batched_tokens=2048)
    exact = forward_pass_bytes(SMOLLM2, 2048, 64, 4).total
    assert forward_pass_problem(limits, SMOLLM2, 4, exact, "cpu") is None


def test_a_token_budget_too_large_names_max_num_batched_tokens_and_the_largest_that_fits():
    limits = EngineLimits(max_num_seqs=64, max_num_batched_tokens=131072)
    available = 2 * GB
    largest = (available - 64 * 196608) // 33792
    assert largest == 58813
    assert forward_pass_bytes(SMOLLM2, largest, 64, 4).total <= available
    assert forward_pass_bytes(SMOLLM2, largest + 1, 64, 4).total > available
    assert forward_pass_problem(limits, SMOLLM2, 4, available, "cpu") == (
        "maxNumBatchedTokens=131072 does not fit: one forward pass of 131072 token rows (maxNumBatchedTokens) "
        "with 64 logits rows (maxNumSeqs) needs 4441767936 bytes (activations 4429185024 + logits 12582912), "
        "2000000000 available on cpu; set maxNumBatchedTokens <= 58813"
    )


def test_too_many_sequences_name_max_num_seqs_and_the_largest_value_both_limits_may_take():
    limits = EngineLimits(max_num_seqs=4096, max_num_batched_tokens=4096)
    available = GB // 2
    largest = available // (33792 + 196608)
    assert largest == 2170
    assert forward_pass_problem(limits, SMOLLM2, 4, available, "cuda:0") == (
        "maxNumSeqs=4096 does not fit: one forward pass of 4096 token rows (maxNumBatchedTokens) with 4096 "
        "logits rows (maxNumSeqs) needs 943718400 bytes (activations 138412032 + logits 805306368), "
        "500000000 available on cuda:0; set maxNumSeqs and maxNumBatchedTokens <= 2170"
    )


def test_when_not_one_row_fits_the_line_says_so():
    problem = forward_pass_problem(EngineLimits(max_num_seqs=1, max_num_batched_tokens=1), SMOLLM2, 4, 1000, "cpu")
    assert problem.startswith("maxNumSeqs=1 does not fit: ")
    assert problem.endswith("1000 available on cpu; not even one row fits: free memory or serve a smaller model "
                            "or dtype")


def test_a_kv_cache_with_a_block_for_every_sequence_is_no_problem():
    assert kv_concurrency_problem(65, 64) is None
    assert kv_concurrency_problem(513, 512) is None


def test_a_kv_cache_short_of_max_num_seqs_says_the_scheduler_preempts_and_what_to_set():
    assert kv_concurrency_problem(64, 64) == (
        "maxNumSeqs=64 exceeds the 63 usable KV blocks (of 64, the null block excluded): at most 63 sequences "
        "hold KV blocks at once; the scheduler keeps the others waiting and preempts the youngest running sequence "
        "when the cache runs out, and the decode capacity at maxNumSeqs cannot be measured; set maxNumSeqs <= 63 "
        "or numKvBlocks >= 65"
    )


def test_sizing_the_kv_cache_warns_when_max_num_seqs_sequences_cannot_each_get_a_block(caplog):
    limits = EngineLimits(max_num_seqs=64, num_kv_blocks=64)
    with caplog.at_level(logging.WARNING, logger="graphserving.runtime.lifecycle.profiling"):
        blocks = size_kv_cache(limits, SMOLLM2, torch.float32, CPU, graph_memory_estimate=0,
                               graph_memory_margin_fraction=0.1)
    assert blocks == 64
    assert [r.getMessage() for r in caplog.records] == [kv_concurrency_problem(64, 64)]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="graphserving.runtime.lifecycle.profiling"):
        size_kv_cache(limits.model_copy(update={"num_kv_blocks": 65}), SMOLLM2, torch.float32, CPU,
                      graph_memory_estimate=0, graph_memory_margin_fraction=0.1)
    assert caplog.records == []


# ---------------------------------------------------------------------- the probes (edges)

def write_proc(root, *, mem_available_kb: int, cgroup: str | None) -> None:
    (root / "self").mkdir(parents=True)
    (root / "meminfo").write_text(f"MemTotal:       32000000 kB\nMemFree:         1000000 kB\n"
                                  f"MemAvailable:   {mem_available_kb} kB\n")
    if cgroup is not None:
        (root / "self" / "cgroup").write_text(f"0::{cgroup}\n")


def test_host_memory_is_mem_available_without_a_cgroup_limit(tmp_path):
    proc, fs = tmp_path / "proc", tmp_path / "cgroup"
    write_proc(proc, mem_available_kb=20_000_000, cgroup="/pods/worker")
    (fs / "pods" / "worker").mkdir(parents=True)
    (fs / "pods" / "worker" / "memory.max").write_text("max\n")
    (fs / "pods" / "worker" / "memory.current").write_text("123\n")
    assert host_available_bytes(proc, fs) == 20_000_000 * 1024


def test_host_memory_is_bounded_by_the_tightest_cgroup_limit_of_the_process_and_its_ancestors(tmp_path):
    proc, fs = tmp_path / "proc", tmp_path / "cgroup"
    write_proc(proc, mem_available_kb=20_000_000, cgroup="/pods/worker")
    (fs / "pods" / "worker").mkdir(parents=True)
    (fs / "pods" / "memory.max").write_text(f"{4 * GB}\n")  # the Pod's limit
    (fs / "pods" / "memory.current").write_text(f"{3 * GB}\n")
    (fs / "pods" / "worker" / "memory.max").write_text(f"{8 * GB}\n")  # the container's, looser
    (fs / "pods" / "worker" / "memory.current").write_text(f"{1 * GB}\n")
    assert host_available_bytes(proc, fs) == 1 * GB


def test_the_real_host_probe_gives_a_positive_byte_count():
    assert host_available_bytes() > 0


def test_on_cuda_the_probe_counts_free_memory_and_what_the_allocator_holds_unused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (GB // 4, 80 * GB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 3 * GB // 2)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: GB)
    assert profiling.available_memory_bytes(torch.device("cuda")) == 3 * GB // 4
    # bfloat16: 16896 bytes per token row, 49152 * 4 per logits row; 750000000 // 213504 == 3512
    limits = EngineLimits(max_num_seqs=4096, max_num_batched_tokens=4096)
    with pytest.raises(EngineLimitsError, match=r"^maxNumSeqs=4096 does not fit: .* 750000000 available on cuda; "
                                                r"set maxNumSeqs and maxNumBatchedTokens <= 3512$"):
        check_forward_pass_memory(limits, SMOLLM2, torch.bfloat16, torch.device("cuda"))


def test_limits_that_fit_return_the_estimate():
    need = check_forward_pass_memory(EngineLimits(), SMOLLM2, torch.float32, CPU)
    assert need == forward_pass_bytes(SMOLLM2, 2048, 64, 4)


# ---------------------------------------------------------------------- the worker

def test_a_token_budget_the_host_cannot_hold_fails_the_worker_before_warmup_with_one_line(smollm2, monkeypatch):
    monkeypatch.setattr(profiling, "host_available_bytes", lambda: 2 * GB)
    limits = EngineLimits(max_num_seqs=64, max_num_batched_tokens=131072)
    config = WorkerConfig(model_name="smollm2", model_path="smollm2", engine=limits,
                          graphs=GraphConfig(mode=GraphMode.NONE))
    lc = WorkerLifecycle(config, smollm2)
    thread = threading.Thread(target=lc.run, daemon=True)
    thread.start()
    thread.join(300)
    assert not thread.is_alive()
    report = lc.report()
    assert report.phase is Phase.FAILED and not lc.readiness.ready
    assert [p.phase.value for p in report.phases] == ["Loading", "Warmup", "Failed"]
    assert report.failure_reason == (
        "EngineLimitsError: maxNumBatchedTokens=131072 does not fit: one forward pass of 131072 token rows "
        "(maxNumBatchedTokens) with 64 logits rows (maxNumSeqs) needs 4441767936 bytes (activations 4429185024 + "
        "logits 12582912), 2000000000 available on cpu; set maxNumBatchedTokens <= 58813"
    )
    assert lc.engine is None  # no KV cache, no engine: nothing was allocated for these limits
