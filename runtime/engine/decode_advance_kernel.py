"""The Triton form of ``decode_advance.advance_decode``: one launch between two decode steps.

Launch: grid ``(1,)``, one program over every real row in blocks of :data:`ROWS`, 4 warps. A decode
batch has at most ``max_num_seqs`` rows (hundreds), so one program reads and writes a few KiB: the
launch is the whole cost, and one launch replaces the eight small kernels of the torch form. The
row count is not specialised on: two compiled variants in all (with and without retired rows), not
one per batch size compiled on its first use while serving. Integer work only: the result equals
the reference's exactly.
"""

from __future__ import annotations

import torch
import triton.language as tl

from ..model.forward_metadata import ForwardMetadata
from ..model.kernels.backend import DeviceKernel
from ..model.kv_layout import PAD_SLOT_ID

ROWS = 128
"""Rows per iteration of the kernel's loop over the batch."""


def _advance_decode_kernel(
    input_ids_ptr, positions_ptr, seq_lens_ptr, slots_ptr, table_ptr, tokens_ptr, live_ptr, steps_ptr,
    num_reqs, stride_t, table_width,
    BLOCK_SIZE: tl.constexpr, ROWS: tl.constexpr, HAS_LIVE: tl.constexpr, HAS_STEPS: tl.constexpr,
    PAD_SLOT: tl.constexpr,
):
    for start in range(0, num_reqs, ROWS):
        r = start + tl.arange(0, ROWS)
        real = r < num_reqs
        token = tl.load(tokens_ptr + r, mask=real, other=0)
        if HAS_LIVE:
            live = tl.load(live_ptr + r, mask=real, other=0)
        else:
            live = tl.full([ROWS], 1, tl.int64)
        position = tl.load(positions_ptr + r, mask=real, other=0) + live
        seq_len = tl.load(seq_lens_ptr + r, mask=real, other=0) + live.to(tl.int32)
        column = position // BLOCK_SIZE
        inside = real & (column < table_width)
        block = tl.load(table_ptr + r.to(tl.int64) * stride_t + column, mask=inside, other=0).to(tl.int64)
        slot = tl.where(inside & (live != 0), block * BLOCK_SIZE + position % BLOCK_SIZE, PAD_SLOT)
        tl.store(input_ids_ptr + r, token * live, mask=real)
        tl.store(positions_ptr + r, position, mask=real)
        tl.store(seq_lens_ptr + r, seq_len, mask=real)
        tl.store(slots_ptr + r, slot, mask=real)
        if HAS_STEPS:
            tl.store(steps_ptr + r, tl.load(steps_ptr + r, mask=real, other=0) + 1, mask=real)


_KERNEL = DeviceKernel(_advance_decode_kernel, do_not_specialize=["num_reqs", "stride_t", "table_width"])


def launch_advance_decode(meta: ForwardMetadata, token_ids: torch.Tensor, num_reqs: int, block_size: int,
                          live: torch.Tensor | None, steps: torch.Tensor | None) -> None:
    """``advance_decode`` by the kernel (same arguments; in place on ``meta`` and ``steps``).

    Raises:
        ValueError: a metadata row tensor, ``token_ids``, ``live`` or ``steps`` is not contiguous,
            or the block table's last dimension is not (the kernel indexes them by row).
    """
    table = meta.block_table
    rows = (meta.input_ids, meta.positions, meta.seq_lens, meta.slot_mapping, token_ids, live, steps)
    if any(t is not None and not t.is_contiguous() for t in rows) or table.stride(1) != 1:
        raise ValueError("advance_decode's kernel needs contiguous row tensors and a block table contiguous in its "
                         "last dimension")
    _KERNEL.on(meta.input_ids.device)[(1,)](
        meta.input_ids, meta.positions, meta.seq_lens, meta.slot_mapping, table, token_ids,
        live if live is not None else token_ids, steps if steps is not None else token_ids,
        num_reqs, table.stride(0), table.shape[1],
        BLOCK_SIZE=block_size, ROWS=ROWS, HAS_LIVE=live is not None,
        HAS_STEPS=steps is not None, PAD_SLOT=PAD_SLOT_ID, num_warps=4,
    )
