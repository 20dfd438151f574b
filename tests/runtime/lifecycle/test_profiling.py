"""The lifecycle's measurements without a GPU: the graph reserve, KV-cache sizing after it, lent blocks.

The CUDA sizing path is driven with ``torch.cuda.mem_get_info`` replaced (the sizing itself is
``model.kv_cache.num_kv_blocks``; the lifecycle only passes the graph reserve), so the arithmetic,
the log line and the no-room error are checked on the CPU.
"""

from __future__ import annotations

import logging

import pytest

torch = pytest.importorskip("torch")

from graphserving.contract.graph_policy import GraphMode  # noqa: E402
from graphserving.contract.worker_config import EngineLimits, GraphConfig  # noqa: E402
from graphserving.runtime.engine.block_manager import BlockManager  # noqa: E402
from graphserving.runtime.graphs.key import GraphKeyContract  # noqa: E402
from graphserving.runtime.lifecycle.outcome import resolve_graphs  # noqa: E402
from graphserving.runtime.lifecycle.profiling import (  # noqa: E402
    BORROWER_SEQ_ID,
    borrowed_blocks,
    estimate_graph_memory,
    graph_reserve_bytes,
    size_kv_cache,
)
from graphserving.runtime.model.config import ModelConfig  # noqa: E402
from graphserving.runtime.model.kv_cache import CPU_DEFAULT_NUM_KV_BLOCKS, kv_cache_bytes_per_block  # noqa: E402

CONFIG = ModelConfig(architecture="llama", vocab_size=128, hidden_size=64, intermediate_size=96,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None, max_position_embeddings=128,
                     tie_word_embeddings=False, attention_bias=False, bos_token_id=1, eos_token_ids=(2,))
CUDA = torch.device("cuda")
MIB = 2**20


def free_memory(monkeypatch, free_bytes: int) -> None:
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free_bytes, 2 * free_bytes))


def sized(limits: EngineLimits, device, estimate: int = 0, margin: float = 0.25) -> int:
    return size_kv_cache(limits, CONFIG, torch.float32, device, graph_memory_estimate=estimate,
                         graph_memory_margin_fraction=margin)


def test_the_graph_reserve_is_the_estimate_and_its_margin():
    assert graph_reserve_bytes(1000, 0.25) == 1250
    assert graph_reserve_bytes(0, 0.25) == 0
    assert graph_reserve_bytes(3, 0.5) == 4  # floor


def test_a_requested_block_count_is_used_as_is_and_the_cpu_gets_the_default():
    assert sized(EngineLimits(num_kv_blocks=64), CUDA, estimate=10**12) == 64
    assert sized(EngineLimits(), torch.device("cpu"), estimate=10**12) == CPU_DEFAULT_NUM_KV_BLOCKS


def test_on_cuda_the_kv_cache_takes_its_fraction_of_free_memory_less_the_graph_reserve(monkeypatch, caplog):
    per_block = kv_cache_bytes_per_block(CONFIG, 16, torch.float32)
    free_memory(monkeypatch, 1000 * MIB)
    limits = EngineLimits(block_size=16, kv_cache_memory_fraction=0.5)
    with caplog.at_level(logging.INFO, logger="graphserving.runtime.lifecycle.profiling"):
        blocks = sized(limits, CUDA, estimate=100 * MIB, margin=0.25)
    assert blocks == (500 * MIB - 125 * MIB) // per_block
    assert "KV cache sized after reserving 125.0 MiB for graphs (estimate 100.0 MiB + margin)" in caplog.text
    assert sized(limits, CUDA, estimate=0) == 500 * MIB // per_block


def test_on_cuda_a_graph_reserve_that_leaves_no_room_names_the_free_and_reserved_bytes(monkeypatch):
    free_memory(monkeypatch, 100 * MIB)
    with pytest.raises(RuntimeError, match=rf"no room for the KV cache: {100 * MIB} bytes free, "
                                           rf"{100 * MIB} reserved for graphs"):
        sized(EngineLimits(kv_cache_memory_fraction=0.9), CUDA, estimate=80 * MIB, margin=0.25)


def test_without_cuda_no_graph_memory_is_estimated():
    graphs = resolve_graphs(GraphConfig(capture_sizes=[1, 2]), 4, 64)
    contract = GraphKeyContract(model_revision="r", dtype="float32")
    estimate = estimate_graph_memory(None, CONFIG, graphs, contract, block_size=16, max_model_len=128,
                                     dtype=torch.float32, device=torch.device("cpu"))
    assert estimate == 0
    none = resolve_graphs(GraphConfig(mode=GraphMode.NONE), 4, 64)
    assert estimate_graph_memory(None, CONFIG, none, contract, block_size=16, max_model_len=128,
                                 dtype=torch.float32, device=CUDA) == 0


def test_borrowed_blocks_are_given_back_and_a_short_loan_takes_what_is_free():
    bm = BlockManager(9, 16)  # 8 usable blocks
    with borrowed_blocks(bm, 3) as blocks:
        assert len(blocks) == 3 and bm.num_free_blocks == 5
        assert bm.block_table(BORROWER_SEQ_ID) == blocks
    assert bm.num_free_blocks == 8
    with borrowed_blocks(bm, 20) as blocks:
        assert len(blocks) == 8 and bm.num_free_blocks == 0
    bm.allocate("request", 8 * 16)  # requests hold the whole cache
    with borrowed_blocks(bm, 4) as blocks:
        assert blocks == []
    assert bm.num_free_blocks == 0
