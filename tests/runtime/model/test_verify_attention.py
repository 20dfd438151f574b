"""Verification attention (k + 1 query rows per request as decode rows) equals the general prefill path.

The reference is ``attention.paged_attention`` over the same batch laid out as requests of query
length k + 1 with cached context (the chunked-prefill path, itself checked against contiguous
attention in test_model_attention.py). Random K/V histories live in scrambled blocks of one paged
cache; each case writes this step's K/V through the path under test and compares the output and
the cache.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from graphserving.runtime.model import kernels
from graphserving.runtime.model.attention import paged_attention, write_kv
from graphserving.runtime.model.forward_metadata import ForwardMetadata
from graphserving.runtime.model.kv_layout import NULL_BLOCK, PAD_SLOT_ID
from graphserving.runtime.model.llama import apply_rope
from graphserving.runtime.model.verify_attention import expand_for_verification, verify_attention

D = 8
NUM_BLOCKS = 96


class VerifyBatch:
    """R requests with random contexts, each verifying ``k`` drafts (``k + 1`` rows), plus padding.

    ``contexts`` are the cached tokens before this step; a context of None is a padded request.
    """

    def __init__(self, contexts, k, block_size, hq, hkv, seed=0, dtype=torch.float32, device="cpu", head_dim=D):
        gen = torch.Generator().manual_seed(seed)
        self.head_dim = head_dim
        self.q_len = k + 1
        self.block_size = block_size
        self.cache = torch.randn(2, NUM_BLOCKS, block_size, hkv, head_dim, generator=gen).to(dtype=dtype, device=device)
        free = [b for b in range(NUM_BLOCKS) if b != NULL_BLOCK]
        random.Random(seed).shuffle(free)
        width = max(-(-((c or 0) + self.q_len) // block_size) for c in contexts) + 1
        tables, seq_lens, slots, positions = [], [], [], []
        for context in contexts:
            if context is None:
                tables.append([NULL_BLOCK] * width)
                seq_lens.append(0)
                slots += [PAD_SLOT_ID] * self.q_len
                positions += [0] * self.q_len
                continue
            seq_len = context + self.q_len
            table = [free.pop() for _ in range(-(-seq_len // block_size))]
            tables.append(table + [NULL_BLOCK] * (width - len(table)))
            seq_lens.append(seq_len)
            positions += list(range(context, seq_len))
            slots += [table[p // block_size] * block_size + p % block_size for p in range(context, seq_len)]
        rows = len(contexts) * self.q_len
        self.q = torch.randn(rows, hq, head_dim, generator=gen).to(dtype=dtype, device=device)
        self.k = torch.randn(rows, hkv, head_dim, generator=gen).to(dtype=dtype, device=device)
        self.v = torch.randn(rows, hkv, head_dim, generator=gen).to(dtype=dtype, device=device)
        self.positions = torch.tensor(positions, dtype=torch.int64, device=device)
        self.slot_mapping = torch.tensor(slots, dtype=torch.int64, device=device)
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
        self.block_table = torch.tensor(tables, dtype=torch.int32, device=device)
        self.real = [c is not None for c in contexts]

    def prefill_meta(self) -> ForwardMetadata:
        """The same batch for the general path: real requests of query length k + 1."""
        real = [r for r, ok in enumerate(self.real) if ok]
        rows = torch.tensor([r * self.q_len + j for r in real for j in range(self.q_len)], device=self.q.device)
        query_lens = [self.q_len] * len(real)
        seq_lens = self.seq_lens[real]
        starts = [i * self.q_len for i in range(len(real) + 1)]
        meta = ForwardMetadata(
            input_ids=torch.zeros(len(rows), dtype=torch.int64),
            positions=self.positions[rows],
            seq_lens=seq_lens,
            query_lens=torch.tensor(query_lens, dtype=torch.int32),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            block_table=self.block_table[real],
            slot_mapping=self.slot_mapping[rows],
            logits_indices=torch.tensor(starts[1:], dtype=torch.int64) - 1,
            num_actual_tokens=len(rows),
            num_actual_reqs=len(real),
            max_query_len=self.q_len,
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens.tolist(),
        )
        return meta, rows

    def reference(self):
        """(output [T, Hq * D] with zero rows for padded requests, the cache after the write)."""
        cache = self.cache.clone()
        meta, rows = self.prefill_meta()
        write_kv(cache, self.k[rows], self.v[rows], meta.slot_mapping)
        out = torch.zeros(self.q.shape[0], self.q.shape[1] * self.head_dim, dtype=self.q.dtype)
        out[rows] = paged_attention(self.q[rows], cache[0], cache[1], meta, self.head_dim ** -0.5)
        return out, cache


CASES = [
    # (contexts, k, block_size, Hq, Hkv)
    pytest.param([5], 1, 4, 4, 4, id="one-request-k1-mha"),
    pytest.param([0, 3, 17], 2, 4, 6, 2, id="three-requests-k2-gqa"),
    pytest.param([30, 1, 8, 12, 4], 4, 4, 8, 1, id="five-requests-k4-mqa"),
    pytest.param([9, 40, 2], 7, 16, 6, 3, id="k7-block16"),
    pytest.param([7, 0, 15, 31], 3, 1, 4, 2, id="block1"),
    pytest.param([6, None, 13, None], 3, 4, 6, 2, id="padded-requests"),
]


@pytest.mark.parametrize("contexts,k,block_size,hq,hkv", CASES)
def test_verification_as_decode_rows_equals_the_prefill_path(contexts, k, block_size, hq, hkv):
    batch = VerifyBatch(contexts, k, block_size, hq, hkv, seed=len(contexts) + k)
    expected, expected_cache = batch.reference()
    rows = expand_for_verification(batch.seq_lens, batch.block_table, k + 1)
    out = verify_attention(batch.q, batch.k, batch.v, batch.cache, batch.slot_mapping, rows, D ** -0.5)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    real_blocks = [b for b in range(NUM_BLOCKS) if b != NULL_BLOCK]
    torch.testing.assert_close(batch.cache[:, real_blocks], expected_cache[:, real_blocks], rtol=0, atol=0)


def test_padded_request_rows_are_exactly_zero():
    batch = VerifyBatch([4, None], 2, 4, 4, 2)
    rows = expand_for_verification(batch.seq_lens, batch.block_table, 3)
    out = verify_attention(batch.q, batch.k, batch.v, batch.cache, batch.slot_mapping, rows, D ** -0.5)
    assert torch.equal(out[3:], torch.zeros_like(out[3:]))
    assert out[:3].abs().sum() > 0


def test_expanded_rows_see_their_context_plus_their_own_position():
    seq_lens = torch.tensor([7, 0, 3], dtype=torch.int32)  # contexts 4, padding, 0; q = 3
    table = torch.tensor([[5, 6], [0, 0], [9, 0]], dtype=torch.int32)
    rows = expand_for_verification(seq_lens, table, 3)
    assert rows.seq_lens.tolist() == [5, 6, 7, 0, 0, 0, 1, 2, 3]
    assert rows.seq_lens.dtype == torch.int32
    assert rows.req_index.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert rows.block_table.tolist() == [[5, 6]] * 3 + [[0, 0]] * 3 + [[9, 0]] * 3


def test_query_length_one_is_plain_decode():
    seq_lens = torch.tensor([4, 9], dtype=torch.int32)
    table = torch.tensor([[1, 2, 0], [3, 4, 5]], dtype=torch.int32)
    rows = expand_for_verification(seq_lens, table, 1)
    assert torch.equal(rows.seq_lens, seq_lens) and torch.equal(rows.block_table, table)


def test_bad_shapes_are_refused_with_the_shapes():
    with pytest.raises(ValueError, match="query_len"):
        expand_for_verification(torch.tensor([3]), torch.zeros(1, 2, dtype=torch.int32), 0)
    with pytest.raises(ValueError, match=r"\[R, W\]"):
        expand_for_verification(torch.tensor([3, 4]), torch.zeros(1, 2, dtype=torch.int32), 2)
    batch = VerifyBatch([4], 2, 4, 4, 2)
    rows = expand_for_verification(batch.seq_lens, batch.block_table, 2)  # 2 rows, but q has 3
    with pytest.raises(ValueError, match="expand_for_verification"):
        verify_attention(batch.q, batch.k, batch.v, batch.cache, batch.slot_mapping, rows, D ** -0.5)


def test_expansion_and_attention_read_no_tensor_data():
    """On the meta device any host read raises: what runs here can be captured in a graph."""
    batch = VerifyBatch([5, 9, None], 3, 4, 6, 2)
    on_meta = {name: getattr(batch, name).to("meta") for name in
               ("q", "k", "v", "cache", "slot_mapping", "seq_lens", "block_table")}
    rows = expand_for_verification(on_meta["seq_lens"], on_meta["block_table"], 4)
    out = verify_attention(on_meta["q"], on_meta["k"], on_meta["v"], on_meta["cache"], on_meta["slot_mapping"],
                           rows, D ** -0.5)
    assert out.shape == (12, 6 * D) and out.device.type == "meta"


def _interpreter_runs() -> bool:
    if not kernels.triton_importable():
        return False
    try:
        q = torch.zeros(1, 2, 2)
        kernels.rope_and_write_kv(q, q[:, :1], q[:, :1], torch.zeros(1, dtype=torch.int64), torch.zeros(4, 2),
                                  torch.zeros(4, 2), torch.zeros(2, 2, 1, 1, 2), torch.zeros(1, dtype=torch.int64))
    except Exception:  # any failure of the interpreter itself
        return False
    return True


@pytest.mark.skipif(not _interpreter_runs(), reason="the Triton interpreter cannot run the RoPE kernel here")
def test_rope_path_rotates_as_it_writes_like_the_reference_rotation():
    """``rope=`` (the fused-kernel path: q and k arrive before RoPE) gives what rotating first and
    writing with ``write_kv`` gives (the RoPE kernel through Triton's interpreter on CPU)."""
    batch = VerifyBatch([3, 10], 2, 4, 4, 2, seed=5)
    angles = torch.arange(64, dtype=torch.float32)[:, None] * (0.1 * torch.arange(1, D // 2 + 1))[None, :]
    emb = torch.cat([angles, angles], dim=-1)
    cos, sin = emb.cos(), emb.sin()
    rows = expand_for_verification(batch.seq_lens, batch.block_table, 3)
    cache = batch.cache.clone()
    fused = verify_attention(batch.q, batch.k, batch.v, cache, batch.slot_mapping, rows, D ** -0.5,
                             rope=(batch.positions, cos, sin))
    c, s = cos[batch.positions], sin[batch.positions]
    reference = verify_attention(apply_rope(batch.q, c, s), apply_rope(batch.k, c, s), batch.v, batch.cache,
                                 batch.slot_mapping, rows, D ** -0.5)
    torch.testing.assert_close(fused, reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache, batch.cache, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_verification_attention_replays_in_a_cuda_graph_like_eager(dtype):
    """Captured once on static buffers, replayed on two new batches of the same shape (R = 4,
    k = 3): the same output and the same cache as eager calls on copies, bit for bit."""
    k, hq, hkv, d = 3, 8, 2, 64  # the decode kernel needs D >= 16
    batches = [VerifyBatch(ctx, k, 16, hq, hkv, seed=i, dtype=dtype, device="cuda", head_dim=d)
               for i, ctx in enumerate([[40, 3, 100, 7], [5, None, 64, 33], [130, 1, 0, 16]])]
    width = max(b.block_table.shape[1] for b in batches)

    def padded(table):
        return torch.nn.functional.pad(table, (0, width - table.shape[1]), value=NULL_BLOCK)

    first = batches[0]
    static = dict(q=first.q.clone(), k=first.k.clone(), v=first.v.clone(), slots=first.slot_mapping.clone(),
                  seq_lens=first.seq_lens.clone(), table=padded(first.block_table), positions=first.positions.clone())
    cache = first.cache.clone()
    angles = torch.arange(256, device="cuda", dtype=torch.float32)[:, None] * torch.linspace(0.01, 1.0, d // 2,
                                                                                               device="cuda")
    cos = torch.cat([angles, angles], -1).cos().to(dtype)
    sin = torch.cat([angles, angles], -1).sin().to(dtype)

    def run():
        rows = expand_for_verification(static["seq_lens"], static["table"], k + 1)
        return verify_attention(static["q"], static["k"], static["v"], cache, static["slots"], rows, d ** -0.5,
                                rope=(static["positions"], cos, sin))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for batch in batches[1:]:
        for name, value in dict(q=batch.q, k=batch.k, v=batch.v, slots=batch.slot_mapping, seq_lens=batch.seq_lens,
                                table=padded(batch.block_table), positions=batch.positions).items():
            static[name].copy_(value)
        cache.copy_(batch.cache)
        graph.replay()
        eager_cache = batch.cache.clone()
        eager = verify_attention(batch.q, batch.k, batch.v, eager_cache, batch.slot_mapping,
                                 expand_for_verification(batch.seq_lens, padded(batch.block_table), k + 1),
                                 d ** -0.5, rope=(batch.positions, cos, sin))
        torch.testing.assert_close(out, eager, rtol=0, atol=0)
        # the null block takes every padded row's write, in no fixed order: garbage by design
        torch.testing.assert_close(cache[:, NULL_BLOCK + 1:], eager_cache[:, NULL_BLOCK + 1:], rtol=0, atol=0)
        assert torch.isfinite(out).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_kernel_path_equals_the_prefill_path():
    """The compiled decode kernel (``kernels.paged_decode_attention``) over the expanded rows
    against the general path on the same device (float32)."""
    d = 64  # the decode kernel needs D >= 16
    batch = VerifyBatch([40, 3, 100, None, 7], 3, 16, 6, 2, seed=3, device="cuda", head_dim=d)
    meta, row_ids = batch.prefill_meta()
    meta = dataclasses.replace(meta, **{name: t.cuda() for name, t in meta.tensors().items()})
    ref_cache = batch.cache.clone()
    write_kv(ref_cache, batch.k[row_ids.cuda()], batch.v[row_ids.cuda()], meta.slot_mapping)
    expected = paged_attention(batch.q[row_ids.cuda()], ref_cache[0], ref_cache[1], meta, d ** -0.5)
    rows = expand_for_verification(batch.seq_lens, batch.block_table, 4)
    out = verify_attention(batch.q, batch.k, batch.v, batch.cache, batch.slot_mapping, rows, d ** -0.5)
    torch.testing.assert_close(out[row_ids.cuda()], expected, rtol=1e-5, atol=1e-5)
