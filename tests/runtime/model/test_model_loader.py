"""Model loading at an exact revision: formats, revision checks, errors, dtypes, in-place weights."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
import torch

from graphserving.runtime.model.loader import (
    CACHE_DIR_ENV,
    ModelLoadError,
    RevisionMismatchError,
    UnsupportedArchitectureError,
    compute_revision,
    load_model,
    tokenizer_cache_dir,
    unpermute_rope_rows,
)


def test_gguf_revision_is_the_sha256_of_the_file(smollm2_path, smollm2):
    expected = hashlib.sha256(smollm2_path.read_bytes()).hexdigest()
    assert compute_revision(smollm2_path) == expected
    assert smollm2.revision == expected


def test_directory_revision_is_the_sha256_of_a_sorted_sha256sum_manifest(tmp_path):
    (tmp_path / "b.safetensors").write_bytes(b"second")
    (tmp_path / "a.safetensors").write_bytes(b"first")
    (tmp_path / "config.json").write_text("{}")  # not a weights file: not in the manifest
    manifest = "".join(
        f"{hashlib.sha256(data).hexdigest()}  {name}\n" for name, data in [("a.safetensors", b"first"),
                                                                            ("b.safetensors", b"second")]
    )
    assert compute_revision(tmp_path) == hashlib.sha256(manifest.encode()).hexdigest()


def test_revision_mismatch_names_expected_and_actual(tiny_model_dir):
    path = tiny_model_dir("tied_embeddings")
    actual = compute_revision(path)
    wrong = "0" * 64
    with pytest.raises(RevisionMismatchError) as info:
        load_model(path, revision=wrong, dtype=torch.float32, device="cpu")
    assert wrong in str(info.value) and actual in str(info.value)
    assert (info.value.expected, info.value.actual) == (wrong, actual)


def test_matching_revision_loads(tiny_model_dir):
    path = tiny_model_dir("tied_embeddings")
    loaded = load_model(path, revision=compute_revision(path).upper(), dtype=torch.float32, device="cpu")
    assert loaded.revision == compute_revision(path)
    assert loaded.name == path.name and loaded.path == path


def test_missing_path_is_a_model_load_error_naming_it(tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(ModelLoadError, match="nope.gguf.*does not exist"):
        load_model(missing, revision=None, dtype=torch.float32, device="cpu")


def test_directory_without_config_is_rejected(tmp_path):
    with pytest.raises(ModelLoadError, match="neither a GGUF file nor a directory with config.json"):
        load_model(tmp_path, revision=None, dtype=torch.float32, device="cpu")


def test_unknown_architecture_is_rejected(tiny_model_dir, tmp_path):
    path = tmp_path / "model"
    shutil.copytree(tiny_model_dir("mistral"), path)
    config = json.loads((path / "config.json").read_text())
    config["model_type"] = "gpt2"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitectureError, match="model_type 'gpt2' is not supported"):
        load_model(path, revision=None, dtype=torch.float32, device="cpu")


def test_unsupported_dtype_is_rejected(tiny_model_dir):
    with pytest.raises(ModelLoadError, match="dtype 'int8' is not supported"):
        load_model(tiny_model_dir("mistral"), revision=None, dtype="int8", device="cpu")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_loads_and_runs_close_to_float32(dtype, tiny_model_dir, paged_runner):
    path = tiny_model_dir("qwen2_bias")
    full = load_model(path, None, torch.float32, "cpu")
    half = load_model(path, None, dtype, "cpu")
    assert half.model.embed_tokens.dtype == dtype and half.model.cos_cache.dtype == dtype
    prompt = list(range(100, 130))
    ref = paged_runner(full.model).step([("s", prompt)])[0]
    got = paged_runner(half.model).step([("s", prompt)])[0]
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    # bfloat16 keeps 8 mantissa bits: a few percent of the logit range.
    assert (got - ref).abs().max() / ref.abs().max() < 0.05


def test_reloading_weights_keeps_data_pointers(tiny_model_dir, paged_runner):
    from safetensors.torch import load_file

    path = tiny_model_dir("llama3_rope")
    loaded = load_model(path, None, torch.float32, "cpu")
    model = loaded.model
    pointers = {name: p.data_ptr() for name, p in model.named_parameters()}
    before = paged_runner(model).step([("s", [1, 2, 3])])[0]
    state = load_file(str(path / "model.safetensors"))
    model.load_weights({name: torch.zeros_like(t) for name, t in state.items()})
    zeroed = paged_runner(model).step([("s", [1, 2, 3])])[0]
    model.load_weights(state)
    after = paged_runner(model).step([("s", [1, 2, 3])])[0]
    assert {name: p.data_ptr() for name, p in model.named_parameters()} == pointers
    assert torch.equal(zeroed, torch.zeros_like(zeroed))
    assert torch.equal(after, before)


def test_load_weights_names_a_missing_weight(tiny_model_dir):
    from safetensors.torch import load_file

    path = tiny_model_dir("llama3_rope")
    model = load_model(path, None, torch.float32, "cpu").model
    state = load_file(str(path / "model.safetensors"))
    del state["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        model.load_weights(state)


def test_unpermute_inverts_llama_cpp_rope_row_permutation():
    heads, head_dim, hidden = 3, 8, 5
    weight = torch.arange(heads * head_dim * hidden, dtype=torch.float32).reshape(heads * head_dim, hidden)
    # llama.cpp convert_hf_to_gguf.py: reshape(heads, 2, D/2, ...).swapaxes(1, 2)
    permuted = weight.reshape(heads, 2, head_dim // 2, hidden).swapaxes(1, 2).reshape(weight.shape)
    assert torch.equal(unpermute_rope_rows(permuted, heads), weight)


def test_smollm2_config_from_gguf_metadata(smollm2):
    config = smollm2.config
    assert (config.architecture, config.num_hidden_layers, config.hidden_size) == ("llama", 30, 576)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert (config.vocab_size, config.intermediate_size, config.rope_theta) == (49152, 1536, 100000.0)
    assert config.tie_word_embeddings and config.rope_scaling is None
    assert config.eos_token_ids == (2,) and config.bos_token_id == 1


def _same_tokenizer(a, b) -> None:
    for text in ("Hello world", "  spaces\tand\nlines ", "日本語 ✓ émoji 🎉", "<|im_start|>user\nhi<|im_end|>"):
        assert a.encode(text) == b.encode(text), text
        assert a.decode(a.encode(text)) == b.decode(b.encode(text))
    assert (a.eos_token_ids, a.bos_token_id, a.vocab_size) == (b.eos_token_ids, b.bos_token_id, b.vocab_size)
    assert a.all_special_ids == b.all_special_ids
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    assert a.apply_chat_template(chat) == b.apply_chat_template(chat)


def test_a_gguf_tokenizer_is_cached_by_revision_and_loads_back_identical(smollm2_path, smollm2, monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    first = load_model(smollm2_path, revision=None)
    cache = tokenizer_cache_dir(first.revision)
    assert cache is not None and cache.parent == tmp_path / "tokenizers" and (cache / "tokenizer.json").is_file()
    assert first.revision in cache.name
    second = load_model(smollm2_path, revision=None)
    _same_tokenizer(second.tokenizer, first.tokenizer)
    _same_tokenizer(second.tokenizer, smollm2.tokenizer)  # loaded before the cache existed


def test_a_corrupt_tokenizer_cache_falls_back_to_converting(smollm2_path, smollm2, monkeypatch, tmp_path, caplog):
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    cache = tokenizer_cache_dir(smollm2.revision)
    cache.mkdir(parents=True)
    (cache / "tokenizer.json").write_text("{not json")
    with caplog.at_level("WARNING"):
        loaded = load_model(smollm2_path, revision=None)
    _same_tokenizer(loaded.tokenizer, smollm2.tokenizer)
    assert "ignoring the cached tokenizer" in caplog.text


def test_an_empty_cache_dir_setting_disables_the_cache(monkeypatch):
    monkeypatch.setenv(CACHE_DIR_ENV, "")
    assert tokenizer_cache_dir("ab" * 32) is None
