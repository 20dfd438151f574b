"""The mixture-of-experts layer: routing and experts equal transformers' Qwen3-MoE; the Triton
path (Triton's interpreter on CPU tensors) equals the torch reference for any routing.

Tolerances: the torch reference against transformers is exact in bfloat16 (same operations in the
same order) and within float32 rounding of the matmuls in float32. The Triton path against the
reference: float32 within ``1e-5`` (the order of the float32 sums); bfloat16 within 1/16 of the
output's largest magnitude (:func:`bf16_tolerance`: the interpreter rounds float32 -> bfloat16 by
truncation at each of the seven roundings of a pair, about 2.5% of the scale measured, and the
reference adds the k slots in bfloat16 while the kernel adds them in float32).
GPU tests (compiled kernels, CUDA graphs, the Qwen3-30B-A3B shape) are in ``test_moe_cuda.py``.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
import torch.nn.functional as F

from graphserving.runtime.model import kernels, moe

pytestmark = pytest.mark.skipif(not kernels.triton_importable(), reason="triton is not installed")

km = pytest.importorskip("graphserving.runtime.model.kernels.moe")
qwen3_moe = pytest.importorskip("transformers.models.qwen3_moe.modeling_qwen3_moe")

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
E, K, H, I = 8, 3, 64, 32  # a tiny Qwen3-MoE layer


def hf_config(normalize: bool = True):
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=K,
                            norm_topk_prob=normalize)
    config._experts_implementation = "eager"  # the index_add_ loop (what the reference follows)
    return config


def randn(*shape, gen, dtype=torch.float32, scale=1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def expert_weights(dtype, seed=0, num_experts=E, hidden=H, inter=I):
    gen = torch.Generator().manual_seed(seed)
    return (randn(num_experts, 2 * inter, hidden, gen=gen, dtype=dtype, scale=hidden ** -0.5),
            randn(num_experts, hidden, inter, gen=gen, dtype=dtype, scale=inter ** -0.5))


def pad_slots(valid: torch.Tensor) -> torch.Tensor:
    """A slot mapping whose padding rows (``valid`` False) hold a negative slot, as the model's do."""
    return torch.where(valid, 0, -1)


def bf16_tolerance(expected: torch.Tensor) -> dict:
    return dict(atol=float(expected.float().abs().max()) / 16, rtol=2e-2)


def kernel_tolerance(dtype, expected) -> dict:
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else bf16_tolerance(expected)


@pytest.fixture(scope="module")
def interpreter():
    """Skip (with the reason) when Triton's interpreter cannot run the routing kernel here."""
    try:
        km.fused_route_topk(torch.randn(2, E), K, True, None)
    except Exception as exc:  # a failure of the interpreter itself
        pytest.skip(f"Triton interpreter cannot run here: {type(exc).__name__}: {exc}")


# ---------------------------------------------------------------------- routing

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("normalize", [True, False], ids=["norm_topk_prob", "raw"])
def test_route_topk_equals_the_transformers_router(dtype, normalize):
    router = qwen3_moe.Qwen3MoeTopKRouter(hf_config(normalize))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        router.weight.copy_(randn(E, H, gen=gen))
        router = router.to(dtype)
        hidden = randn(9, H, gen=gen, dtype=dtype)
        _, hf_weights, hf_ids = router(hidden)
        weights, ids = moe.route_topk(F.linear(hidden, router.weight), K, normalize, None)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32 and ids.shape == (9, K)
    assert torch.equal(ids, hf_ids.to(torch.int32))
    assert torch.equal(weights.to(dtype), hf_weights), "the transformers router's weights before its cast"


def test_route_topk_sends_padding_rows_to_the_sentinel_with_weight_zero():
    logits = randn(5, E, gen=torch.Generator().manual_seed(2))
    valid = torch.tensor([True, False, True, True, False])
    weights, ids = moe.route_topk(logits, K, True, pad_slots(valid))
    real_weights, real_ids = moe.route_topk(logits, K, True, None)
    assert ids[~valid].tolist() == [[E] * K] * 2 and weights[~valid].tolist() == [[0.0] * K] * 2
    assert torch.equal(ids[valid], real_ids[valid]) and torch.equal(weights[valid], real_weights[valid])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("normalize", [True, False], ids=["norm_topk_prob", "raw"])
def test_routing_kernel_equals_the_reference(interpreter, dtype, normalize):
    logits = randn(7, E, gen=torch.Generator().manual_seed(3), dtype=dtype, scale=2.0)
    valid = torch.tensor([True, True, False, True, True, True, False])
    weights, ids = km.fused_route_topk(logits, K, normalize, pad_slots(valid))
    expected_weights, expected_ids = moe.route_topk_reference(logits, K, normalize, pad_slots(valid))
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(weights, expected_weights, atol=1e-6, rtol=1e-6)


def test_routing_kernel_takes_the_lowest_expert_among_equal_probabilities(interpreter):
    """Ties go to the lowest expert index: a row of equal logits routes to experts 0..k-1, a row
    whose two largest logits tie (experts 5 and 3) routes to 3 then 5; the first row's weights
    exact, the second's the softmax's within float32 rounding."""
    logits = torch.zeros(2, E)
    logits[1, 5] = logits[1, 3] = 4.0
    weights, ids = km.fused_route_topk(logits, K, False, None)
    assert ids[0].tolist() == list(range(K)) and torch.equal(weights[0], torch.full((K,), 1.0 / E))
    probs = torch.softmax(logits[1], dim=-1)
    assert ids[1].tolist() == [3, 5] + [e for e in range(E) if e not in (3, 5)][:K - 2]  # then the lowest of the rest
    torch.testing.assert_close(weights[1], probs[ids[1].long()], atol=0, rtol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("normalize", [True, False], ids=["norm_topk_prob", "raw"])
def test_routing_in_the_router_projection_equals_the_route_kernel(interpreter, dtype, normalize):
    """``fused_add_rms_norm_gemv_route``: the router kernel's logits, residual stream and normed rows
    are ``fused_add_rms_norm_gemv``'s, and the routing its last program computes is the route
    kernel's bit for bit (padding rows to the sentinel); four programs (two experts each) and two K
    tiles, so the routing waits for the other programs' logits; the ticket is 0 after every call."""
    from graphserving.runtime.model.kernels import skinny_gemm

    gen = torch.Generator().manual_seed(4)
    x, residual = randn(5, H, gen=gen, dtype=dtype), randn(5, H, gen=gen, dtype=dtype)
    norm_weight, router = randn(H, gen=gen, dtype=dtype), randn(E, H, gen=gen, dtype=dtype, scale=H ** -0.5)
    slots = pad_slots(torch.tensor([True, False, True, True, True]))
    config = skinny_gemm.GemvConfig(block_m=8, block_n=2, block_k=H // 2)
    ticket = torch.zeros(1, dtype=torch.int32)
    expected = skinny_gemm.fused_add_rms_norm_gemv(x, residual, norm_weight, router, None, 1e-6, config=config,
                                                   return_normed=True)
    expected_weights, expected_ids = km.fused_route_topk(expected[0], K, normalize, slots)
    for _ in range(2):
        *projected, weights, ids = skinny_gemm.fused_add_rms_norm_gemv_route(
            x, residual, norm_weight, router, 1e-6, top_k=K, normalize=normalize, slot_mapping=slots, ticket=ticket,
            config=config)
        assert all(torch.equal(ours, ref) for ours, ref in zip(projected, expected))
        assert torch.equal(ids, expected_ids) and torch.equal(weights, expected_weights)
        assert ids[1].tolist() == [E] * K and ticket.item() == 0


def test_routing_in_the_router_projection_rejects_what_it_cannot_route(interpreter):
    from graphserving.runtime.model.kernels import skinny_gemm

    x, norm_weight, router = torch.zeros(2, H), torch.ones(H), torch.zeros(E, H)
    ticket = torch.zeros(1, dtype=torch.int32)
    route = dict(top_k=K, normalize=True, slot_mapping=None, ticket=ticket)
    with pytest.raises(ValueError, match="ticket must be int32"):
        skinny_gemm.fused_add_rms_norm_gemv_route(x, None, norm_weight, router, 1e-6, **(route | {"ticket": ticket.long()}))
    with pytest.raises(ValueError, match=f"top_k={E + 1} with {E} experts"):
        skinny_gemm.fused_add_rms_norm_gemv_route(x, None, norm_weight, router, 1e-6, **(route | {"top_k": E + 1}))
    with pytest.raises(ValueError, match="slot_mapping must be an integer"):
        skinny_gemm.fused_add_rms_norm_gemv_route(x, None, norm_weight, router, 1e-6,
                                                  **(route | {"slot_mapping": torch.tensor([0])}))


def test_route_topk_rejects_a_bool_mask_for_the_slot_mapping():
    with pytest.raises(ValueError, match="slot_mapping must be an integer"):
        moe.route_topk(torch.zeros(2, E), K, True, torch.tensor([True, False]))


def test_route_topk_rejects_a_top_k_above_the_expert_count():
    with pytest.raises(ValueError, match=r"top_k must be in \[1, E=8\], got 9"):
        moe.route_topk(torch.zeros(2, E), 9, True, None)


# ---------------------------------------------------------------------- the torch reference

@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_experts_equal_the_transformers_sparse_moe_block(dtype):
    block = qwen3_moe.Qwen3MoeSparseMoeBlock(hf_config())
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(randn(*p.shape, gen=gen, scale=0.2))
        block = block.to(dtype)
        hidden = randn(1, 11, H, gen=gen, dtype=dtype)
        expected = block(hidden)[0]
        weights, ids = moe.route_topk(F.linear(hidden[0], block.gate.weight), K, True, None)
        out = moe.moe_experts_reference(hidden[0], block.experts.gate_up_proj, block.experts.down_proj, weights, ids)
    assert out.dtype == dtype
    if dtype == torch.bfloat16:
        assert torch.equal(out, expected), "same roundings in the same order"
    else:
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_reference_gives_padding_rows_exactly_zero_even_for_nan_inputs():
    w_gate_up, w_down = expert_weights(torch.float32)
    x = randn(4, H, gen=torch.Generator().manual_seed(5))
    x[1] = float("nan")
    weights, ids = moe.route_topk(randn(4, E, gen=torch.Generator().manual_seed(6)), K, True,
                                  torch.tensor([0, -1, 5, 9]))
    out = moe.moe_experts_reference(x, w_gate_up, w_down, weights, ids)
    assert torch.equal(out[1], torch.zeros(H)) and torch.isfinite(out).all()


def test_moe_experts_rejects_weights_of_another_hidden_size():
    w_gate_up, w_down = expert_weights(torch.float32)
    with pytest.raises(ValueError, match=r"w_gate_up \(8, 64, 64\) and w_down \(8, 64, 32\) do not fit x \(2, 48\)"):
        moe.moe_experts(torch.zeros(2, 48), w_gate_up, w_down, torch.zeros(2, K), torch.zeros(2, K, dtype=torch.int32))


# ---------------------------------------------------------------------- the Triton path

def routing(kind: str, num_tokens: int, seed: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, ids) of a named routing of ``num_tokens`` tokens over E experts."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "random":
        return moe.route_topk_reference(randn(num_tokens, E, gen=gen, scale=2.0), K, True, None)
    if kind == "one_expert":  # every token's slots go to experts 5, 0, 3: expert 5 holds every token
        ids = torch.tensor([[5, 0, 3]] * num_tokens, dtype=torch.int32)
    else:  # "spread": token t's slots go to experts t*k .. t*k+k-1 (mod E): every expert is used
        ids = (torch.arange(num_tokens * K, dtype=torch.int32) % E).view(num_tokens, K)
    weights = torch.softmax(randn(num_tokens, K, gen=gen), dim=-1)
    return weights, ids


PATHS = ["aligned", "direct", "direct-k-tiles"]


def path_config(path: str, num_tokens: int, num_experts: int = E, top_k: int = K, hidden: int = H,
                inter: int = I) -> "km.MoEConfig":
    """choose_config's tiles with the path forced (either path runs at any T); ``direct-k-tiles``: the
    direct path with K tiles of 16, so both of its kernels walk K in tiles (the gate/up kernel's loop;
    the down kernel's two tiles of I = 32, unrolled)."""
    chosen = km.choose_config(num_tokens, top_k, num_experts, hidden, inter)
    if path == "direct-k-tiles":
        return dataclasses.replace(chosen, direct=True, gate_up_block_k=16, down_block_n=2, down_block_k=16)
    return dataclasses.replace(chosen, direct=path == "direct")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["one_expert", "spread", "random"])
@pytest.mark.parametrize("num_tokens", [1, 37])  # 37 * 3 pairs: not a multiple of BLOCK_M = 16
def test_kernel_path_equals_the_reference(interpreter, path, dtype, kind, num_tokens):
    w_gate_up, w_down = expert_weights(dtype)
    x = randn(num_tokens, H, gen=torch.Generator().manual_seed(8), dtype=dtype)
    weights, ids = routing(kind, num_tokens)
    out = km.fused_moe(x, w_gate_up, w_down, weights, ids, config=path_config(path, num_tokens))
    expected = moe.moe_experts_reference(x, w_gate_up, w_down, weights, ids)
    assert out.dtype == dtype and out.shape == (num_tokens, H)
    torch.testing.assert_close(out, expected, **kernel_tolerance(dtype, expected))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_sentinel_rows_are_exactly_zero_and_change_no_other_row(interpreter, path, dtype):
    w_gate_up, w_down = expert_weights(dtype)
    gen = torch.Generator().manual_seed(9)
    x = randn(21, H, gen=gen, dtype=dtype)
    valid = torch.ones(21, dtype=torch.bool)
    valid[[0, 6, 7, 20]] = False
    weights, ids = km.fused_route_topk(randn(21, E, gen=gen, dtype=dtype), K, True, pad_slots(valid))
    config = path_config(path, 21)
    out = km.fused_moe(x, w_gate_up, w_down, weights, ids, config=config)
    garbage = x.clone()
    garbage[~valid] = float("nan")
    out_garbage = km.fused_moe(garbage, w_gate_up, w_down, weights, ids, config=config)
    assert torch.equal(out[~valid], torch.zeros(4, H, dtype=dtype))
    assert torch.equal(out_garbage, out), "what padding rows hold cannot reach any output"
    alone = km.fused_moe(x[valid], w_gate_up, w_down, weights[valid], ids[valid], config=config)
    torch.testing.assert_close(out[valid], alone, **kernel_tolerance(dtype, alone))


@pytest.mark.parametrize("path", PATHS)
def test_kernel_path_runs_the_qwen3_moe_shape_of_experts_per_token(interpreter, path):
    """k = 8 of E = 16 experts over H = 128, I = 48 (not a power of two): the masked tails."""
    w_gate_up, w_down = expert_weights(torch.float32, num_experts=16, hidden=128, inter=48)
    gen = torch.Generator().manual_seed(10)
    x = randn(6, 128, gen=gen)
    weights, ids = moe.route_topk(randn(6, 16, gen=gen), 8, True, None)
    config = path_config(path, 6, num_experts=16, top_k=8, hidden=128, inter=48)
    torch.testing.assert_close(km.fused_moe(x, w_gate_up, w_down, weights, ids, config=config),
                               moe.moe_experts_reference(x, w_gate_up, w_down, weights, ids), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------- alignment: fixed shapes

def expected_alignment(ids: torch.Tensor, num_experts: int, block_m: int):
    """The grouping by expert, in plain Python: (rows per expert, block experts)."""
    flat = ids.flatten().tolist()
    groups = [[p for p, e in enumerate(flat) if e == expert] for expert in range(num_experts)]
    block_expert = [e for e, group in enumerate(groups) for _ in range(-(-len(group) // block_m))]
    return groups, block_expert


def assert_aligned(aligned, ids, num_experts, block_m):
    groups, block_expert = expected_alignment(ids, num_experts, block_m)
    start = 0
    for expert, group in enumerate(groups):
        assert aligned.expert_start[expert] == start and aligned.expert_count[expert] == len(group)
        assert aligned.sorted_pairs[start:start + len(group)].tolist() == group, f"expert {expert}"
        start += -(-len(group) // block_m) * block_m
    blocks = aligned.block_expert.tolist()
    assert blocks[:len(block_expert)] == block_expert and set(blocks[len(block_expert):]) <= {num_experts}


@pytest.mark.parametrize("kind", ["one_expert", "spread", "random"])
def test_alignment_groups_the_pairs_by_expert_in_padded_blocks(interpreter, kind):
    _, ids = routing(kind, 37)
    ids[[3, 30]] = E  # sentinel rows: counted nowhere, no block
    assert_aligned(km.align_pairs(ids, E, 16), ids, E, 16)


@pytest.mark.parametrize("path", PATHS)
def test_a_repeated_expert_in_a_row_gets_a_row_per_slot(interpreter, path):
    """Not what top-k produces, but the kernels do not lose a pair to it: both slots count."""
    ids = torch.tensor([[2, 2, 5], [2, 0, 0], [E, 1, E]], dtype=torch.int32)
    assert_aligned(km.align_pairs(ids, E, 4), ids, E, 4)
    w_gate_up, w_down = expert_weights(torch.float32)
    x = randn(3, H, gen=torch.Generator().manual_seed(11))
    weights = torch.softmax(randn(3, K, gen=torch.Generator().manual_seed(12)), dim=-1)
    torch.testing.assert_close(km.fused_moe(x, w_gate_up, w_down, weights, ids, config=path_config(path, 3)),
                               moe.moe_experts_reference(x, w_gate_up, w_down, weights, ids), atol=1e-5, rtol=1e-5)


def test_alignment_over_several_chunks_equals_the_one_chunk_alignment(interpreter, monkeypatch):
    _, ids = routing("random", 150)
    ids[11] = E
    one_chunk = km.align_pairs(ids, E, 16)
    monkeypatch.setattr(km, "ALIGN_CHUNK", 64)  # 450 pairs: 8 chunks, the last one of 2 pairs
    chunked = km.align_pairs(ids, E, 16)
    assert_aligned(one_chunk, ids, E, 16)
    assert_aligned(chunked, ids, E, 16)  # the same grouping (padding rows hold whatever was there)
    assert torch.equal(chunked.block_expert, one_chunk.block_expert)


def test_alignment_buffers_have_the_same_shapes_for_every_routing(interpreter):
    shapes = {kind: {name: tuple(t.shape) for name, t in vars(km.align_pairs(routing(kind, 37)[1], E, 16)).items()}
              for kind in ("one_expert", "spread", "random")}
    assert shapes["one_expert"] == shapes["spread"] == shapes["random"] == km.align_buffer_shapes(37, K, E, 16)


@pytest.mark.parametrize("num_pairs,num_experts,block_m", [(5, 3, 4), (7, 2, 4), (6, 6, 2), (9, 4, 16)])
def test_max_blocks_is_the_worst_case_over_every_routing(num_pairs, num_experts, block_m):
    """Every distribution of the pairs over the experts (sentinels included) fits, and one fills it."""
    needed = [sum(-(-counts.count(e) // block_m) for e in range(num_experts))
              for counts in itertools.product(range(num_experts + 1), repeat=num_pairs)]
    assert max(needed) == km.max_blocks(num_pairs, num_experts, block_m)


def test_one_decode_token_reads_each_chosen_expert_once(interpreter):
    """T=1, k=8, E=128 (Qwen3-30B-A3B) on the aligned path: eight M-blocks, one per chosen expert,
    no other block (the direct path reads each pair's expert once by construction)."""
    config = path_config("aligned", 1, num_experts=128, top_k=8, hidden=2048, inter=768)
    ids = torch.tensor([[100, 3, 64, 7, 127, 0, 55, 12]], dtype=torch.int32)
    aligned = km.align_pairs(ids, 128, config.block_m)
    assert config.block_m == 16 and aligned.block_expert.tolist() == sorted(ids[0].tolist())


def test_choose_config_depends_on_shapes_only():
    decode = km.choose_config(64, 8, 128, 2048, 768)
    assert decode == km.choose_config(64, 8, 128, 2048, 768)
    assert decode.block_m == 16 and km.choose_config(8192, 8, 128, 2048, 768).block_m == 64


def test_the_direct_path_takes_the_decode_sizes_only():
    direct = [t for t in range(1, 65) if km.choose_config(t, 8, 128, 2048, 768).direct]
    assert direct == list(range(1, km.DIRECT_MAX_PAIRS // 8 + 1))
