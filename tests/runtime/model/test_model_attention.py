"""Paged attention equals contiguous attention; padded rows are inert.

Reference: ``scaled_dot_product_attention`` over each request's keys/values laid out contiguously
(causal, query offset by the cached context), GQA by repeating KV heads (query head h uses KV head
h // group).
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from graphserving.runtime.model import attention
from graphserving.runtime.model.attention import (
    PrefillSpan,
    batch_layout,
    group_prefill_spans,
    paged_attention,
    varlen_available,
    varlen_plan,
    write_kv,
)
from graphserving.runtime.model.forward_metadata import ForwardMetadata
from graphserving.runtime.model.kv_layout import NULL_BLOCK, PAD_SLOT_ID

HQ, HKV, D = 6, 2, 8
BLOCK = 4
NUM_BLOCKS = 64
WIDTH = 10
SCALE = D ** -0.5


def _reference(q, k, v, context_len, scale=SCALE):
    """Contiguous attention for one request: q [ql, Hq, D], k/v [seq_len, Hkv, D] -> [ql, Hq*D]."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    ql, sl = q.shape[0], k.shape[0]
    mask = torch.arange(sl).view(1, -1) <= (torch.arange(ql).view(-1, 1) + context_len)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=mask, scale=scale)
    return out.transpose(0, 1).reshape(ql, -1)


class Batch:
    """Requests with random K/V histories stored in scrambled blocks of one paged cache."""

    def __init__(self, seed: int = 0, head_dim: int = D):
        self.gen = torch.Generator().manual_seed(seed)
        self.head_dim = head_dim
        self.cache = torch.zeros(2, NUM_BLOCKS, BLOCK, HKV, head_dim)
        self.free = [b for b in range(NUM_BLOCKS) if b != NULL_BLOCK]
        random.Random(seed).shuffle(self.free)
        self.requests = []  # (q, k_full, v_full, context_len, table)

    def add(self, context_len: int, query_len: int):
        seq_len = context_len + query_len
        table = [self.free.pop() for _ in range(-(-seq_len // BLOCK))]
        k = torch.randn(seq_len, HKV, self.head_dim, generator=self.gen)
        v = torch.randn(seq_len, HKV, self.head_dim, generator=self.gen)
        q = torch.randn(query_len, HQ, self.head_dim, generator=self.gen)
        self.requests.append((q, k, v, context_len, table))

    def slots(self, table, positions):
        return [table[p // BLOCK] * BLOCK + p % BLOCK for p in positions]

    def build(self, pad_reqs: int = 0, write_queries: bool = True):
        """Write histories (and, when asked, this step's K/V) into the cache; return (q, k_new, v_new, meta)."""
        qs, k_new, v_new, slot_mapping, seq_lens, query_lens, tables = [], [], [], [], [], [], []
        for q, k, v, context_len, table in self.requests:
            ctx_slots = torch.tensor(self.slots(table, range(context_len)), dtype=torch.int64)
            if context_len:
                write_kv(self.cache, k[:context_len], v[:context_len], ctx_slots)
            qs.append(q)
            k_new.append(k[context_len:])
            v_new.append(v[context_len:])
            slot_mapping += self.slots(table, range(context_len, k.shape[0]))
            seq_lens.append(k.shape[0])
            query_lens.append(q.shape[0])
            tables.append(table + [NULL_BLOCK] * (WIDTH - len(table)))
        for _ in range(pad_reqs):
            qs.append(torch.randn(1, HQ, self.head_dim, generator=self.gen))
            k_new.append(torch.randn(1, HKV, self.head_dim, generator=self.gen))
            v_new.append(torch.randn(1, HKV, self.head_dim, generator=self.gen))
            slot_mapping.append(PAD_SLOT_ID)
            seq_lens.append(0)
            query_lens.append(1)
            tables.append([NULL_BLOCK] * WIDTH)
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        meta = ForwardMetadata(
            input_ids=torch.zeros(starts[-1], dtype=torch.int64),
            positions=torch.zeros(starts[-1], dtype=torch.int64),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            query_lens=torch.tensor(query_lens, dtype=torch.int32),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            block_table=torch.tensor(tables, dtype=torch.int32),
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64),
            logits_indices=torch.tensor(starts[1:len(self.requests) + 1], dtype=torch.int64) - 1,
            num_actual_tokens=starts[len(self.requests)],
            num_actual_reqs=len(self.requests),
            max_query_len=max(query_lens),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
        )
        q, k_step, v_step = torch.cat(qs), torch.cat(k_new), torch.cat(v_new)
        if write_queries:
            write_kv(self.cache, k_step, v_step, meta.slot_mapping)
        return q, k_step, v_step, meta

    def expected(self, scale=SCALE):
        return torch.cat([_reference(q, k, v, ctx, scale) for q, k, v, ctx, _ in self.requests])


def test_uniform_decode_through_scrambled_block_tables_equals_contiguous_attention():
    batch = Batch(seed=1)
    for context_len in (0, 3, 4, 17, 30):
        batch.add(context_len, 1)
    q, _, _, meta = batch.build()
    assert meta.is_uniform_decode
    out = paged_attention(q, batch.cache[0], batch.cache[1], meta, SCALE)
    torch.testing.assert_close(out, batch.expected(), rtol=1e-5, atol=1e-5)


def test_prefill_with_cached_context_equals_contiguous_causal_attention():
    batch = Batch(seed=2)
    batch.add(0, 9)     # plain prefill
    batch.add(13, 6)    # chunked prefill: 13 tokens already cached
    q, _, _, meta = batch.build()
    out = paged_attention(q, batch.cache[0], batch.cache[1], meta, SCALE)
    torch.testing.assert_close(out, batch.expected(), rtol=1e-5, atol=1e-5)


def test_mixed_batch_of_decode_and_prefill_rows_equals_per_request_attention():
    batch = Batch(seed=3)
    batch.add(7, 1)
    batch.add(0, 5)
    batch.add(21, 1)
    batch.add(4, 3)
    q, _, _, meta = batch.build()
    assert not meta.is_uniform_decode
    out = paged_attention(q, batch.cache[0], batch.cache[1], meta, SCALE)
    torch.testing.assert_close(out, batch.expected(), rtol=1e-5, atol=1e-5)


def test_prefills_split_over_several_masked_calls_give_the_same_attention(monkeypatch):
    batch = Batch(seed=4)
    for context_len, query_len in ((0, 9), (5, 1), (13, 6), (0, 2), (3, 7)):
        batch.add(context_len, query_len)
    q, _, _, meta = batch.build()
    whole = paged_attention(q, batch.cache[0], batch.cache[1], meta, SCALE)
    monkeypatch.setattr(attention, "PREFILL_PAIRS_PER_CALL", 200)  # 3 calls for the 4 prefills
    _, _, _, meta = batch.build(write_queries=False)
    split = paged_attention(q, batch.cache[0], batch.cache[1], meta, SCALE)
    assert len(meta._batch_layout.masked) == 3
    torch.testing.assert_close(whole, batch.expected(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(split, whole, rtol=1e-5, atol=1e-5)


def test_prefill_spans_are_grouped_in_order_under_the_pair_bound():
    spans = [PrefillSpan(0, 0, 4, 4), PrefillSpan(1, 4, 4, 10), PrefillSpan(2, 8, 30, 30), PrefillSpan(3, 38, 2, 2)]
    groups = group_prefill_spans(spans, max_pairs=120)
    # (4+4) x (4+10) = 112 fits; adding 30x30 would not; 30x30 alone exceeds the bound but still runs
    assert [[s.req for s in g] for g in groups] == [[0, 1], [2], [3]]
    assert group_prefill_spans([], max_pairs=1) == []
    assert [[s.req for s in g] for g in group_prefill_spans(spans, max_pairs=10**6)] == [[0, 1, 2, 3]]


def test_varlen_plan_packs_query_rows_key_slots_and_prefix_sums():
    # request 0: 3 queries at rows 0..2 over 5 keys; request 2: 2 queries at rows 4..5 over 2 keys
    table = torch.tensor([[7, 3], [9, 9], [5, 0]], dtype=torch.int32)
    plan = varlen_plan([PrefillSpan(0, 0, 3, 5), PrefillSpan(2, 4, 2, 2)], table, block_size=4)
    assert plan.rows.tolist() == [0, 1, 2, 4, 5]
    assert plan.slots.tolist() == [28, 29, 30, 31, 12, 20, 21]
    assert plan.cu_seq_q.tolist() == [0, 3, 5] and plan.cu_seq_q.dtype == torch.int32
    assert plan.cu_seq_k.tolist() == [0, 5, 7] and plan.cu_seq_k.dtype == torch.int32
    assert (plan.max_q, plan.max_k) == (3, 5)


def test_batch_layout_separates_prefill_spans_decode_rows_and_padding():
    batch = Batch(seed=6)
    for context_len, query_len in ((0, 3), (4, 1), (2, 2)):
        batch.add(context_len, query_len)
    _, _, _, meta = batch.build(pad_reqs=1)
    layout = batch_layout(meta, torch.zeros(meta.num_tokens, HQ, D), BLOCK)
    assert [(s.req, s.first, s.query_len, s.seq_len) for s in layout.spans] == [(0, 0, 3, 3), (2, 4, 2, 4)]
    assert layout.decode_rows.tolist() == [3] and layout.decode_reqs.tolist() == [1]
    assert layout.decode_blocks == 2 and not layout.prefill_only  # 5 keys in blocks of 4
    batch = Batch(seed=6)
    batch.add(0, 3)
    batch.add(5, 2)
    _, _, _, meta = batch.build()
    only = batch_layout(meta, torch.zeros(meta.num_tokens, HQ, D), BLOCK)
    assert only.prefill_only and only.decode_rows is None and only.decode_blocks == 0


def test_the_flash_operator_has_the_schema_the_direct_call_uses():
    """The installed PyTorch's ``aten::_flash_attention_forward`` takes the arguments
    ``varlen_causal_attention`` passes (else it would fall back to ``varlen_attn``)."""
    assert attention.flash_forward_direct() and attention.DIRECT_FLASH


def test_the_varlen_path_is_not_taken_on_cpu_or_in_float32():
    assert not varlen_available(torch.zeros(2, HQ, D))
    assert not varlen_available(torch.zeros(2, HQ, D, dtype=torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_a_batch_of_prompts_only_equals_per_request_attention(dtype):
    """No decode or padded rows: the varlen call's output is the layer's output, ungathered."""
    batch = Batch(seed=7, head_dim=64)
    for context_len, query_len in ((0, 9), (13, 6), (3, 17)):
        batch.add(context_len, query_len)
    q, _, _, meta = batch.build()
    expected = batch.expected(64 ** -0.5)
    cache = batch.cache.to("cuda", dtype)
    meta = meta.to("cuda")
    out = paged_attention(q.to("cuda", dtype), cache[0], cache[1], meta, 64 ** -0.5)
    assert meta._batch_layout.prefill_only
    torch.testing.assert_close(out.float().cpu(), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_varlen_flash_prefill_equals_per_request_attention_in_half_precision(dtype):
    """Chunked prefills (cached context, bottom-right causal), plain prefills, decode rows and GQA
    (head size 64: the Triton decode kernel that serves the decode rows needs at least 16)."""
    batch = Batch(seed=5, head_dim=64)
    scale = 64 ** -0.5
    for context_len, query_len in ((0, 9), (13, 6), (5, 1), (0, 2), (30, 1), (3, 17)):
        batch.add(context_len, query_len)
    q, _, _, meta = batch.build()
    expected = batch.expected(scale)
    q = q.to("cuda", dtype)
    assert varlen_available(q)
    cache = batch.cache.to("cuda", dtype)
    meta = meta.to("cuda")
    out = paged_attention(q, cache[0], cache[1], meta, scale)
    assert meta._batch_layout.varlen.max_k == 3 + 17 and out.dtype == dtype
    torch.testing.assert_close(out.float().cpu(), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("fill", [0.0, 1e30, float("nan")], ids=["zero", "huge", "nan"])
def test_padded_decode_rows_give_finite_zeros_whatever_the_null_block_holds(fill):
    batch = Batch(seed=4)
    batch.add(5, 1)
    batch.add(11, 1)
    q, _, _, meta = batch.build(pad_reqs=3)
    batch.cache[:, NULL_BLOCK] = fill
    out = paged_attention(q, batch.cache[0], batch.cache[1], meta, SCALE)
    assert out.shape == (5, HQ * D)
    assert torch.isfinite(out).all()
    assert torch.equal(out[2:], torch.zeros(3, HQ * D))
    torch.testing.assert_close(out[:2], batch.expected(), rtol=1e-5, atol=1e-5)


def test_padded_rows_write_only_into_the_null_block():
    batch = Batch(seed=5)
    batch.add(6, 1)
    batch.add(2, 1)
    _, _, _, meta = batch.build(pad_reqs=4, write_queries=False)
    before = batch.cache.clone()
    real = meta.num_actual_tokens
    k = torch.full((meta.num_tokens, HKV, D), 7.0)
    v = torch.full((meta.num_tokens, HKV, D), -7.0)
    write_kv(batch.cache, k, v, meta.slot_mapping)
    changed_blocks = ((batch.cache != before).flatten(2).any(-1).any(0)).nonzero().flatten().tolist()
    real_blocks = {int(s) // BLOCK for s in meta.slot_mapping[:real]}
    assert set(changed_blocks) == real_blocks | {NULL_BLOCK}
    # Every real slot holds its own row's value.
    flat_k = batch.cache[0].view(-1, HKV, D)
    assert torch.equal(flat_k[meta.slot_mapping[:real]], k[:real])
