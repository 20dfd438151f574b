"""Speculative decoding resident on the device: several verification steps without a host round trip.

A verification step's next input depends on how many drafts the target accepted, and prompt
lookup drafts from the tokens just emitted, so the host path (``SpeculativeDecoder.launch`` in
runtime/engine/speculative.py) waits for the device after every step and rebuilds the next step
on the host. Here everything between two forward passes stays on the device, so ``N`` steps are
queued at once and the host reads their tokens once (as multi-step decoding does for plain decode,
runtime/engine/model_runner.py):

1. :func:`write_verification_inputs` (in :func:`advance`): the step's metadata (the FULL key's static buffers, or the
   run's own device metadata) from each row's context and drafts: row ``j`` of request ``r`` is its
   last token (``j = 0``) or draft ``j - 1`` at position ``start + j``; undrafted positions are
   padded exactly as ``speculative.verification_metadata`` pads them;
2. the forward pass of ``R * (k + 1)`` token rows (a replay of the ``q = k + 1`` FULL key);
3. the plain sampler on every row, RNG counter ``steps + j`` (spec_decode/rejection.py's
   point-mass rule: seeded output is identical with and without speculation);
4. :func:`advance`: the longest accepted prefix, the emitted tokens appended to the context and
   to the run's output, the counters advanced (:func:`accept`), the next step's drafts proposed
   on the device (:func:`~.ngram.propose_ngram_batch`, the same rule as the host drafter) and
   written as in 1. On CUDA one Triton kernel does all of it (spec_decode/step_kernel.py).

Rows are retired on the device: a row whose ``max_tokens`` is reached emits nothing more, writes no
K/V and drafts nothing (its ``remaining`` is 0). A stop token or string found by the host later
cuts the row's output there, as in multi-step decoding. Only point-mass drafts (prompt lookup) and
batches without penalties, log-probabilities or grammars run here (``SpeculativeDecoder``
decides); the others keep the host path.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ...model.forward_metadata import ForwardMetadata
from ...model.kernels.backend import available
from ...model.kv_layout import PAD_SLOT_ID
from .drafter import PAD_DRAFT
from .ngram import DEFAULT_MAX_N, DEFAULT_MIN_N, propose_ngram_batch
from .rejection import accepted_prefix

MAX_KERNEL_N = 3
"""Longest suffix the CUDA step kernel looks up (spec_decode/step_kernel.py); longer: torch."""

HISTORY_ALIGN = 256
"""The context buffer's width is rounded up to a multiple of this (fewer distinct shapes)."""


@dataclass
class SpecState:
    """The device state of a resident verification run over ``R`` requests, ``k`` draft positions.

    Attributes:
        history: int64 [R, W + 1], each row's context (prompt and output) in its first ``lens[r]``
            columns; column ``W`` is a sink for masked writes.
        lens: int64 [R], tokens in each context (the last one's K/V is not computed yet).
        remaining: int64 [R], tokens each row may still emit (``max_tokens`` left); 0: retired.
        enabled: int64 [R], 1 where the row may draft (the host's policy for the run).
        steps: int64 [R], output tokens so far (the RNG counter of the next token).
        drafts / num_drafts: int64 [R, k] / [R], the next step's drafts (``PAD_DRAFT`` padded).
        out_tokens: int64 [R, C + 1], the tokens the run emitted, ``out_len[r]`` per row; column
            ``C`` is a sink.
        out_len: int64 [R].
        proposed / accepted: int64 [N, R], drafts verified and accepted per step of the run.
    """

    history: torch.Tensor
    lens: torch.Tensor
    remaining: torch.Tensor
    enabled: torch.Tensor
    steps: torch.Tensor
    drafts: torch.Tensor
    num_drafts: torch.Tensor
    out_tokens: torch.Tensor
    out_len: torch.Tensor
    proposed: torch.Tensor
    accepted: torch.Tensor

    @property
    def k(self) -> int:
        return int(self.drafts.shape[1])


def _width(n: int) -> int:
    return -(-n // HISTORY_ALIGN) * HISTORY_ALIGN


def initial_state(contexts: list[list[int]], remaining: list[int], steps: list[int], enabled: list[bool], k: int,
                  num_steps: int, device: torch.device) -> SpecState:
    """The state of a run of ``num_steps`` verifications from the rows' contexts (host lists); no
    drafts yet (the first :func:`advance` proposes them). Two host-to-device copies."""
    q = k + 1
    rows = len(contexts)
    width = _width(max(len(c) for c in contexts) + num_steps * q)
    history = torch.zeros(rows, width + 1, dtype=torch.int64)
    for r, c in enumerate(contexts):
        history[r, :len(c)] = torch.tensor(c, dtype=torch.int64)
    pinned = device.type == "cuda"
    history = history.pin_memory() if pinned else history
    small = torch.tensor([[len(c) for c in contexts], remaining, [int(e) for e in enabled], steps], dtype=torch.int64)
    small = (small.pin_memory() if pinned else small).to(device, non_blocking=True)
    lens, remaining_t, enabled_t, steps_t = (t.clone() for t in small.unbind(0))
    return SpecState(
        history=history.to(device, non_blocking=True), lens=lens, remaining=remaining_t, enabled=enabled_t,
        steps=steps_t, drafts=torch.full((rows, k), PAD_DRAFT, dtype=torch.int64, device=device),
        num_drafts=torch.zeros(rows, dtype=torch.int64, device=device),
        out_tokens=torch.zeros(rows, num_steps * q + 1, dtype=torch.int64, device=device),
        out_len=torch.zeros(rows, dtype=torch.int64, device=device),
        proposed=torch.zeros(num_steps, rows, dtype=torch.int64, device=device),
        accepted=torch.zeros(num_steps, rows, dtype=torch.int64, device=device),
    )


def extend(state: SpecState, num_steps: int, max_len: int) -> SpecState:
    """The state of a continuation of ``num_steps`` more steps: the same context and counters, new
    output and count buffers; the context buffer widened when a context could pass its width
    (``max_len``: the longest any row's context can get by the continuation's end)."""
    rows, q = state.lens.shape[0], state.k + 1
    device = state.lens.device
    history = state.history
    need = _width(max_len)
    if need > history.shape[1] - 1:
        history = torch.cat([history[:, :-1], torch.zeros(rows, need - history.shape[1] + 2, dtype=torch.int64,
                                                          device=device)], dim=1)
    return replace(state, history=history,
                   out_tokens=torch.zeros(rows, num_steps * q + 1, dtype=torch.int64, device=device),
                   out_len=torch.zeros(rows, dtype=torch.int64, device=device),
                   proposed=torch.zeros(num_steps, rows, dtype=torch.int64, device=device),
                   accepted=torch.zeros(num_steps, rows, dtype=torch.int64, device=device))


def _max_drafts(state: SpecState) -> torch.Tensor:
    """Drafts each row may propose: ``k``, at most its remaining tokens after the step's own, 0 where
    disabled or retired (as ``speculative.max_drafts`` decides on the host)."""
    return torch.clamp(torch.clamp(state.remaining - 1, max=state.k), min=0) * state.enabled


def write_verification_inputs(meta: ForwardMetadata, state: SpecState, block_size: int) -> None:
    """Write the verification step of ``state`` into the first ``R * (k + 1)`` token rows and ``R``
    request rows of ``meta`` (device tensors, in place; query lengths, query starts, logits indices
    and the block table stay as they are: the block table must hold every position the run writes).

    Row ``j`` of request ``r``: input ``history[r, lens[r] - 1]`` (``j = 0``) or draft ``j - 1``
    (0 where undrafted), position ``start + min(j, num_drafts)`` with ``start = lens - 1``, slot of
    that position or ``PAD_SLOT_ID`` where undrafted; ``seq_lens = start + k + 1``. A retired row
    is a padded row: input 0, position 0, slot ``PAD_SLOT_ID``, ``seq_lens`` 0.
    """
    rows, k = state.drafts.shape
    q = k + 1
    j = torch.arange(q, device=state.lens.device)[None, :]
    live = (state.remaining > 0)[:, None]
    start = state.lens - 1
    ids = torch.cat([state.history.gather(1, start[:, None]), state.drafts.clamp(min=0)], dim=1)
    drafted = (j <= state.num_drafts[:, None]) & live
    positions = start[:, None] + torch.minimum(j, state.num_drafts[:, None])
    table = meta.block_table[:rows]
    blocks = table.gather(1, torch.div(positions, block_size, rounding_mode="floor").clamp(max=table.shape[1] - 1))
    slots = torch.where(drafted, torch.add(positions % block_size, blocks, alpha=block_size), PAD_SLOT_ID)
    meta.input_ids[:rows * q].copy_(torch.where(drafted, ids, 0).view(-1))
    meta.positions[:rows * q].copy_(torch.where(live, positions, 0).view(-1))
    meta.slot_mapping[:rows * q].copy_(slots.view(-1))
    meta.seq_lens[:rows].copy_(torch.where(live[:, 0], start + q, 0))


def advance(meta: ForwardMetadata, state: SpecState, target: torch.Tensor | None, step: int, block_size: int,
            min_n: int = DEFAULT_MIN_N, max_n: int = DEFAULT_MAX_N) -> None:
    """Between two verification passes: take the last pass's outcome into ``state`` (when
    ``target`` is given; :func:`accept`), propose the next drafts (prompt lookup,
    :func:`~.ngram.propose_ngram_batch`), and write the next pass into ``meta``
    (:func:`write_verification_inputs`). All in place on the device, no host synchronisation.

    On CUDA one Triton kernel does the three (spec_decode/step_kernel.py, suffixes of up to 3
    tokens); elsewhere the torch reference runs, with the same result.

    Args:
        meta: the run's metadata (a FULL key's static buffers, or the run's own).
        target: int64 [R, k + 1], the sampler's token of every row of the last pass; None before
            the first pass.
        step: the last pass's index in the run (the row of ``proposed`` / ``accepted``).
    """
    if available(state.lens.device) and max_n <= MAX_KERNEL_N:
        from .step_kernel import spec_step

        spec_step(meta, state, target, step, block_size, min_n, max_n)
        return
    if target is not None:
        accept(state, target, step)
    drafts, num_drafts = propose_ngram_batch(state.history[:, :-1], state.lens, _max_drafts(state), state.k,
                                             min_n, max_n)
    state.drafts.copy_(drafts)
    state.num_drafts.copy_(num_drafts)
    write_verification_inputs(meta, state, block_size)


def accept(state: SpecState, target: torch.Tensor, step: int) -> None:
    """Take one verification pass's outcome into ``state`` (in place).

    Args:
        target: int64 [R, k + 1], the sampler's token of every verification row.
        step: the pass's index in the run (row of ``proposed`` / ``accepted``).

    A live row emits ``a + 1`` tokens (``a`` accepted drafts, the longest prefix equal to
    ``target``, then the target's token after them): appended to its context and its output,
    ``lens``, ``out_len`` and ``steps`` advance by ``a + 1`` and ``remaining`` falls by it.
    """
    q = state.k + 1
    live = state.remaining > 0
    num_accepted = torch.where(live, accepted_prefix(target, state.drafts, state.num_drafts), 0)
    emitted = torch.where(live, num_accepted + 1, 0)
    i = torch.arange(q, device=target.device)[None, :]
    keep = i < emitted[:, None]
    state.history.scatter_(1, torch.where(keep, state.lens[:, None] + i, state.history.shape[1] - 1), target)
    state.out_tokens.scatter_(1, torch.where(keep, state.out_len[:, None] + i, state.out_tokens.shape[1] - 1), target)
    state.proposed[step].copy_(torch.where(live, state.num_drafts, 0))
    state.accepted[step].copy_(num_accepted)
    state.lens += emitted
    state.out_len += emitted
    state.steps += emitted
    state.remaining -= emitted
