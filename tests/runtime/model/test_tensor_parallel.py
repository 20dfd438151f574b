"""Tensor parallelism on the CPU (runtime/model/parallel.py): the sharded configuration and weights,
and two gloo processes, each holding half of a tiny random model, whose logits equal the
single-process model's.

Tolerance: max |tp - single| / max |single| over the vocabulary below 1e-5 in float32 (the
all-reduce sums two partial products in another order than one GEMM does), for a prefill and 6
decode steps through each rank's own paged KV cache.
"""

from __future__ import annotations

import dataclasses
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from graphserving.dev.ports import free_port
from graphserving.runtime.model.config import ConfigError
from graphserving.runtime.model.forward_metadata import ForwardMetadata
from graphserving.runtime.model.kv_cache import allocate_kv_cache
from graphserving.runtime.model.loader import load_model
from graphserving.runtime.model.parallel import (
    ParallelLayout,
    TensorParallel,
    check_shardable,
    shard_config,
    shard_weight,
)

TOLERANCE = 1e-5
TOKENS = [3, 17, 101, 5, 44, 7, 250, 9, 12, 60, 61, 62]
"""Prefill of the first 6, then one decode step per token after them (teacher forcing)."""
PREFILL = 6
BLOCK_SIZE = 4


def _meta(tokens: list[int], start: int) -> ForwardMetadata:
    """One sequence's rows ``start .. start + len(tokens) - 1``, its KV in blocks 1, 2, 3, ..."""
    n, end = len(tokens), start + len(tokens)
    table = list(range(1, 1 + -(-end // BLOCK_SIZE)))
    return ForwardMetadata(
        input_ids=torch.tensor(tokens), positions=torch.arange(start, end),
        seq_lens=torch.tensor([end], dtype=torch.int32), query_lens=torch.tensor([n], dtype=torch.int32),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        block_table=torch.tensor([table], dtype=torch.int32),
        slot_mapping=torch.tensor([table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, end)]),
        logits_indices=torch.tensor([n - 1]), num_actual_tokens=n, num_actual_reqs=1, max_query_len=n,
        query_lens_cpu=[n], seq_lens_cpu=[end],
    )


@torch.inference_mode()
def _logits(model) -> torch.Tensor:
    """float32 [1 + len(TOKENS) - PREFILL, vocab]: the prefill's last row, then each decode step's."""
    kv = allocate_kv_cache(model.config, 8, BLOCK_SIZE, torch.float32, "cpu")
    steps = [(TOKENS[:PREFILL], 0)] + [([t], PREFILL + i) for i, t in enumerate(TOKENS[PREFILL:])]
    rows = []
    for tokens, start in steps:
        meta = _meta(tokens, start)
        rows.append(model.compute_logits(model(meta, kv)[meta.logits_indices])[0])
    return torch.stack(rows)


def _rank(rank: int, world: int, port: int, path: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        loaded = load_model(path, revision=None, dtype=torch.float32, device="cpu",
                            parallel=TensorParallel(ParallelLayout(world, rank)))
        torch.save(_logits(loaded.model), f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("variant", ["llama3_rope", "qwen2_bias", "qwen3", "qwen3_moe", "tied_embeddings"])
def test_two_ranks_compute_the_logits_of_the_whole_model(variant, tiny_model_dir, tmp_path, rel_err):
    path = str(tiny_model_dir(variant))
    single = load_model(path, revision=None, dtype=torch.float32, device="cpu")
    expected = _logits(single.model)
    out = str(tmp_path / "logits")
    mp.start_processes(_rank, args=(2, free_port(), path, out), nprocs=2, join=True, start_method="spawn")
    for rank in range(2):
        got = torch.load(f"{out}.{rank}")
        errors = [rel_err(g, e) for g, e in zip(got, expected)]
        assert len(errors) == 1 + len(TOKENS) - PREFILL and max(errors) < TOLERANCE, (rank, errors)


def test_a_rank_loads_its_share_of_the_heads_and_the_mlp(tiny_model_dir):
    path = tiny_model_dir("qwen3_moe")
    full = load_model(path, revision=None, dtype=torch.float32, device="cpu").config
    # loading needs no process group: the collective runs only in a forward pass
    rank1 = load_model(path, revision=None, dtype=torch.float32, device="cpu",
                       parallel=TensorParallel(ParallelLayout(2, 1)))
    config = rank1.config
    assert rank1.model.parallel_layout == "tp2-pp1"  # the graph key's parallel layout (GraphKeyContract)
    assert (config.num_attention_heads, config.num_key_value_heads) == (full.num_attention_heads // 2,
                                                                        full.num_key_value_heads // 2)
    assert (config.intermediate_size, config.moe_intermediate_size) == (full.intermediate_size // 2,
                                                                        full.moe_intermediate_size // 2)
    assert (config.hidden_size, config.head_dim, config.vocab_size) == (full.hidden_size, full.head_dim,
                                                                        full.vocab_size)
    layer = rank1.model.layers[1]  # dense (mlp_only_layers)
    assert tuple(layer.qkv_proj.shape) == ((2 + 2 * 1) * full.head_dim, full.hidden_size)
    assert tuple(layer.o_proj.shape) == (full.hidden_size, 2 * full.head_dim)
    assert tuple(layer.down_proj.shape) == (full.hidden_size, full.intermediate_size // 2)
    assert tuple(rank1.model.lm_head.shape) == (full.vocab_size // 2, full.hidden_size)  # vocabulary rows


def test_a_tied_lm_head_is_a_view_of_the_ranks_embedding_rows(tiny_model_dir):
    path = tiny_model_dir("tied_embeddings")
    single = load_model(path, revision=None, dtype=torch.float32, device="cpu").model
    rank1 = load_model(path, revision=None, dtype=torch.float32, device="cpu",
                       parallel=TensorParallel(ParallelLayout(2, 1))).model
    assert rank1.config.tie_word_embeddings
    half = single.config.vocab_size // 2
    assert torch.equal(rank1.lm_head, single.embed_tokens[half:])
    assert rank1.lm_head.data_ptr() == rank1.embed_tokens[half:].data_ptr()  # no copy: a reload updates both


def test_weights_split_by_rows_columns_or_not_at_all():
    layout = ParallelLayout(2, 1)
    w = torch.arange(24.0).reshape(4, 6)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                 "model.layers.0.mlp.gate_proj.weight", "model.layers.3.mlp.experts.5.up_proj.weight",
                 "lm_head.weight"):  # the LM head by vocabulary rows
        assert torch.equal(shard_weight(name, w, layout), w[2:])  # output rows: rank 1 has the second half
    for name in ("model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.down_proj.weight",
                 "model.layers.3.mlp.experts.5.down_proj.weight"):
        assert torch.equal(shard_weight(name, w, layout), w[:, 3:])  # input columns
    bias = torch.ones(6)
    assert torch.equal(shard_weight("model.layers.0.self_attn.q_proj.bias", bias, layout), bias[3:])
    assert torch.equal(shard_weight("model.layers.0.self_attn.o_proj.bias", bias, layout), torch.zeros(6))
    assert shard_weight("model.layers.0.self_attn.o_proj.bias", bias, ParallelLayout(2, 0)) is bias
    for name in ("model.embed_tokens.weight", "model.norm.weight",
                 "model.layers.0.input_layernorm.weight", "model.layers.0.mlp.gate.weight",
                 "model.layers.0.self_attn.q_norm.weight"):
        assert shard_weight(name, w, layout) is w
    stacked = torch.arange(2 * 8 * 3.0).reshape(2, 8, 3)  # [E, 2I, H], gate rows 0-3, up rows 4-7
    fused = shard_weight("model.layers.0.mlp.experts.gate_up_proj", stacked, layout)
    assert torch.equal(fused, torch.cat([stacked[:, 2:4], stacked[:, 6:8]], dim=1))
    down = torch.arange(2 * 3 * 4.0).reshape(2, 3, 4)  # [E, H, I]
    assert torch.equal(shard_weight("model.layers.0.mlp.experts.down_proj", down, layout), down[..., 2:])
    assert shard_weight("model.layers.0.self_attn.o_proj.weight", w, ParallelLayout()) is w


def test_a_model_that_does_not_split_evenly_is_refused_naming_the_field(tiny_model_dir):
    config = load_model(tiny_model_dir("llama3_rope"), revision=None, dtype=torch.float32, device="cpu").config
    with pytest.raises(ConfigError, match=r"num_key_value_heads \(2\) is not divisible by the tensor-parallel size \(4\)"):
        check_shardable(config, 4)
    odd_vocab = dataclasses.replace(config, vocab_size=config.vocab_size + 1)
    with pytest.raises(ConfigError, match=rf"vocab_size \({odd_vocab.vocab_size}\) is not divisible by the "
                                          r"tensor-parallel size \(2\)"):
        check_shardable(odd_vocab, 2)
    with pytest.raises(ConfigError, match="num_attention_heads"):
        shard_config(config, ParallelLayout(3, 0))
    assert shard_config(config, ParallelLayout()) is config


def test_a_layout_names_itself_as_the_graph_key_does_and_checks_its_rank():
    assert ParallelLayout(2, 1).label() == "tp2-pp1" and ParallelLayout().label() == "tp1-pp1"
    with pytest.raises(ValueError, match="rank"):
        ParallelLayout(2, 2)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        ParallelLayout(0, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_an_nccl_all_reduce_captured_in_full_graphs_replays_like_eager(tiny_model_dir, monkeypatch):
    """One GPU, a group of one: the collective after each row-parallel projection is captured in
    the FULL decode graphs (warmed up eagerly first, as the graph runner does) and an engine on
    them emits the eager engine's greedy tokens. NVLink multicast off, as on a shared host."""
    from graphserving.contract.graph_policy import GraphMode
    from graphserving.contract.worker_config import EngineLimits
    from graphserving.runtime.engine.core import LLMEngine
    from graphserving.runtime.engine.sequence import SamplingParams
    from graphserving.runtime.graphs.key import GraphKeyContract
    from graphserving.runtime.graphs.runner import GraphRunner

    for name, value in (("NCCL_NVLS_ENABLE", "0"), ("NVSHMEM_DISABLE_NVLS", "1"),
                        ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")):
        monkeypatch.setenv(name, value)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            device_id=torch.device("cuda:0"))
    try:
        loaded = load_model(tiny_model_dir("llama3_rope"), revision=None, dtype=torch.float32, device="cuda",
                            parallel=TensorParallel(ParallelLayout(1, 0)))
        limits = EngineLimits(max_num_seqs=4, num_kv_blocks=64, block_size=4)
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        prompts = [[5, 17, 300, 42], [9, 8, 7, 6, 5]]

        def generate(graphs: bool):
            kv = allocate_kv_cache(loaded.config, 64, 4, torch.float32, "cuda")
            runner = None
            if graphs:
                runner = GraphRunner(loaded.model, kv, mode=GraphMode.FULL, full_sizes=[1, 2], piecewise_sizes=[],
                                     contract=GraphKeyContract(model_revision="test", dtype="float32",
                                                               parallel_layout=loaded.model.parallel_layout),
                                     max_blocks_per_seq=63)
                with torch.inference_mode():
                    runner.capture_all()
            engine = LLMEngine(loaded.model, loaded.config, loaded.tokenizer, limits, device="cuda", kv_caches=kv,
                               graph_runner=runner)
            return [c[0].token_ids for c in engine.generate(prompts, params)], runner

        eager, _ = generate(False)
        replayed, runner = generate(True)
        assert replayed == eager
        assert sum(runner.stats.replays.values()) > 0
    finally:
        dist.destroy_process_group()
