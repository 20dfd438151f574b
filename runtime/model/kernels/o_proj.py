"""The O projection of a one-row decode step with flash-decoding's split combine in its prologue.

At batch 1 the decode attention splits each row's context over several programs
(``decode_attention.py``), and a combine kernel merges their partial outputs before the O
projection (the skinny GEMM, ``skinny_gemm.py``) reads the merged row. Here the O projection reads
the partials (:class:`~.decode_attention.DecodePartials`) and merges them itself: one kernel fewer
per layer, and one wait for a finished kernel fewer in the PDL chain (``pdl.py``)::

    decode attention (partials) -> combine -> O (gemv)      becomes      decode attention -> O (here)

Work split: as the skinny GEMM (one program per ``BLOCK_N`` weight rows, the whole K dimension, no
split-K), with K = Hq * D walked one tile of ``BLOCK_H`` heads at a time. Every program merges the
partials of the tile's heads for itself (they are small and read from L2: Hq * S * D float32 per
row) into the tile's input ``x`` [BLOCK_H, BLOCK_D], then accumulates ``w * x``. The first weight
tile and the row's sequence length load before the PDL wait (no kernel of the pass writes them), so
which splits hold keys is known when the wait ends; each chunk of log-sum-exps and partials then
loads in one round trip (:data:`PARTIAL_CHUNK_ELEMENTS`: every split of a 256-token context at
once for the shapes measured).

Numerics: the merge is the combine kernel's weighted mean (weights ``exp2(lse - max lse)``, float32,
the merged row rounded to the activation dtype as the combine kernel stores it), computed as an
online softmax over the chunks (running max, rescaled total) and summed in chunk order instead of
the combine kernel's one tree reduction, so a merged value may differ from the combine kernel's by
float32 rounding (and then by one unit in the last place of the bfloat16 row); the product is the
skinny GEMM's (float32, rounded once).
"""

from __future__ import annotations

import os

import torch
import triton.language as tl

from .backend import DeviceKernel, device_function, next_power_of_2, num_programs_target
from .decode_attention import MAX_SPLITS, DecodePartials, split_range
from .pdl import pdl_enter
from .skinny_gemm import choose_config, gemv

COMBINE_IN_O_ENV = "GRAPHSERVING_COMBINE_IN_O_PROJ"
COMBINE_IN_O_PROJ = os.environ.get(COMBINE_IN_O_ENV, "1") != "0"
"""Default policy (:func:`use_combine_gemv`): the O projection merges the partials where their
redundant reads are small. ``GRAPHSERVING_COMBINE_IN_O_PROJ=0`` always runs the combine kernel
first (A/B measurements). Read once at import, so warmup, capture and replay agree."""

COMBINE_MAX_PARTIAL_BYTES = 16 << 20
"""Default policy: the most partial bytes the programs of one call may read together, counting every
split as holding keys (``programs * Hq * S * D * 4``: each program reads all of them). Measured on
an H100 against the combine kernel (bench/RESULTS.md, "The split combine inside the O projection"):
the whole batch-1 replay 3 % shorter for SmolLM2-135M (0.8 MB), 2-3 % for Llama-3.2-1B (10.5 MB, 5
splits), unchanged for Qwen3-30B-A3B (21 MB); above the bound the combine kernel runs first."""

PARTIAL_CHUNK_ELEMENTS = 16384
"""Most float32 partials a program loads per round trip (``BLOCK_H * SPLIT_CHUNK * BLOCK_D``): 16 splits
at once for SmolLM2-135M (9 heads of 64, a tile of 16), 8 for Llama-3.2-1B (32 heads of 64), so the
merge is one round trip after the PDL wait for every context those splits cover. A power of two."""

WIDE_CHUNK_ELEMENTS = 4096
"""Above this many partials per chunk a program runs eight warps (64 float32 registers a thread)."""

ONE_WAVE_BLOCK_N = 16
"""Most weight rows per program when the skinny GEMM's rows would make more programs than the device
has multiprocessors: the programs then run sixteen warps (whatever the chunk) and merge half a chunk
(``PARTIAL_CHUNK_ELEMENTS // 2``), so that one program fits a multiprocessor without spilling and all
of them run in one wave, each with its weight tile loaded before the PDL wait (Llama-3.2-1B, 2048
outputs: 256 programs of 255 registers in two waves become 128 of 121 registers in one; compiled
offline for sm_90, bench/RESULTS.md)."""


def combine_gemv_rows(out_features: int, in_features: int, multiprocessors: int) -> int:
    """Weight rows per program of :func:`combine_gemv`: the skinny GEMM's one-row ``block_n``
    (``skinny_gemm.choose_config``), doubled up to :data:`ONE_WAVE_BLOCK_N` while its programs
    (``ceil(out_features / rows)``) outnumber the device's ``multiprocessors``. Shapes only."""
    block_n = choose_config(1, in_features, gated=False).block_n
    while -(-out_features // block_n) > multiprocessors and block_n < ONE_WAVE_BLOCK_N:
        block_n *= 2
    return block_n


def use_combine_gemv(num_splits: int, num_heads: int, head_dim: int, out_features: int) -> bool:
    """Whether :func:`combine_gemv` merges the partials in the O projection's kernel (else the combine
    kernel runs first): :data:`COMBINE_IN_O_PROJ` and at most :data:`COMBINE_MAX_PARTIAL_BYTES` of
    partials read together by the programs of the skinny GEMM's default rows (``programs * Hq * S *
    D * 4``; counted at the default even where :func:`combine_gemv_rows` takes more rows, which
    halves the programs: counted at 16 rows, Qwen3-30B-A3B's 10.5 MB at 5 splits would merge, and that
    replay measured 7 % longer on an H100, bench/RESULTS.md). Shapes only (the split count is fixed
    per captured batch size), so warmup, capture and replay agree."""
    programs = -(-out_features // choose_config(1, num_heads * head_dim, gated=False).block_n)
    return COMBINE_IN_O_PROJ and programs * num_heads * num_splits * head_dim * 4 <= COMBINE_MAX_PARTIAL_BYTES


@device_function
def _merged_heads(part_out_ptr, part_lse_ptr, heads, h_mask, d, d_mask, num_splits, with_keys,
                  HEAD_DIM: tl.constexpr, SPLIT_CHUNK: tl.constexpr):
    """The merged attention output of query ``heads`` [BLOCK_H] (row 0), float32 [BLOCK_H, BLOCK_D]:
    the splits with keys (the first ``with_keys``) merged ``SPLIT_CHUNK`` at a time, each chunk's
    log-sum-exps and partials loaded in one round trip, the running max and total rescaled per
    chunk (an online softmax over the splits)."""
    c = tl.arange(0, SPLIT_CHUNK)
    m = tl.full(heads.shape, float("-inf"), tl.float32)
    total = tl.zeros(heads.shape, tl.float32)
    x = tl.zeros([heads.shape[0], d.shape[0]], tl.float32)
    for s0 in range(0, with_keys, SPLIT_CHUNK):
        ss = s0 + c
        chunk = h_mask[:, None] & (ss < with_keys)[None, :]
        lse = tl.load(part_lse_ptr + heads[:, None] * num_splits + ss[None, :], mask=chunk, other=float("-inf"))
        parts = tl.load(part_out_ptr + ((heads[:, None, None] * num_splits + ss[None, :, None]) * HEAD_DIM
                                        + d[None, None, :]), mask=chunk[:, :, None] & d_mask[None, None, :], other=0.0)
        m_new = tl.maximum(m, tl.max(lse, axis=1))
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)  # padded heads: every weight exp2(-inf) = 0
        rescale = tl.exp2(m - m_safe)
        weight = tl.exp2(lse - m_safe[:, None])
        total = total * rescale + tl.sum(weight, axis=1)
        x = x * rescale[:, None] + tl.sum(weight[:, :, None] * parts, axis=1)
        m = m_new
    return x / tl.where(total > 0, total, 1.0)[:, None]


def _combine_gemv_kernel(
    part_out_ptr, part_lse_ptr, seq_lens_ptr, weight_ptr, bias_ptr, out_ptr, num_splits, stride_wn,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, OUT_COLS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, CONTEXT_TILE: tl.constexpr,
    SPLIT_CHUNK: tl.constexpr, HAS_BIAS: tl.constexpr, USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < OUT_COLS
    w_rows = (n.to(tl.int64) * stride_wn)[:, None, None]
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    cols = h[:, None] * HEAD_DIM + d[None, :]  # [BLOCK_H, BLOCK_D]: K index of head h0 + h, dimension d
    act_dtype = weight_ptr.dtype.element_ty

    # Weights are never written by a kernel, nor the step's sequence lengths: both load before the
    # PDL wait, so which splits hold keys is known when the partials become readable.
    w_mask = n_mask[:, None, None] & ((h < NUM_HEADS)[:, None] & d_mask[None, :])[None, :, :]
    w = tl.load(weight_ptr + w_rows + cols[None, :, :], mask=w_mask, other=0.0)
    _, with_keys = split_range(tl.load(seq_lens_ptr).to(tl.int32), num_splits, CONTEXT_TILE)
    pdl_enter(USE_PDL)

    acc = tl.zeros([BLOCK_N, BLOCK_H, BLOCK_D], tl.float32)
    for h0 in tl.static_range(0, NUM_HEADS, BLOCK_H):
        heads = h0 + h
        x = _merged_heads(part_out_ptr, part_lse_ptr, heads, heads < NUM_HEADS, d, d_mask, num_splits, with_keys,
                          HEAD_DIM, SPLIT_CHUNK)
        x = x.to(act_dtype).to(tl.float32)  # the merged row as the combine kernel stores it
        acc += w.to(tl.float32) * x[None, :, :]
        if h0 + BLOCK_H < NUM_HEADS:
            next_heads = heads + BLOCK_H
            w_mask = n_mask[:, None, None] & ((next_heads < NUM_HEADS)[:, None] & d_mask[None, :])[None, :, :]
            w = tl.load(weight_ptr + w_rows + (h0 + BLOCK_H) * HEAD_DIM + cols[None, :, :], mask=w_mask, other=0.0)

    out = tl.sum(tl.sum(acc, axis=2), axis=1)
    if HAS_BIAS:
        out += tl.load(bias_ptr + n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + n, out.to(out_ptr.dtype.element_ty), mask=n_mask)


# The split count varies with the block-table width; leaving it generic keeps one compiled variant.
_KERNEL = DeviceKernel(_combine_gemv_kernel, pdl=True, do_not_specialize=["num_splits"])


def _check(partials: DecodePartials, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Raise ValueError naming what does not fit :func:`combine_gemv`'s contract."""
    part_out, part_lse, seq_lens, context_tile = partials
    if part_out.dim() != 4 or part_lse.dim() != 3:
        raise ValueError(f"partials must be part_out [1, Hq, S, D] and part_lse [1, Hq, S]; got "
                         f"{tuple(part_out.shape)} and {tuple(part_lse.shape)}")
    num_rows, num_heads, num_splits, head_dim = part_out.shape
    if num_rows != 1 or tuple(part_lse.shape) != (1, num_heads, num_splits) or not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"partials must be one row: part_out [1, Hq, S, D] and part_lse [1, Hq, S] with 1 <= S <= "
                         f"{MAX_SPLITS}; got {tuple(part_out.shape)} and {tuple(part_lse.shape)}")
    if not all(t.dtype == torch.float32 and t.is_contiguous() for t in (part_out, part_lse)) or seq_lens.numel() != 1:
        raise ValueError("partials must be contiguous float32 tensors, with one row's sequence length")
    if context_tile < 16 or context_tile & (context_tile - 1):
        raise ValueError(f"the partials' context tile must be a power of two >= 16, got {context_tile}")
    if weight.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"weight must be float32, bfloat16 or float16, got {weight.dtype}")
    if weight.dim() != 2 or weight.shape[1] != num_heads * head_dim or weight.stride(1) != 1:
        raise ValueError(f"weight must be [N, {num_heads * head_dim}] (Hq * D), last dimension contiguous; got "
                         f"{tuple(weight.shape)}")
    if bias is not None and (bias.shape != weight.shape[:1] or bias.dtype != weight.dtype):
        raise ValueError(f"bias must be [N={weight.shape[0]}] in the weight's dtype; got {tuple(bias.shape)} "
                         f"{bias.dtype}")
    devices = {t.device for t in (part_out, part_lse, seq_lens, weight) + (() if bias is None else (bias,))}
    if len(devices) != 1:
        raise ValueError(f"partials, sequence length, weight and bias must sit on one device; got "
                         f"{sorted(map(str, devices))}")


def combine_gemv(partials: DecodePartials, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``merged @ weight.T + bias``, where ``merged`` [1, Hq * D] is the attention output the combine
    kernel would make of ``partials`` (``partials.combine(weight.dtype)``): one PDL kernel where
    :func:`use_combine_gemv` says so, else the combine kernel then ``skinny_gemm.gemv``.

    Args:
        partials: one row's :class:`~.decode_attention.DecodePartials` (``part_out`` float32
            [1, Hq, S, D], ``part_lse`` float32 [1, Hq, S], both contiguous).
        weight: [N, Hq * D], float32/bfloat16/float16, last dimension contiguous (the O projection).
        bias: [N] or ``None``.

    Returns:
        [1, N] in ``weight.dtype``, a fresh tensor.

    Raises:
        ValueError: partials of more than one row, of no split or more than ``MAX_SPLITS``, not
            contiguous float32, or with a context tile that is not a power of two >= 16; a weight of
            another width or of a dtype but float32/bfloat16/float16; a bias of another shape or
            dtype; tensors on different devices.
    """
    _check(partials, weight, bias)
    part_out, part_lse, seq_lens, context_tile = partials
    num_rows, num_heads, num_splits, head_dim = part_out.shape
    bias = bias if bias is None else bias.contiguous()
    out_cols = weight.shape[0]
    if not use_combine_gemv(num_splits, num_heads, head_dim, out_cols):
        return gemv(partials.combine(weight.dtype), weight, bias)
    multiprocessors = num_programs_target(weight.device) // 2  # CPU (interpreter): a few
    out = torch.empty((1, out_cols), dtype=weight.dtype, device=weight.device)
    block_d = next_power_of_2(head_dim)
    cfg = choose_config(1, num_heads * head_dim, gated=False)
    block_h = max(1, min(next_power_of_2(num_heads), cfg.block_k // block_d))
    block_n = combine_gemv_rows(out_cols, num_heads * head_dim, multiprocessors)
    chunk_elements = PARTIAL_CHUNK_ELEMENTS // (2 if block_n > cfg.block_n else 1)
    chunk = max(1, min(next_power_of_2(num_splits), chunk_elements // (block_h * block_d)))
    wide = block_h * chunk * block_d > WIDE_CHUNK_ELEMENTS
    _KERNEL.on(weight.device, tokens=1)[(-(-out_cols // block_n),)](
        part_out, part_lse, seq_lens, weight, weight if bias is None else bias, out, num_splits, weight.stride(0),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, OUT_COLS=out_cols,
        BLOCK_N=block_n, BLOCK_H=block_h, BLOCK_D=block_d, CONTEXT_TILE=context_tile, SPLIT_CHUNK=chunk,
        HAS_BIAS=bias is not None,
        num_warps=16 if block_n > cfg.block_n else (8 if wide else cfg.num_warps),
    )
    return out
