"""Shapes of well-known Llama-family, Qwen3 and Qwen3-MoE models, for benchmarks and tests with random weights.

Timing and graph-memory measurements depend only on shapes, so a preset with random weights
stands in for a checkpoint that cannot be downloaded here. Shapes are those of each model's
published ``config.json``.

The worker serves a preset with ``--model preset:NAME`` (:func:`load_preset`): RANDOM WEIGHTS, for
benchmarks only (its outputs are meaningless), with a word-level tokenizer whose token ``i`` is
the text ``t<i>`` (ids 0, 1, 2: ``<unk>``, ``<s>``, ``</s>``), so prompts given as token ids and
streamed outputs work as with a real model.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from .llama import LlamaForCausalLM
from .config import ModelConfig
from .parallel import TensorParallel, shard_config

_LLAMA3_ROPE = {
    "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

PRESETS: dict[str, dict] = {
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, rope_theta=100000.0,
                         rope_scaling=None, max_position_embeddings=8192, tie_word_embeddings=True),
    "llama-3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, rope_theta=500000.0,
                         rope_scaling=_LLAMA3_ROPE, max_position_embeddings=131072, tie_word_embeddings=True),
    "llama-3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=500000.0,
                       rope_scaling=None, max_position_embeddings=8192, tie_word_embeddings=False),
    "llama-3-70b": dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                        num_attention_heads=64, num_key_value_heads=8, head_dim=128, rope_theta=500000.0,
                        rope_scaling=None, max_position_embeddings=8192, tie_word_embeddings=False),
    "qwen3-8b": dict(architecture="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     rope_theta=1000000.0, rope_scaling=None, max_position_embeddings=40960,
                     tie_word_embeddings=False, rms_norm_eps=1e-6, qk_norm=True),
    "qwen3-30b-a3b": dict(architecture="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          rope_theta=1000000.0, rope_scaling=None, max_position_embeddings=40960,
                          tie_word_embeddings=False, rms_norm_eps=1e-6, qk_norm=True, num_experts=128,
                          num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
                          moe_layers=tuple(range(48))),
    # Not a published model: a mixture of experts small enough for CPU tests of the whole worker.
    "qwen3-moe-tiny": dict(architecture="qwen3_moe", vocab_size=512, hidden_size=64, intermediate_size=96,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           rope_theta=1000000.0, rope_scaling=None, max_position_embeddings=1024,
                           tie_word_embeddings=False, rms_norm_eps=1e-6, qk_norm=True, num_experts=8,
                           num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, moe_layers=(0, 1)),
}
"""Shapes from each model's published ``config.json`` (the Llama presets: ``architecture`` llama,
``rms_norm_eps`` 1e-5 unless given)."""


def preset_config(name: str) -> ModelConfig:
    """The :class:`ModelConfig` of a preset.

    Raises:
        KeyError: an unknown preset (the message lists the known ones).
    """
    if name not in PRESETS:
        raise KeyError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}")
    shape = {"architecture": "llama", "rms_norm_eps": 1e-5, **PRESETS[name]}
    return ModelConfig(attention_bias=False, bos_token_id=1, eos_token_ids=(2,), **shape)


def random_model(
    config: ModelConfig, dtype: torch.dtype, device: torch.device | str, max_positions: int, seed: int = 0,
    parallel: TensorParallel | None = None,
) -> LlamaForCausalLM:
    """A model of ``config`` with N(0, 0.02) weights and unit norm weights (seeded); with ``parallel``,
    ``config`` is a rank's sharded configuration (runtime/model/parallel.py, ``shard_config``)."""
    model = LlamaForCausalLM(config, dtype=dtype, device=device, max_positions=max_positions, parallel=parallel)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm") or "layernorm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=generator)
    return model


PRESET_PREFIX = "preset:"
"""``--model preset:NAME`` loads the preset ``NAME`` with random weights."""


def preset_tokenizer(vocab_size: int):
    """A word-level :class:`~graphserving.runtime.model.tokenizer.Tokenizer` over ``vocab_size`` ids:
    id ``i`` is the word ``t<i>``; 0, 1, 2 are ``<unk>``, ``<s>`` (BOS), ``</s>`` (EOS), matching
    :func:`preset_config`. Built with the ``tokenizers`` library, decoded with spaces between words."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from .tokenizer import Tokenizer

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, vocab_size)}}
    backend = HFTokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    return Tokenizer(hf, eos_token_ids=(2,), bos_token_id=1)


def load_preset(spec: str, dtype: torch.dtype, device: torch.device | str, seed: int = 0,
                parallel: TensorParallel | None = None):
    """A :class:`~graphserving.runtime.model.loader.LoadedModel` for ``preset:NAME``: the preset's
    shape with RANDOM weights (:func:`random_model`, seeded) and :func:`preset_tokenizer`. With
    ``parallel``, the rank's share of that shape (its own random weights: a benchmark's ranks need
    the shapes, not slices of one model).

    The revision is the sha256 of the text ``preset:NAME:seed<seed>`` (it names the weights, which
    the seed fully determines); the served name is ``NAME-random``.

    Raises:
        KeyError: an unknown preset (the message lists the known ones).
        ConfigError: the shape does not split over ``parallel``'s ranks (``check_shardable``).
    """
    from .loader import LoadedModel

    name = spec.removeprefix(PRESET_PREFIX)
    config = preset_config(name)
    if parallel is not None:
        config = shard_config(config, parallel.layout)
    model = random_model(config, dtype, device, max_positions=config.max_model_len, seed=seed,
                         parallel=parallel).eval()
    revision = hashlib.sha256(f"{PRESET_PREFIX}{name}:seed{seed}".encode()).hexdigest()
    return LoadedModel(model=model, config=config, tokenizer=preset_tokenizer(config.vocab_size), revision=revision,
                       name=f"{name}-random", path=Path(spec))
