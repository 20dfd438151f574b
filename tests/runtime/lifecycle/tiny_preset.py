"""A tiny random-weight model of the SmolLM2 family for lifecycle tests (a fraction of a second to
build, emulated graphs on the CPU)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from graphserving.runtime.model.loader import LoadedModel
from graphserving.runtime.model.presets import preset_config, preset_tokenizer, random_model


def tiny_loaded() -> LoadedModel:
    """2 layers, hidden 64, vocab 300, 256 positions, seeded weights (float32, CPU)."""
    cfg = dataclasses.replace(preset_config("smollm2-135m"), vocab_size=300, hidden_size=64, intermediate_size=96,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                              max_position_embeddings=256, tie_word_embeddings=False)
    model = random_model(cfg, torch.float32, "cpu", max_positions=cfg.max_model_len, seed=0).eval()
    return LoadedModel(model=model, config=cfg, tokenizer=preset_tokenizer(300), revision="r" * 64,
                       name="tiny", path=Path("preset:tiny"))
