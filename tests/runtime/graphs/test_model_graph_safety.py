"""The code that CUDA graphs capture reads no tensor data on the host.

On the CPU this is checked on PyTorch's ``meta`` device, where tensors have shapes but no data:
any ``.item()``, ``.tolist()``, ``bool(tensor)`` or data-dependent shape raises there. So a uniform
decode forward pass and every piecewise segment that runs on ``meta`` contains no host sync and
no value-dependent shape, which is what capture needs. On a GPU machine a real CUDA graph of the
decode forward pass is captured and replayed on new contents of the same buffers.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from graphserving.runtime.model.kv_cache import allocate_kv_cache
from graphserving.runtime.model.llama import LlamaForCausalLM
from graphserving.runtime.model.config import ModelConfig

CONFIG = ModelConfig.from_hf_config({
    "model_type": "qwen2", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
})


def _random_model(device) -> LlamaForCausalLM:
    model = LlamaForCausalLM(CONFIG, device=device)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.1)
    return model


def _on_meta(meta):
    """The same metadata with every tensor on the meta device and no host lists."""
    tensors = {name: t.to("meta") for name, t in meta.tensors().items()}
    return dataclasses.replace(meta, **tensors, query_lens_cpu=None, seq_lens_cpu=None)


def test_uniform_decode_forward_reads_no_tensor_data(paged_runner):
    runner = paged_runner(_random_model("cpu"))
    runner.step([("a", [1, 2, 3]), ("b", [4, 5])])
    meta = _on_meta(runner.metadata([("a", [6]), ("b", [7])], pad_reqs=2))
    model = LlamaForCausalLM(CONFIG, device="meta")
    kv_caches = allocate_kv_cache(CONFIG, 16, 4, torch.float32, "meta")
    hidden = model(meta, kv_caches)
    assert hidden.shape == (4, CONFIG.hidden_size) and hidden.device.type == "meta"
    assert model.compute_logits(hidden[meta.logits_indices]).shape == (2, CONFIG.vocab_size)


def test_piecewise_segments_read_no_tensor_data():
    model = LlamaForCausalLM(CONFIG, device="meta")
    tokens = 7  # a prefill-sized token count: segments are keyed by T only
    input_ids = torch.empty(tokens, dtype=torch.int64, device="meta")
    positions = torch.empty(tokens, dtype=torch.int64, device="meta")
    outs = model.run_segment(0, input_ids, positions, None, None)
    for i in range(1, model.num_segments):
        q, _, _, residual = outs
        assert q.shape == (tokens, CONFIG.num_attention_heads, CONFIG.head_dim)
        attn_out = torch.empty(tokens, CONFIG.num_attention_heads * CONFIG.head_dim, device="meta")
        outs = model.run_segment(i, input_ids, positions, attn_out, residual)
    assert outs[0].shape == (tokens, CONFIG.hidden_size)


def test_general_attention_path_is_eager_only(paged_runner):
    """Prefill attention reads host lengths, so it must not be inside a captured graph."""
    runner = paged_runner(_random_model("cpu"))
    meta = _on_meta(runner.metadata([("a", [1, 2, 3])]))
    model = LlamaForCausalLM(CONFIG, device="meta")
    with pytest.raises((NotImplementedError, RuntimeError)):
        model(meta, allocate_kv_cache(CONFIG, 16, 4, torch.float32, "meta"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_of_decode_forward_replays_new_inputs_like_eager(paged_runner):
    model = _random_model("cuda")
    runner = paged_runner(model)
    runner.step([("a", [1, 2, 3, 4, 5]), ("b", [6, 7])])
    first = runner.metadata([("a", [8]), ("b", [9])], pad_reqs=2)
    static = dataclasses.replace(first, **{name: t.clone() for name, t in first.tensors().items()})
    with torch.inference_mode():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            model(static, runner.kv_caches)  # warm-up outside capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_hidden = model(static, runner.kv_caches)
        second = runner.metadata([("a", [10]), ("b", [11])], pad_reqs=2)
        for name, tensor in second.tensors().items():
            getattr(static, name).copy_(tensor)
        graph.replay()
        replayed = static_hidden.clone()
        eager = model(second, runner.kv_caches)  # rewrites the same slots with the same values
    assert torch.isfinite(replayed).all()
    torch.testing.assert_close(replayed, eager, rtol=1e-5, atol=1e-5)
