"""`--model preset:NAME`: a known shape with random weights and a word-level tokenizer (benchmarks)."""

from __future__ import annotations

import hashlib

import pytest
import torch

from graphserving.runtime.model.presets import load_preset, preset_config, preset_tokenizer
from graphserving.runtime.model.tokenizer import IncrementalDetokenizer
from graphserving.runtime.worker import StartupError, build_parser, load, resolve_config


def test_preset_tokenizer_maps_id_i_to_the_word_t_i():
    tok = preset_tokenizer(100)
    assert tok.encode("t5 t99 t7") == [5, 99, 7]
    assert tok.decode([5, 6]) == "t5 t6"
    assert (tok.bos_token_id, tok.eos_token_ids, tok.vocab_size) == (1, (2,), 100)
    detok = IncrementalDetokenizer(tok, [5])
    assert detok.feed(42) == " t42"


def test_load_preset_has_the_preset_shape_and_a_seeded_revision():
    loaded = load_preset("preset:smollm2-135m", torch.float32, "cpu", seed=3)
    config = preset_config("smollm2-135m")
    assert loaded.config == config
    assert loaded.name == "smollm2-135m-random"
    assert loaded.revision == hashlib.sha256(b"preset:smollm2-135m:seed3").hexdigest()
    assert loaded.tokenizer.vocab_size == config.vocab_size
    assert sum(p.numel() for p in loaded.model.parameters()) == 134_515_008  # SmolLM2-135M, tied embeddings


def test_worker_serves_a_preset_under_a_random_name():
    config = resolve_config(build_parser().parse_args(["--model", "preset:smollm2-135m"]), environ={})
    assert config.model_name == "smollm2-135m-random"


def test_worker_refuses_an_unknown_preset_in_one_line():
    config = resolve_config(build_parser().parse_args(["--model", "preset:nope", "--device", "cpu"]), environ={})
    with pytest.raises(StartupError, match="unknown model preset 'nope'; known: smollm2-135m"):
        load(config)


@pytest.mark.parametrize("name, total, active", [
    ("qwen3-8b", 8.2e9, 8.2e9),           # Qwen3 technical report: 8.2B parameters
    ("qwen3-30b-a3b", 30.5e9, 3.3e9),     # Qwen3 technical report: 30.5B total, 3.3B activated
    ("llama-3-8b", 8.03e9, 8.03e9),       # Meta Llama 3 model card: 8B (8.03B in its safetensors index)
    ("llama-3-70b", 70.6e9, 70.6e9),      # Meta Llama 3 model card: 70B (70.6B in its safetensors index)
])
def test_presets_have_the_published_parameter_counts(name, total, active):
    from graphserving.runtime.model.llama import LlamaForCausalLM

    config = preset_config(name)
    model = LlamaForCausalLM(config, device="meta", max_positions=16)  # shapes only, no memory
    params = sum(p.numel() for p in model.parameters())
    experts = sum(layer.experts_gate_up.numel() + layer.experts_down.numel() for layer in model.layers if layer.is_moe)
    inactive = experts * (1 - config.num_experts_per_tok / config.num_experts) if config.moe_layers else 0
    assert params == pytest.approx(total, rel=0.01)
    assert params - inactive == pytest.approx(active, rel=0.02)


def test_the_tiny_moe_preset_serves_through_the_worker_model_loader():
    loaded = load_preset("preset:qwen3-moe-tiny", torch.float32, "cpu")
    assert loaded.config.moe_layout == "e8-top2-ep1"
    assert all(layer.is_moe for layer in loaded.model.layers)


def test_a_preset_loads_one_ranks_share_under_tensor_parallelism():
    from graphserving.runtime.model.parallel import ParallelLayout, TensorParallel

    full = preset_config("qwen3-moe-tiny")
    rank1 = load_preset("preset:qwen3-moe-tiny", torch.float32, "cpu", parallel=TensorParallel(ParallelLayout(2, 1)))
    assert rank1.model.parallel_layout == "tp2-pp1"
    assert (rank1.config.num_attention_heads, rank1.config.moe_intermediate_size) == (
        full.num_attention_heads // 2, full.moe_intermediate_size // 2)
    assert tuple(rank1.model.lm_head.shape) == (full.vocab_size // 2, full.hidden_size)
