"""The MoE layer's compiled Triton kernels on CUDA: captured in a CUDA graph, replayed for any
routing; no host synchronisation; the Qwen3-30B-A3B layer shape against the torch reference.

Tolerances: bfloat16 within 1/32 of the output's largest magnitude (the GPU rounds to nearest
even; the reference adds the k slots in bfloat16, the kernel in float32); float32 within 1e-4
(IEEE float32 dots, both sides; only the order of the sums differs). Graph replays equal eager
calls of the same kernels exactly (the kernels are deterministic: no atomics).
"""

from __future__ import annotations

import pytest
import torch

from graphserving.runtime.model import kernels, moe

from test_moe import pad_slots

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not kernels.triton_importable(), reason="triton is not installed"),
]

km = pytest.importorskip("graphserving.runtime.model.kernels.moe")

QWEN3_30B_A3B = dict(num_experts=128, top_k=8, hidden=2048, inter=768)


def layer(num_experts, hidden, inter, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w_gate_up = torch.randn(num_experts, 2 * inter, hidden, device="cuda", generator=gen) * hidden ** -0.5
    w_down = torch.randn(num_experts, hidden, inter, device="cuda", generator=gen) * inter ** -0.5
    return w_gate_up.to(dtype), w_down.to(dtype)


def router_logits(kind: str, num_tokens: int, num_experts: int, top_k: int, seed: int) -> torch.Tensor:
    """float32 logits: ``random``; ``one_expert`` (every token's top k are experts 0..k-1, in that
    order: expert 0 holds every token); ``spread`` (token t's are t*k .. t*k+k-1 mod E)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, device="cuda", generator=gen)
    if kind == "random":
        return logits
    chosen = torch.arange(top_k, device="cuda").expand(num_tokens, top_k)
    if kind == "spread":
        chosen = (torch.arange(num_tokens, device="cuda")[:, None] * top_k + chosen) % num_experts
    high = 20.0 + torch.arange(top_k, 0, -1, device="cuda", dtype=torch.float32)
    return logits.scatter(1, chosen, high.expand(num_tokens, top_k).contiguous())


def bf16_tolerance(expected: torch.Tensor) -> dict:
    return dict(atol=float(expected.float().abs().max()) / 32, rtol=2e-2)


@pytest.mark.parametrize("num_tokens,padding", [(24, [3, 17, 23]), (4, [1, 3])], ids=["aligned", "direct"])
def test_captured_moe_replays_every_routing_like_eager(num_tokens, padding):
    """24 tokens x 4 slots take the aligned path, 4 x 4 the direct decode path (choose_config)."""
    num_experts, top_k, hidden, inter = 32, 4, 256, 128
    assert km.choose_config(num_tokens, top_k, num_experts, hidden, inter).direct == (num_tokens == 4)
    w_gate_up, w_down = layer(num_experts, hidden, inter, torch.bfloat16)
    logits = torch.zeros(num_tokens, num_experts, device="cuda", dtype=torch.bfloat16)
    x = torch.zeros(num_tokens, hidden, device="cuda", dtype=torch.bfloat16)
    valid = torch.ones(num_tokens, dtype=torch.bool, device="cuda")
    valid[padding] = False  # padding rows

    def step():
        weights, ids = moe.route_topk(logits, top_k, True, pad_slots(valid))
        return moe.moe_experts(x, w_gate_up, w_down, weights, ids), ids

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile every kernel before the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out, static_ids = step()

    gen = torch.Generator(device="cuda").manual_seed(1)
    for seed, kind in enumerate(["one_expert", "spread", "random", "one_expert"]):
        logits.copy_(router_logits(kind, num_tokens, num_experts, top_k, seed))
        x.copy_(torch.randn(num_tokens, hidden, device="cuda", generator=gen))
        graph.replay()
        eager_out, eager_ids = step()
        torch.cuda.synchronize()
        assert torch.equal(static_ids, eager_ids), kind
        assert torch.equal(static_out, eager_out), kind
        assert torch.equal(static_out[~valid], torch.zeros(len(padding), hidden, device="cuda", dtype=torch.bfloat16))
        weights, ids = moe.route_topk_reference(logits, top_k, True, pad_slots(valid))
        expected = moe.moe_experts_reference(x, w_gate_up, w_down, weights, ids)
        torch.testing.assert_close(static_out, expected, **bf16_tolerance(expected))
        if kind == "one_expert":
            assert (static_ids[valid] == torch.arange(top_k, device="cuda")).all()


def test_moe_never_synchronises_with_the_host():
    w_gate_up, w_down = layer(16, 128, 64, torch.bfloat16)
    logits = torch.randn(40, 16, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(40, 128, device="cuda", dtype=torch.bfloat16)
    valid = torch.arange(40, device="cuda") < 37
    moe.moe_experts(x, w_gate_up, w_down, *moe.route_topk(logits, 4, True, pad_slots(valid)))  # compile
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        moe.moe_experts(x, w_gate_up, w_down, *moe.route_topk(logits, 4, True, pad_slots(valid)))
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("num_tokens", [1, 4, 8, 64])  # 1 and 4: the direct decode path
def test_qwen3_30b_a3b_layer_matches_the_reference(num_tokens):
    shape = QWEN3_30B_A3B
    w_gate_up, w_down = layer(shape["num_experts"], shape["hidden"], shape["inter"], torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(num_tokens, shape["hidden"], device="cuda", generator=gen).to(torch.bfloat16)
    logits = torch.randn(num_tokens, shape["num_experts"], device="cuda", generator=gen).to(torch.bfloat16)
    weights, ids = moe.route_topk_reference(logits, shape["top_k"], True, None)
    out = moe.moe_experts(x, w_gate_up, w_down, weights, ids)
    expected = moe.moe_experts_reference(x, w_gate_up, w_down, weights, ids)
    torch.testing.assert_close(out, expected, **bf16_tolerance(expected))


def test_routing_kernel_matches_the_reference_at_the_qwen3_30b_a3b_shape():
    logits = torch.randn(64, 128, device="cuda", generator=torch.Generator(device="cuda").manual_seed(3))
    valid = torch.arange(64, device="cuda") % 5 != 0
    weights, ids = moe.route_topk(logits, 8, True, pad_slots(valid))
    expected_weights, expected_ids = moe.route_topk_reference(logits, 8, True, pad_slots(valid))
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(weights, expected_weights, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("num_tokens", [600, 4096])  # 4800 and 32768 pairs: the multi-program alignment
def test_prefill_sizes_match_the_reference(num_tokens):
    w_gate_up, w_down = layer(64, 512, 256, torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(4)
    x = torch.randn(num_tokens, 512, device="cuda", generator=gen).to(torch.bfloat16)
    valid = torch.rand(num_tokens, device="cuda", generator=gen) > 0.1
    logits = torch.randn(num_tokens, 64, device="cuda", generator=gen)
    weights, ids = moe.route_topk_reference(logits, 8, True, pad_slots(valid))
    out = moe.moe_experts(x, w_gate_up, w_down, weights, ids)
    expected = moe.moe_experts_reference(x, w_gate_up, w_down, weights, ids)
    torch.testing.assert_close(out, expected, **bf16_tolerance(expected))
    assert torch.equal(out[~valid], torch.zeros_like(out[~valid]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_float32_and_float16_match_the_reference(dtype):
    w_gate_up, w_down = layer(16, 192, 96, dtype)
    gen = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(33, 192, device="cuda", generator=gen).to(dtype)
    weights, ids = moe.route_topk(torch.randn(33, 16, device="cuda", generator=gen), 4, False, None)
    out = moe.moe_experts(x, w_gate_up, w_down, weights, ids)
    expected = moe.moe_experts_reference(x, w_gate_up, w_down, weights, ids)
    tolerance = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-3, rtol=1e-2)
    torch.testing.assert_close(out, expected, **tolerance)


@pytest.mark.parametrize("num_tokens", [20, 5])  # 5 x 4 pairs: the direct decode path
def test_padding_rows_holding_nan_reach_no_output(num_tokens):
    w_gate_up, w_down = layer(16, 128, 64, torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(6)
    x = torch.randn(num_tokens, 128, device="cuda", generator=gen).to(torch.bfloat16)
    valid = torch.arange(num_tokens, device="cuda") % 3 != 1
    logits = torch.randn(num_tokens, 16, device="cuda", generator=gen)
    weights, ids = moe.route_topk(logits, 4, True, pad_slots(valid))
    out = moe.moe_experts(x, w_gate_up, w_down, weights, ids)
    x[~valid] = float("nan")
    assert torch.equal(moe.moe_experts(x, w_gate_up, w_down, weights, ids), out)
    assert torch.equal(out[~valid], torch.zeros_like(out[~valid]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_tokens", [1, 3, 64])
def test_direct_and_aligned_paths_agree(dtype, num_tokens):
    """Either path forced at any T: the same pairs, the same roundings; only the float32 order of
    each projection's sum differs."""
    from dataclasses import replace

    shape = dict(num_experts=64, hidden=512, inter=256)
    w_gate_up, w_down = layer(shape["num_experts"], shape["hidden"], shape["inter"], dtype, seed=7)
    gen = torch.Generator(device="cuda").manual_seed(8)
    x = torch.randn(num_tokens, shape["hidden"], device="cuda", generator=gen).to(dtype)
    valid = torch.arange(num_tokens, device="cuda") != 1
    logits = torch.randn(num_tokens, shape["num_experts"], device="cuda", generator=gen)
    weights, ids = moe.route_topk(logits, 8, True, pad_slots(valid))
    chosen = km.choose_config(num_tokens, 8, shape["num_experts"], shape["hidden"], shape["inter"], x.element_size())
    direct = km.fused_moe(x, w_gate_up, w_down, weights, ids, config=replace(chosen, direct=True))
    aligned = km.fused_moe(x, w_gate_up, w_down, weights, ids, config=replace(chosen, direct=False))
    expected = moe.moe_experts_reference(x, w_gate_up, w_down, weights, ids)
    tolerance = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else bf16_tolerance(expected)
    torch.testing.assert_close(direct, aligned, **tolerance)
    torch.testing.assert_close(direct, expected, **tolerance)
    assert torch.equal(direct[~valid], torch.zeros_like(direct[~valid]))


@pytest.mark.parametrize("num_tokens", [1, 4])
def test_routing_in_the_router_projection_replays_like_the_route_kernel(num_tokens):
    """``fused_add_rms_norm_gemv_route`` at Qwen3-30B-A3B's router (128 experts of 2048, top 8),
    captured with PDL and replayed for new rows: its logits, stream and normed rows are
    ``fused_add_rms_norm_gemv``'s and its routing the route kernel's, exactly, on every replay (the
    program that routes waits for every other program's logits); the ticket is 0 after each."""
    from graphserving.runtime.model.kernels import skinny_gemm

    shape = QWEN3_30B_A3B
    gen = torch.Generator(device="cuda").manual_seed(5)
    hidden, experts, top_k = shape["hidden"], shape["num_experts"], shape["top_k"]
    x = torch.zeros(num_tokens, hidden, device="cuda", dtype=torch.bfloat16)
    residual = torch.zeros_like(x)
    norm_weight = (1 + 0.1 * torch.randn(hidden, device="cuda", generator=gen)).to(torch.bfloat16)
    router = (torch.randn(experts, hidden, device="cuda", generator=gen) * hidden ** -0.5).to(torch.bfloat16)
    slots = pad_slots(torch.arange(num_tokens, device="cuda") != 2)
    ticket = torch.zeros(1, dtype=torch.int32, device="cuda")

    def step():
        return skinny_gemm.fused_add_rms_norm_gemv_route(x, residual, norm_weight, router, 1e-6, top_k=top_k,
                                                         normalize=True, slot_mapping=slots, ticket=ticket)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile before the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    for _ in range(20):
        x.copy_(torch.randn(num_tokens, hidden, device="cuda", generator=gen))
        residual.copy_(torch.randn(num_tokens, hidden, device="cuda", generator=gen))
        graph.replay()
        logits, stream_rows, normed = skinny_gemm.fused_add_rms_norm_gemv(x, residual, norm_weight, router, None, 1e-6,
                                                                          return_normed=True)
        weights, ids = km.fused_route_topk(logits, top_k, True, slots)
        torch.cuda.synchronize()
        for ours, ref in zip(static, (logits, stream_rows, normed, weights, ids)):
            assert torch.equal(ours, ref)
        assert ticket.item() == 0
