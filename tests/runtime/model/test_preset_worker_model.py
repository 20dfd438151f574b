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
