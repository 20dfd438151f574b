"""One Triton kernel between two verification passes of a resident run (spec_decode/resident.py).

``spec_step`` does, for every request row in one program, what the torch reference
(``resident.accept`` -> ``ngram.propose_ngram_batch`` -> ``resident.write_verification_inputs``)
does in about a hundred small kernels: take the step's outcome (accepted prefix, emitted tokens
into the context and the output, counters), look up the next drafts (prompt lookup over the row's
context, suffixes of ``MIN_N .. MAX_N <= 3`` tokens, most recent occurrence, periodic extension),
and write the next pass's input rows into the metadata. Integer work only: the result is the
reference's exactly (tested on the CPU through Triton's interpreter, and on CUDA).

Launch: grid ``(R,)``, 4 warps; the context is scanned in blocks of ``BLOCK`` (1024) positions,
three shifted loads per block (one per suffix token). A barrier separates the context writes of
the accept phase from the scan that reads them (same program, other threads).
"""

from __future__ import annotations

import torch
import triton.language as tl

from ...model.forward_metadata import ForwardMetadata
from ...model.kernels.backend import DeviceKernel
from ...model.kv_layout import PAD_SLOT_ID
from .drafter import PAD_DRAFT
from .resident import MAX_KERNEL_N

BLOCK = 1024
"""Context positions scanned per iteration of the n-gram search."""



def _spec_step_kernel(
    target_ptr, history_ptr, lens_ptr, remaining_ptr, enabled_ptr, steps_ptr, drafts_ptr, num_drafts_ptr,
    out_ptr, out_len_ptr, proposed_ptr, accepted_ptr, input_ids_ptr, positions_ptr, slots_ptr, seq_lens_ptr,
    table_ptr, stride_h, stride_o, stride_t, table_width, sink_h, sink_o,
    K: tl.constexpr, QP: tl.constexpr, MIN_N: tl.constexpr, MAX_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    ACCEPT: tl.constexpr, BLOCK: tl.constexpr, PAD_SLOT: tl.constexpr, PAD_TOKEN: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    q = K + 1
    j = tl.arange(0, QP)
    hist = history_ptr + r * stride_h
    lens = tl.load(lens_ptr + r)
    remaining = tl.load(remaining_ptr + r)
    if ACCEPT:
        live = remaining > 0
        target = tl.load(target_ptr + r * q + j, mask=j < q, other=0)
        nd = tl.load(num_drafts_ptr + r)
        drafts = tl.load(drafts_ptr + r * K + j, mask=j < K, other=PAD_TOKEN)
        miss = (drafts != target) | (j >= nd)
        accepted = tl.min(tl.where(miss, j, QP), axis=0)
        accepted = tl.where(live, accepted, 0)
        emitted = tl.where(live, accepted + 1, 0)
        keep = j < emitted
        out_len = tl.load(out_len_ptr + r)
        tl.store(hist + tl.where(keep, lens + j, sink_h), target, mask=keep)
        tl.store(out_ptr + r * stride_o + tl.where(keep, out_len + j, sink_o), target, mask=keep)
        tl.store(proposed_ptr + r, tl.where(live, nd, 0))
        tl.store(accepted_ptr + r, accepted)
        lens += emitted
        remaining -= emitted
        tl.store(lens_ptr + r, lens)
        tl.store(remaining_ptr + r, remaining)
        tl.store(out_len_ptr + r, out_len + emitted)
        tl.store(steps_ptr + r, tl.load(steps_ptr + r) + emitted)
        tl.debug_barrier()  # the emitted tokens are in the context before the scan reads it

    # the next drafts: the most recent earlier occurrence of the longest suffix (MAX_N .. MIN_N)
    t1 = tl.load(hist + lens - 1)
    t2 = tl.where(lens >= 2, tl.load(hist + tl.maximum(lens - 2, 0)), PAD_TOKEN)
    t3 = tl.where(lens >= 3, tl.load(hist + tl.maximum(lens - 3, 0)), PAD_TOKEN)
    hit1 = tl.full((), -1, tl.int64)
    hit2 = tl.full((), -1, tl.int64)
    hit3 = tl.full((), -1, tl.int64)
    for p0 in range(0, lens - 1, BLOCK):
        p = p0 + tl.arange(0, BLOCK).to(tl.int64)
        h0 = tl.load(hist + p, mask=p < lens, other=PAD_TOKEN)
        h1 = tl.load(hist + p + 1, mask=p + 1 < lens, other=PAD_TOKEN)
        h2 = tl.load(hist + p + 2, mask=p + 2 < lens, other=PAD_TOKEN)
        if MIN_N <= 1:
            hit1 = tl.maximum(hit1, tl.max(tl.where((h0 == t1) & (p <= lens - 2), p, -1), axis=0))
        if MIN_N <= 2 and MAX_N >= 2:
            hit2 = tl.maximum(hit2, tl.max(tl.where((h0 == t2) & (h1 == t1) & (p <= lens - 3), p, -1), axis=0))
        if MAX_N >= 3:
            m3 = (h0 == t3) & (h1 == t2) & (h2 == t1) & (p <= lens - 4)
            hit3 = tl.maximum(hit3, tl.max(tl.where(m3, p, -1), axis=0))
    start = tl.where(hit1 >= 0, hit1 + 1, -1)
    start = tl.where(hit2 >= 0, hit2 + 2, start)
    start = tl.where(hit3 >= 0, hit3 + 3, start)
    found = start >= 0
    max_drafts = tl.minimum(tl.maximum(tl.minimum(remaining - 1, K), 0) * tl.load(enabled_ptr + r), K)
    nd = tl.where(found, max_drafts, 0)
    period = tl.maximum(lens - start, 1)
    jd = tl.maximum(j - 1, 0)  # row j's draft index (row 0 carries the last token)
    token = tl.load(hist + start + jd % period, mask=(j >= 1) & (j - 1 < nd), other=PAD_TOKEN)  # nd = 0 unless found
    tl.store(drafts_ptr + r * K + jd, token, mask=(j >= 1) & (j <= K))
    tl.store(num_drafts_ptr + r, nd)

    # the next pass's rows
    live = remaining > 0
    pos0 = lens - 1
    drafted = (j <= nd) & live
    ids = tl.where(j == 0, t1, token)
    positions = pos0 + tl.minimum(j, nd)
    column = tl.minimum(positions // BLOCK_SIZE, table_width - 1)
    block = tl.load(table_ptr + r * stride_t + column, mask=j < q, other=0).to(tl.int64)
    slots = tl.where(drafted, block * BLOCK_SIZE + positions % BLOCK_SIZE, PAD_SLOT)
    rows = r * q + j
    tl.store(input_ids_ptr + rows, tl.where(drafted, ids, 0), mask=j < q)
    tl.store(positions_ptr + rows, tl.where(live, positions, 0), mask=j < q)
    tl.store(slots_ptr + rows, slots, mask=j < q)
    tl.store(seq_lens_ptr + r, tl.where(live, pos0 + q, 0).to(tl.int32))


_KERNEL = DeviceKernel(_spec_step_kernel)


def spec_step(meta: ForwardMetadata, state, target: torch.Tensor | None, step: int, block_size: int,
              min_n: int, max_n: int) -> None:
    """The kernel form of ``resident.advance`` (same arguments; in place on ``state`` and ``meta``).

    Raises:
        ValueError: ``max_n`` above :data:`MAX_KERNEL_N` or ``min_n`` below 1.
    """
    if not 1 <= min_n <= max_n <= MAX_KERNEL_N:
        raise ValueError(f"the step kernel looks up suffixes of 1..{MAX_KERNEL_N} tokens; got {min_n}..{max_n}")
    rows, k = state.drafts.shape
    if rows == 0:
        return
    history, out = state.history, state.out_tokens
    step_row = min(step, state.proposed.shape[0] - 1)
    table = meta.block_table
    _KERNEL.on(history.device)[(rows,)](
        target if target is not None else state.lens, history, state.lens, state.remaining, state.enabled,
        state.steps, state.drafts, state.num_drafts, out, state.out_len, state.proposed[step_row],
        state.accepted[step_row], meta.input_ids, meta.positions, meta.slot_mapping, meta.seq_lens, table,
        history.stride(0), out.stride(0), table.stride(0), table.shape[1], history.shape[1] - 1, out.shape[1] - 1,
        K=k, QP=_next_pow2(k + 1), MIN_N=min_n, MAX_N=max_n, BLOCK_SIZE=block_size,
        ACCEPT=target is not None, BLOCK=BLOCK, PAD_SLOT=PAD_SLOT_ID, PAD_TOKEN=PAD_DRAFT, num_warps=4,
    )


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()
