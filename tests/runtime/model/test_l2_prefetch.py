"""Warming L2 with the next kernel's weights (runtime/model/kernels/l2_prefetch.py): the policy and the
line count as pure logic; on CUDA the attention and the MoE gate/up kernel that issue the
prefetches give exactly the results without them, eagerly and replayed from a CUDA graph (in the
interpreter the prefetch compiles away, so the CPU variant checks only that the argument is taken)."""

from __future__ import annotations

import pytest
import torch

from graphserving.runtime.model import kernels

from test_kernels import PagedContext, device, interpreter_problem  # noqa: F401 (fixtures)

pytest.importorskip("triton")
l2 = pytest.importorskip("graphserving.runtime.model.kernels.l2_prefetch")


def test_line_count_covers_every_byte_and_needs_one_range():
    assert l2.line_count(torch.empty(3, 100, dtype=torch.bfloat16)) == 5  # 600 bytes: 4 lines and a part
    assert l2.line_count(torch.empty(64, dtype=torch.float32)) == 2  # 256 bytes: exactly 2
    with pytest.raises(ValueError, match="contiguous"):
        l2.line_count(torch.empty(8, 8).t())


def test_warm_l2_only_on_cuda_for_batches_up_to_the_knob(monkeypatch):
    monkeypatch.setattr(l2, "L2_PREFETCH_MAX_TOKENS", 0)
    assert not l2.warm_l2_enabled(torch.device("cuda"), 1)  # the default: off
    monkeypatch.setattr(l2, "L2_PREFETCH_MAX_TOKENS", 4)
    assert l2.warm_l2_enabled(torch.device("cuda"), 1) and l2.warm_l2_enabled(torch.device("cuda"), 4)
    assert not l2.warm_l2_enabled(torch.device("cuda"), 5)
    assert not l2.warm_l2_enabled(torch.device("cuda"), 0)
    assert not l2.warm_l2_enabled(torch.device("cpu"), 1)


@pytest.mark.parametrize("num_splits", [1, 3], ids=["one-split", "three-splits"])
def test_attention_that_warms_the_o_projection_changes_no_bit(device, num_splits):  # noqa: F811
    """The decode attention asking L2 for a weight matrix (about 2 MB, more lines than its programs
    take in one loop iteration) gives the output without it, eagerly and from a graph replay."""
    ctx = PagedContext([37, 16, 1, 70, 0], 8, 2, 64, torch.bfloat16, device)
    weight = torch.randn(1024, 1000, dtype=torch.bfloat16, device=device)
    plain = ctx.kernel(num_splits=num_splits, prefetch=True)
    warmed = ctx.kernel(num_splits=num_splits, prefetch=True, warm_l2=weight)
    torch.testing.assert_close(warmed, plain, rtol=0, atol=0)
    if device.type == "cuda":
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = ctx.kernel(num_splits=num_splits, prefetch=True, warm_l2=weight)
        replayed.zero_()
        graph.replay()
        torch.testing.assert_close(replayed, plain, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_tokens", [1, 3])
def test_moe_gate_up_that_warms_the_down_weights_changes_no_bit(num_tokens, monkeypatch):
    """The direct MoE path (Qwen3-30B-A3B's expert shapes, fewer experts) with the gate/up kernel
    asking L2 for each pair's expert's down weights: the layer's output without it, bit for bit,
    eagerly and from a graph replay; a padding row (the sentinel expert) asks for nothing."""
    from graphserving.runtime.model.kernels import moe as km

    num_experts, top_k, hidden, inter = 16, 8, 2048, 768
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(num_tokens, hidden, device="cuda", generator=gen).bfloat16()
    w_gate_up = (torch.randn(num_experts, 2 * inter, hidden, device="cuda", generator=gen) * hidden ** -0.5).bfloat16()
    w_down = (torch.randn(num_experts, hidden, inter, device="cuda", generator=gen) * inter ** -0.5).bfloat16()
    logits = torch.randn(num_tokens, num_experts, device="cuda", generator=gen)
    weights, ids = logits.softmax(-1).topk(top_k, dim=-1)
    ids = ids.to(torch.int32)
    ids[-1] = num_experts if num_tokens > 1 else ids[-1]  # the last row of three is padding
    assert km.choose_config(num_tokens, top_k, num_experts, hidden, inter).direct
    monkeypatch.setattr(l2, "L2_PREFETCH_MAX_TOKENS", 0)
    plain = km.fused_moe(x, w_gate_up, w_down, weights, ids)
    monkeypatch.setattr(l2, "L2_PREFETCH_MAX_TOKENS", 8)
    warmed = km.fused_moe(x, w_gate_up, w_down, weights, ids)
    torch.testing.assert_close(warmed, plain, rtol=0, atol=0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = km.fused_moe(x, w_gate_up, w_down, weights, ids)
    replayed.zero_()
    graph.replay()
    torch.testing.assert_close(replayed, plain, rtol=0, atol=0)


def test_the_model_warms_the_o_projection_only_where_the_policy_says(monkeypatch):
    """run_attention hands the layer's O weight to the attention exactly when ``warm_l2_enabled``
    accepts the batch (the kernels' path; recorded, not run)."""
    from graphserving.runtime.model import llama

    seen = []

    def fake_attention(*args, warm_l2=None, **kwargs):
        seen.append(warm_l2)
        return args[0]

    monkeypatch.setattr(llama, "paged_attention", fake_attention)
    monkeypatch.setattr(kernels, "use_fused_rope_decode", lambda head_dim: False, raising=False)
    monkeypatch.setattr(kernels, "rope_and_write_kv", lambda q, *a, **k: (q, None), raising=False)
    model = _tiny_model()
    monkeypatch.setattr(model, "uses_kernels", lambda: True)
    meta = _decode_meta()
    q = torch.zeros(1, model.config.num_attention_heads, model.head_dim)
    kv = torch.zeros(1, model.config.num_key_value_heads, model.head_dim)
    for enabled in (False, True):
        monkeypatch.setattr(kernels, "warm_l2_enabled", lambda device, num_tokens, on=enabled: on, raising=False)
        model.run_attention(0, q, kv, kv, meta, torch.zeros(2, 4, 16, model.config.num_key_value_heads,
                                                                model.head_dim))
    assert seen[0] is None and seen[1] is model.layers[0].o_proj


def _tiny_model():
    from graphserving.runtime.model.llama import LlamaForCausalLM
    from graphserving.runtime.model.presets import preset_config

    return LlamaForCausalLM(preset_config("qwen3-moe-tiny"), dtype=torch.float32, device="cpu")


def _decode_meta():
    from graphserving.runtime.model.forward_metadata import ForwardMetadata

    return ForwardMetadata(
        input_ids=torch.tensor([5]), positions=torch.tensor([3]), seq_lens=torch.tensor([4], dtype=torch.int32),
        query_lens=torch.tensor([1], dtype=torch.int32), query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
        block_table=torch.tensor([[1]], dtype=torch.int32), slot_mapping=torch.tensor([19]),
        logits_indices=torch.tensor([0]), num_actual_tokens=1, num_actual_reqs=1, max_query_len=1,
        query_lens_cpu=[1], seq_lens_cpu=[4],
    )
