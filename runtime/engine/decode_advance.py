"""Advancing a uniform-decode batch to its next step on the device (multi-step decoding).

Between two steps of a multi-step run (``model_runner.ModelRunner.continue_decode``) every real row
takes the token it just sampled as its input and moves one position on; its slot follows from its
block table. :func:`advance_decode` does that in place on the batch's device metadata (a FULL key's
static buffers, or the run's own copy) and never waits for the device.

Two forms, one result: on CUDA one Triton kernel (``decode_advance_kernel.py``: one launch where the
torch form below takes eight, each a kernel on the device between two replays, measured in
bench/RESULTS.md), elsewhere the torch reference :func:`advance_decode_reference` (the CPU, and
``GRAPHSERVING_KERNELS=torch``). The tests run both on the same inputs (the kernel through Triton's
interpreter on the CPU, compiled on CUDA) and compare every field exactly: integer work only.
"""

from __future__ import annotations

import torch

from ..model import kernels
from ..model.forward_metadata import ForwardMetadata
from ..model.kv_layout import PAD_SLOT_ID


def advance_decode(
    meta: ForwardMetadata, token_ids: torch.Tensor, num_reqs: int, block_size: int, live: torch.Tensor | None = None,
    steps: torch.Tensor | None = None,
) -> None:
    """Turn a uniform-decode batch into its next step, in place and on the device (no host sync).

    Rows ``0 .. num_reqs - 1`` (the real ones) take ``token_ids`` as their input, move one position
    on (``positions``, ``seq_lens``) and get the slot of the new position from their block table
    (``block_table[r, pos // block_size] * block_size + pos % block_size``); padded rows beyond
    ``num_reqs`` keep their sentinels. The block table must already hold the new positions
    (``ModelRunner.refresh_block_tables``); the kernel gives a row whose new position lies beyond
    the table's width slot ``PAD_SLOT_ID`` (its K/V are then not written) rather than read past it.

    Args:
        meta: a uniform-decode batch (T = R), its tensors on the device; modified in place.
        token_ids: int64 [num_reqs], each row's sampled token.
        num_reqs: the real rows.
        block_size: tokens per KV block.
        live: int64 [num_reqs] of 0/1, or None (all 1): rows with 0 stay padded rows (input 0,
            position 0, no context, slot ``PAD_SLOT_ID``).
        steps: int64 [num_reqs], the rows' RNG counters (``SamplingTensors.steps``), each increased
            by one in place; None: none.
    """
    if num_reqs == 0:
        return
    if kernels.available(meta.input_ids.device):
        from .decode_advance_kernel import launch_advance_decode

        launch_advance_decode(meta, token_ids, num_reqs, block_size, live, steps)
    else:
        advance_decode_reference(meta, token_ids, num_reqs, block_size, live, steps)


def advance_decode_reference(
    meta: ForwardMetadata, token_ids: torch.Tensor, num_reqs: int, block_size: int, live: torch.Tensor | None = None,
    steps: torch.Tensor | None = None,
) -> None:
    """:func:`advance_decode` in torch operations (the reference the kernel is tested against)."""
    n = num_reqs
    positions = meta.positions[:n]
    if live is None:
        meta.input_ids[:n].copy_(token_ids)
        positions.add_(1)
        meta.seq_lens[:n].add_(1)
    else:
        torch.mul(token_ids, live, out=meta.input_ids[:n])
        positions.add_(live)
        meta.seq_lens[:n].add_(live.to(meta.seq_lens.dtype))
    blocks = meta.block_table[:n].gather(1, torch.div(positions, block_size, rounding_mode="floor")[:, None])
    slots = torch.add(positions % block_size, blocks[:, 0], alpha=block_size)
    if live is not None:
        slots = torch.where(live.bool(), slots, PAD_SLOT_ID)
    meta.slot_mapping[:n].copy_(slots)
    if steps is not None:
        steps.add_(1)
