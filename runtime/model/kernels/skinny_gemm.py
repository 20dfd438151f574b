"""Skinny GEMM for decode batches (at most :data:`MAX_ROWS` rows), with the norm before it and
the SwiGLU after it folded in: the projections of a decode step as PDL kernels.

A decode step at batch 1-8 is a chain of small kernels; with programmatic dependent launch
(``pdl.py``) each Triton kernel's launch and prologue overlap the one before it, but a cuBLAS GEMM
between two of ours breaks the chain (it is launched without the attribute and does not release
its dependents early). These kernels replace the four projections of a dense decoder layer and the
LM head where :func:`use_gemv` says so, so that a layer is a
chain of PDL kernels only::

    add + norm + QKV (here) -> RoPE + KV write -> decode attention -> O (here)
    -> add + norm + gate/up + SwiGLU (here) -> down (here)

Work split: one program per ``BLOCK_N`` output columns (weight rows), all ``M`` token rows and the
whole K dimension: no split-K, so no reduction kernel and no atomics. The first K tile of the
program's weight rows (the first two with ``GemvConfig.ahead = 2``) is loaded *before*
:func:`pdl_enter`: no kernel writes weights, so that load overlaps the previous kernel's tail (the
point of the prologue overlap at batch 1, where the kernel is a handful of DRAM round trips). Each
later K tile's load is issued before the products of the one ``ahead`` tiles earlier. The
products are formed one token row at a time on the weight tile's own layout (the row is a
``[1, BLOCK_K]`` tile broadcast over the ``[BLOCK_N, BLOCK_K]`` weight tile) and reduced over the K
tile into a float32 ``[BLOCK_M, BLOCK_N]`` accumulator: a product tensor of
``[BLOCK_M, BLOCK_N, BLOCK_K]`` would need a 3-D layout of its own, and the compiler copies every
weight tile through shared memory into it (bench/RESULTS.md, "The skinny GEMM's weight tiles
through shared memory"). Not a ``tl.dot``: at ``M <= 8`` the tensor cores would run at most half
full (16-row minimum), and the kernel is bound by the weight bytes.

With a norm (``fused_add_rms_norm_gemv``) every program first computes the RMS of the ``M`` rows
(one pass over ``x`` and ``residual``, which are small and read from L2 by every program); the
programs of the first column block also store the residual stream ``x + residual``.

Numerics equal ``kernels.fused_add_rms_norm`` (the norm), ``F.linear`` (the product) and
``kernels.silu_and_mul`` (the gate) up to the order of the float32 summation, with the same
roundings as ``norm_linear.py`` (its module docstring): the residual add rounds to the activation
dtype, the normalised row is rounded, scaled by the norm weight and rounded again; the product
accumulates in float32 (exact float32 products for float32 inputs, no TF32), the bias is added in
float32, and the result is rounded once to the output dtype (``out_dtype``: float32 logits come
out of the LM head without a separate cast kernel).

Meta-parameters come from :func:`choose_config` (shapes and one A/B variable: no autotuning, so
everything compiles during the eager warmup); :func:`use_gemv` is the shape and device policy the
model consults.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton.language as tl

from .backend import DeviceKernel, device_function, device_name, env_count, next_power_of_2
from .moe import route_in_last_program
from .norm_linear import ACTIVATIONS, check_norm_linear_inputs
from .pdl import pdl_enter

GEMV_ENV = "GRAPHSERVING_GEMV"
"""Environment variable: ``0`` keeps cuBLAS for every projection, ``all`` sends every projection of
at most :data:`GEMV_MAX_TOKENS` rows here whatever its weight size (A/B benchmarks, bisecting);
``1`` (default) is :func:`use_gemv`'s policy. Read per call, like ``backend.KERNELS_ENV``: set it
before warmup and capture."""

MAX_ROWS = 8
"""The most token rows the kernels accept (``backend.PDL_MAX_TOKENS``: they exist to keep the PDL
chain of small batches unbroken)."""

GEMV_MAX_TOKENS = 1
"""Default policy: the largest batch :func:`use_gemv` sends here. Measured on the H200
(``bench/kernel_bench.py --only gemv --batch-sizes 1,8``, bench/RESULTS.md "Skinny GEMM"): at one
row 2.3-2.8x faster than norm + cuBLAS for SmolLM2's projections (2.0 vs 5.1 us norm + QKV), at
parity (0.9-1.3x) for Llama-3-8B's; at 8 rows 0.2-1.1x: the float32 products on the CUDA cores
and the register tile (``MAX_TILE_ELEMENTS``) cost more than cuBLAS's tensor cores save."""

GEMV_MAX_WEIGHT_ELEMENTS = 512 << 20
"""Default policy: the largest weight (elements; 1 GiB in bfloat16) :func:`use_gemv` sends here, so
that with :data:`GEMV_MAX_HIDDEN` every projection and LM head of a model of hidden size up to 2048
takes the skinny GEMM. Raised from 64 MiB when the LM heads on the skinny GEMM (Llama-3.2-1B 501 MiB,
Qwen3-30B-A3B 593 MiB) measured the whole batch-1 replay 1.3 % and 0.3 % shorter on an H100 than
cuBLAS's (bench/RESULTS.md, "The O projection in one wave; a lighter fill; the LM head on the skinny
GEMM"). Before that: 40 MiB, raised to 64 when Llama-3.2-1B's gate/up projection measured 2.9 %
shorter (bench/RESULTS.md, "Decode attention: the first tile before the PDL wait"); Llama-3-8B's
weights (33-1000 MiB) made its replay 8 % longer, which :data:`GEMV_MAX_HIDDEN` now rules out.
Measured at one row (the default :data:`GEMV_MAX_TOKENS`); with ``GRAPHSERVING_GEMV_MAX_TOKENS`` above 1
an LM head of several rows (a verification pass) takes the skinny GEMM too, one weight row a program:
untimed."""

GEMV_MAX_HIDDEN = 2048
"""Default policy: the largest model hidden size :func:`use_gemv` serves. In the graph of a whole
batch-1 step the skinny GEMM shortened the three shapes with hidden sizes up to 2048 (SmolLM2-135M
43 %, Llama-3.2-1B 14 %, Qwen3-30B-A3B 10 %) and lengthened both of 4096 (Llama-3-8B 2.6 %,
Qwen3-8B 0.9 %: only their O projection is under the weight bound, alone among cuBLAS GEMMs),
bench/RESULTS.md "Skinny GEMM". Devices of :data:`WIDE_HIDDEN_DEVICES` have their own bound."""

WIDE_HIDDEN_DEVICES: dict[str, frozenset[int]] = {"NVIDIA H100 80GB HBM3": frozenset({4096})}
"""Devices (by ``torch.cuda.get_device_name``) on which models of the listed hidden sizes, above
:data:`GEMV_MAX_HIDDEN`, measured a shorter batch-1 step with the skinny GEMM for every projection but
those with only a norm folded in (``norm_only``: QKV, an MoE router), which keep the plain bound.
Measured on an H100 80GB HBM3 (SXM) at tensor-parallel size 1: the whole batch-1 replay of Llama-3-8B
5.5 % shorter and Qwen3-8B's 6.1 % with their O, gate/up, down (and Llama-3-8B's LM head; Qwen3-8B's,
1,187 MiB, is above the weight bound) here and QKV on cuBLAS; with QKV here too only 3.7 % and 4.7 %
(bench/RESULTS.md, "Hidden size 4096 on the skinny GEMM on an H100"). Other H100 variants (PCIe, NVL)
and hidden sizes between 2048 and 4096 were not measured, so they are not listed. The H200 is not:
session 23 measured every hidden-4096 projection here (QKV and the LM head included) 3 % longer;
``GRAPHSERVING_GEMV_WIDE_HIDDEN`` (:data:`GEMV_WIDE_ENV`) measures this policy on any device."""

GEMV_MODES = ("0", "1", "all")

GEMV_HIDDEN_ENV = "GRAPHSERVING_GEMV_MAX_HIDDEN"
"""Environment variable overriding :data:`GEMV_MAX_HIDDEN` (a positive whole number; A/B benchmarks of
the bound). Read per call, like :data:`GEMV_ENV`."""

GEMV_TOKENS_ENV = "GRAPHSERVING_GEMV_MAX_TOKENS"
"""Environment variable overriding :data:`GEMV_MAX_TOKENS` (1 .. :data:`MAX_ROWS`; A/B benchmarks of
small verification and decode batches). Read per call, like :data:`GEMV_ENV`."""

GEMV_WIDE_ENV = "GRAPHSERVING_GEMV_WIDE_HIDDEN"
"""Environment variable: a hidden size whose models take :data:`WIDE_HIDDEN_DEVICES`' policy on any
device (a positive whole number; A/B benchmarks on devices not listed). Read per call, like
:data:`GEMV_ENV`."""

GEMV_AHEAD_ENV = "GRAPHSERVING_GEMV_AHEAD"
"""Environment variable overriding :func:`choose_config`'s ``ahead`` (1 or 2; A/B benchmarks). Read per
call, like :data:`GEMV_ENV`."""

GEMV_WEIGHT_ENV = "GRAPHSERVING_GEMV_MAX_WEIGHT_MIB"
"""Environment variable overriding :data:`GEMV_MAX_WEIGHT_ELEMENTS`, in MiB of a 2-byte weight (A/B
benchmarks of the bound). Read per call, like :data:`GEMV_ENV`."""


def use_gemv(num_tokens: int, out_features: int, in_features: int, hidden_size: int, *,
             device: torch.device | str | None = None, norm_only: bool = False) -> bool:
    """Whether a projection of ``num_tokens`` rows through a weight ``[out_features, in_features]`` of
    a model with hidden size ``hidden_size`` runs here rather than in cuBLAS:
    ``0 < num_tokens <= GEMV_MAX_TOKENS``, ``out_features * in_features <= GEMV_MAX_WEIGHT_ELEMENTS``
    and ``hidden_size <= GEMV_MAX_HIDDEN`` (``GRAPHSERVING_GEMV``: ``0`` never, ``all`` without the
    two size bounds). On a CUDA ``device`` of :data:`WIDE_HIDDEN_DEVICES` (or any device with
    ``GRAPHSERVING_GEMV_WIDE_HIDDEN``) its listed hidden sizes pass too, unless ``norm_only`` (a
    projection with the norm before it folded in and nothing after it: QKV, an MoE router).
    ``GRAPHSERVING_GEMV_MAX_HIDDEN`` replaces both with one bound for every projection. A pure function
    of shapes and the device, so eager warmup, capture and replay of one token count take the same
    path.

    Raises:
        ValueError: ``GRAPHSERVING_GEMV`` set to anything but ``0``, ``1`` or ``all``, or
            ``GRAPHSERVING_GEMV_MAX_TOKENS`` to anything but 1 .. :data:`MAX_ROWS`, or
            ``GRAPHSERVING_GEMV_MAX_WEIGHT_MIB``, ``GRAPHSERVING_GEMV_MAX_HIDDEN`` or
            ``GRAPHSERVING_GEMV_WIDE_HIDDEN`` to anything but a positive whole number.
    """
    mode = os.environ.get(GEMV_ENV, "1").strip().lower() or "1"
    if mode not in GEMV_MODES:
        raise ValueError(f"{GEMV_ENV}={mode!r}: expected 0 (cuBLAS), 1 (default: skinny GEMM for batches of at "
                         f"most {GEMV_MAX_TOKENS} rows, weights of at most {GEMV_MAX_WEIGHT_ELEMENTS} elements "
                         f"and hidden sizes of at most {GEMV_MAX_HIDDEN}, more on the devices of "
                         f"WIDE_HIDDEN_DEVICES) or all (any size)")
    mib = env_count(GEMV_WEIGHT_ENV, "a positive whole number of MiB")
    max_elements = mib << 19 if mib else GEMV_MAX_WEIGHT_ELEMENTS
    max_hidden = env_count(GEMV_HIDDEN_ENV, "a positive whole number")
    if max_hidden:
        hidden_ok = hidden_size <= max_hidden
    else:
        hidden_ok = hidden_size <= GEMV_MAX_HIDDEN or (not norm_only and hidden_size in wide_hidden_sizes(device))
    small = mode == "all" or (out_features * in_features <= max_elements and hidden_ok)
    limit = env_count(GEMV_TOKENS_ENV, f"a row count in 1..{MAX_ROWS}", highest=MAX_ROWS) or GEMV_MAX_TOKENS
    return mode != "0" and small and 0 < num_tokens <= min(limit, MAX_ROWS)


def wide_hidden_sizes(device: torch.device | str | None) -> frozenset[int]:
    """The hidden sizes above :data:`GEMV_MAX_HIDDEN` that :func:`use_gemv` serves on ``device`` (but for
    ``norm_only`` projections): ``GRAPHSERVING_GEMV_WIDE_HIDDEN``'s on any device, else
    :data:`WIDE_HIDDEN_DEVICES`' entry for a CUDA device listed there, else none.

    Raises:
        ValueError: ``GRAPHSERVING_GEMV_WIDE_HIDDEN`` set to anything but a positive whole number.
    """
    wide = env_count(GEMV_WIDE_ENV, "a positive whole number (a hidden size)")
    if wide:
        return frozenset({wide})
    device = torch.device(device) if device is not None else None
    if device is None or device.type != "cuda":
        return frozenset()
    return WIDE_HIDDEN_DEVICES.get(device_name(device.index), frozenset())


MAX_TILE_ELEMENTS = 16384
"""Upper bound on ``BLOCK_M * BLOCK_N * BLOCK_K`` (:func:`choose_config`'s rule for ``BLOCK_N``; the
SwiGLU variant's gate and up tiles together use at most half of it). Set when the products formed
one float32 ``[BLOCK_M, BLOCK_N, BLOCK_K]`` register tile; they are now formed one row at a time on
the ``[BLOCK_N, BLOCK_K]`` weight tile, so for several rows the rule is conservative. Kept as it was
measured: at batch 1, the default policy, ``BLOCK_M`` is 1."""

MAX_BLOCK_K = 2048
"""Widest K tile: a hidden size of up to 2048 (SmolLM2's 576, Llama-3.2-1B's 2048) in one tile, so the
program's whole weight slice is loaded before the PDL wait."""

MAX_BLOCK_N = 8
"""Most weight rows per program."""


@dataclass(frozen=True)
class GemvConfig:
    """Meta-parameters of one launch (see :func:`choose_config`)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    ahead: int = 1
    """K tiles of weights in flight ahead of the products: 1 (the next tile) or 2 (the next two; both
    loaded before the PDL wait). 1 by default: on an H100, 2 left the batch-1 replays of the hidden-4096
    shapes with every projection here unchanged (Llama-3-8B 5.575 vs 5.578 ms) and made Llama-3.2-1B's
    2-3 % longer (bench/RESULTS.md, "Hidden size 4096 on the skinny GEMM on an H100");
    ``GRAPHSERVING_GEMV_AHEAD=2`` keeps the A/B for GPUs of more bandwidth a multiprocessor
    (``bench/gemv_round.sh``). :func:`gemv` and :func:`fused_add_rms_norm_gemv` only; the O projection
    that merges the attention's partials (``o_proj.combine_gemv``) has its own loop."""


def choose_config(num_rows: int, hidden: int, gated: bool) -> GemvConfig:
    """Meta-parameters from shapes (and ``GRAPHSERVING_GEMV_AHEAD``): no autotuning.

    The rule is the one that came within about 10 % of the best of a 60-point sweep at batch 1 on the
    H200 for every projection of SmolLM2-135M, Llama-3.2-1B and Qwen3-30B-A3B (``bench/kernel_bench.py
    --only gemv --batch-sizes 1 --sweep``, bench/RESULTS.md "Skinny GEMM"):

    - ``block_m``: the row count rounded up to a power of two (1-8);
    - ``block_k``: the hidden size rounded up to a power of two, at most :data:`MAX_BLOCK_K` (one K
      tile up to 2048: all of it in flight before the PDL wait);
    - ``block_n``: the widest power of two up to :data:`MAX_BLOCK_N` whose accumulator fits
      :data:`MAX_TILE_ELEMENTS` (with ``gated`` the gate and up tiles together half of it), at least 1;
    - 8 warps when K needs more than one tile (a long loop, e.g. a down projection), else 4;
    - ``ahead`` 1 (``GRAPHSERVING_GEMV_AHEAD`` for A/B).

    Args:
        num_rows: token rows M (1..MAX_ROWS).
        hidden: K.
        gated: the SwiGLU variant.

    Raises:
        ValueError: ``GRAPHSERVING_GEMV_AHEAD`` set to anything but 1 or 2.
    """
    block_m = next_power_of_2(max(1, num_rows))
    block_k = min(next_power_of_2(hidden), MAX_BLOCK_K)
    budget = MAX_TILE_ELEMENTS // (4 if gated else 1)  # gated: gate and up tiles, half the total
    block_n = max(1, min(MAX_BLOCK_N, budget // (block_m * block_k)))
    block_n = 1 << (block_n.bit_length() - 1)  # a power of two
    ahead = env_count(GEMV_AHEAD_ENV, "1 or 2", highest=2) or 1
    return GemvConfig(block_m, block_n, block_k, num_warps=8 if hidden > block_k else 4, ahead=ahead)


@device_function
def _weight_tile(weight_ptr, w_rows, w_up_rows, n_mask, cols, HIDDEN: tl.constexpr, SILU_AND_MUL: tl.constexpr):
    """The weight tile ``[BLOCK_N, BLOCK_K]`` of rows ``w_rows`` (element offsets) over K columns ``cols``
    (zeros past ``HIDDEN``), and with ``SILU_AND_MUL`` the matching up rows' tile (else the same tile)."""
    mask = n_mask[:, None] & (cols < HIDDEN)[None, :]
    w = tl.load(weight_ptr + w_rows[:, None] + cols[None, :], mask=mask, other=0.0)
    w_up = w
    if SILU_AND_MUL:
        w_up = tl.load(weight_ptr + w_up_rows[:, None] + cols[None, :], mask=mask, other=0.0)
    return w, w_up


@device_function
def _rstd_of_rows(x_ptr, residual_ptr, residual_out_ptr, num_rows, stream_rows, eps, stride_xm, stride_rm, stride_rom,
                  HIDDEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """Each row's ``1 / RMS`` of ``s = x + residual``, float32 ``[BLOCK_M]`` (one pass over ``x`` and
    ``residual``; rows below ``stream_rows`` also store ``s``, the residual stream)."""
    rows = tl.arange(0, BLOCK_M)
    row_mask = rows < num_rows
    sum_sq = tl.zeros([BLOCK_M], tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        mask = row_mask[:, None] & (cols < HIDDEN)[None, :]
        s = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(residual_ptr + rows[:, None] * stride_rm + cols[None, :], mask=mask, other=0.0)
            s = (s.to(tl.float32) + r.to(tl.float32)).to(residual_out_ptr.dtype.element_ty)
            tl.store(residual_out_ptr + rows[:, None] * stride_rom + cols[None, :], s,
                     mask=mask & (rows < stream_rows)[:, None])
        sf = s.to(tl.float32)
        sum_sq += tl.sum(sf * sf, axis=1)
    return tl.rsqrt(sum_sq / HIDDEN + eps)


@device_function
def _row_input(x_ptr, residual_ptr, norm_weight_ptr, normed_out_ptr, row, num_rows, stored_rows, rstd, cols, k_mask,
               stride_xm, stride_rm, stride_nm, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
               STORE_NORMED: tl.constexpr):
    """Row ``row`` of the projection's input over the K tile ``cols``, float32 ``[BLOCK_K]``: ``x``, or
    with ``NORM`` the normed ``s = x + residual`` (``rstd``: the rows' ``1 / RMS``) rounded as
    ``kernels.fused_add_rms_norm`` rounds it, and stored to ``normed_out_ptr`` (an MoE layer's experts
    take it) when ``row < stored_rows``. A row at or past ``num_rows`` reads as zeros."""
    row_ids = tl.full(cols.shape, row, tl.int32)
    mask = k_mask & (row_ids < num_rows)
    h = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0)
    if NORM:
        dtype = h.dtype
        if HAS_RESIDUAL:
            r = tl.load(residual_ptr + row * stride_rm + cols, mask=mask, other=0.0)
            h = (h.to(tl.float32) + r.to(tl.float32)).to(dtype)
        row_rstd = tl.sum(tl.where(tl.arange(0, rstd.shape[0]) == row, rstd, 0.0), axis=0)
        normed = (h.to(tl.float32) * row_rstd).to(dtype)
        norm_w = tl.load(norm_weight_ptr + cols, mask=k_mask, other=0.0)
        h = (norm_w.to(tl.float32) * normed.to(tl.float32)).to(dtype)
        if STORE_NORMED:
            tl.store(normed_out_ptr + row * stride_nm + cols, h, mask=k_mask & (row_ids < stored_rows))
    return h.to(tl.float32)


def _gemv_kernel(
    x_ptr, residual_ptr, norm_weight_ptr, weight_ptr, bias_ptr, out_ptr, residual_out_ptr, normed_out_ptr,
    route_ticket_ptr, route_slots_ptr, route_weights_ptr, route_ids_ptr,
    num_rows, eps,
    stride_xm, stride_rm, stride_wn, stride_om, stride_rom, stride_nm,
    HIDDEN: tl.constexpr, OUT_COLS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr, SILU_AND_MUL: tl.constexpr,
    STORE_NORMED: tl.constexpr, AHEAD: tl.constexpr,
    ROUTE_TOP_K: tl.constexpr, ROUTE_BLOCK_E: tl.constexpr, ROUTE_BLOCK_K: tl.constexpr,
    ROUTE_NORMALIZE: tl.constexpr, ROUTE_HAS_SLOTS: tl.constexpr, USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < OUT_COLS
    w_rows = n.to(tl.int64) * stride_wn
    w_up_rows = (n + OUT_COLS).to(tl.int64) * stride_wn  # SwiGLU: the matching up rows
    k_range = tl.arange(0, BLOCK_K)
    act_dtype = weight_ptr.dtype.element_ty

    # Weights are never written by a kernel: the first AHEAD K tiles are loaded before the PDL wait.
    w, w_up = _weight_tile(weight_ptr, w_rows, w_up_rows, n_mask, k_range, HIDDEN, SILU_AND_MUL)
    w_1, w_up_1 = w, w_up  # the tile after w (AHEAD == 2)
    if AHEAD == 2:
        w_1, w_up_1 = _weight_tile(weight_ptr, w_rows, w_up_rows, n_mask, k_range + BLOCK_K, HIDDEN, SILU_AND_MUL)

    pdl_enter(USE_PDL)
    rows = tl.arange(0, BLOCK_M)
    stored_rows = tl.where(pid == 0, num_rows, 0)  # the first column block stores the stream and normed rows
    rstd = tl.zeros([BLOCK_M], tl.float32)
    if NORM:
        rstd = _rstd_of_rows(x_ptr, residual_ptr, residual_out_ptr, num_rows, stored_rows, eps,
                             stride_xm, stride_rm, stride_rom, HIDDEN, BLOCK_M, BLOCK_K, HAS_RESIDUAL)

    # The product, K tile by K tile: the load of the tile AHEAD tiles on is issued first; each row is
    # reduced on the weight tile's own layout (a [1, BLOCK_K] row against [BLOCK_N, BLOCK_K]) into acc
    # [BLOCK_M, BLOCK_N].
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        cols = k0 + k_range
        w_far, w_up_far = _weight_tile(weight_ptr, w_rows, w_up_rows, n_mask, cols + AHEAD * BLOCK_K, HIDDEN,
                                       SILU_AND_MUL)
        wf = w.to(tl.float32)
        wf_up = w_up.to(tl.float32)
        for row in tl.static_range(BLOCK_M):
            h = _row_input(x_ptr, residual_ptr, norm_weight_ptr, normed_out_ptr, row, num_rows, stored_rows, rstd,
                           cols, cols < HIDDEN, stride_xm, stride_rm, stride_nm, NORM, HAS_RESIDUAL, STORE_NORMED)
            hit = (rows == row)[:, None]
            acc += tl.where(hit, tl.sum(wf * h[None, :], axis=1)[None, :], 0.0)
            if SILU_AND_MUL:
                acc_up += tl.where(hit, tl.sum(wf_up * h[None, :], axis=1)[None, :], 0.0)
        if AHEAD == 2:
            w, w_up, w_1, w_up_1 = w_1, w_up_1, w_far, w_up_far
        else:
            w, w_up = w_far, w_up_far

    out = acc
    if HAS_BIAS:
        out += tl.load(bias_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if SILU_AND_MUL:
        up = acc_up
        if HAS_BIAS:
            up += tl.load(bias_ptr + OUT_COLS + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        # Round gate and up as the stored projection would be, then exactly kernels.silu_and_mul.
        g = out.to(act_dtype).to(tl.float32)
        activated = (g / (1.0 + tl.exp(-g))).to(act_dtype)
        out = activated.to(tl.float32) * up.to(act_dtype).to(tl.float32)
    tl.store(out_ptr + rows[:, None] * stride_om + n[None, :], out.to(out_ptr.dtype.element_ty),
             mask=(rows < num_rows)[:, None] & n_mask[None, :])
    if ROUTE_TOP_K > 0:
        route_in_last_program(out_ptr, route_ticket_ptr, route_slots_ptr, route_weights_ptr, route_ids_ptr, num_rows,
                              stride_om, OUT_COLS, BLOCK_M, ROUTE_BLOCK_E, ROUTE_TOP_K, ROUTE_BLOCK_K,
                              ROUTE_NORMALIZE, ROUTE_HAS_SLOTS)


# The row count varies within a block_m; leaving it generic keeps one compiled variant per block_m.
_KERNEL = DeviceKernel(_gemv_kernel, pdl=True, do_not_specialize=["num_rows"])


def _check(x, residual, norm_weight, weight, bias, activation) -> None:
    """Raise ValueError naming the argument whose shape, dtype or device does not fit (the contract of
    ``norm_linear.fused_add_rms_norm_linear``, and at most :data:`MAX_ROWS` rows)."""
    check_norm_linear_inputs(x, residual, norm_weight, weight, bias, activation)
    if x.shape[0] > MAX_ROWS:
        raise ValueError(f"x has {x.shape[0]} rows; the skinny GEMM serves at most {MAX_ROWS} (use F.linear)")


def _contiguous_last(t: torch.Tensor | None) -> torch.Tensor | None:
    return t if t is None or t.stride(-1) == 1 else t.contiguous()


class RouteOutputs(NamedTuple):
    """Where :func:`fused_add_rms_norm_gemv_route`'s kernel routes the rows (its launcher's inputs)."""

    ticket: torch.Tensor
    slot_mapping: torch.Tensor | None
    top_k: int
    normalize: bool
    weights: torch.Tensor
    ids: torch.Tensor


def _launch(x, residual, norm_weight, weight, bias, eps, activation, out_dtype, config, normed=None, out=None,
            route: RouteOutputs | None = None):
    _check(x, residual, norm_weight, weight, bias, activation)
    num_rows, hidden = x.shape
    out_cols = weight.shape[0] // 2 if activation == "silu_and_mul" else weight.shape[0]
    x, residual, weight, bias, norm_weight = (_contiguous_last(t) for t in (x, residual, weight, bias, norm_weight))
    if out is None:
        out = torch.empty((num_rows, out_cols), dtype=out_dtype or x.dtype, device=x.device)
    elif (out.shape != (num_rows, out_cols) or out.dtype != (out_dtype or x.dtype) or out.device != x.device
          or out.stride(-1) != 1):
        raise ValueError(f"out must be [{num_rows}, {out_cols}] of {out_dtype or x.dtype} on {x.device}, contiguous "
                         f"in its last dimension; got {list(out.shape)} of {out.dtype} on {out.device}")
    stream = torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else None
    if num_rows == 0 or out_cols == 0:
        if stream is not None:
            stream.copy_(x + residual)
        return out, stream
    cfg = config or choose_config(num_rows, hidden, activation is not None)
    if cfg.ahead not in (1, 2):
        raise ValueError(f"config ahead={cfg.ahead}: 1 or 2 K tiles of weights in flight")
    if cfg.block_m < num_rows:
        raise ValueError(f"config block_m={cfg.block_m} is smaller than the {num_rows} rows (one row block covers "
                         f"them all)")
    res_in = residual if residual is not None else x  # unused by the kernel without a residual
    res_out = stream if stream is not None else x
    normed_out = normed if normed is not None else x
    routing = (route.ticket, route.slot_mapping if route.slot_mapping is not None else route.ticket, route.weights,
               route.ids) if route is not None else (out,) * 4  # unused by the kernel without a route
    _KERNEL.on(x.device, tokens=num_rows)[(-(-out_cols // cfg.block_n),)](
        x, res_in, weight if norm_weight is None else norm_weight, weight, weight if bias is None else bias,
        out, res_out, normed_out, *routing,
        num_rows, eps,
        x.stride(0), res_in.stride(0), weight.stride(0), out.stride(0), res_out.stride(0), normed_out.stride(0),
        HIDDEN=hidden, OUT_COLS=out_cols,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        NORM=norm_weight is not None, HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None,
        SILU_AND_MUL=activation == "silu_and_mul", STORE_NORMED=normed is not None, AHEAD=cfg.ahead,
        ROUTE_TOP_K=route.top_k if route is not None else 0, ROUTE_BLOCK_E=next_power_of_2(out_cols),
        ROUTE_BLOCK_K=next_power_of_2(route.top_k) if route is not None else 1,
        ROUTE_NORMALIZE=route is not None and route.normalize,
        ROUTE_HAS_SLOTS=route is not None and route.slot_mapping is not None,
        num_warps=cfg.num_warps,
    )
    return out, stream


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
         out_dtype: torch.dtype | None = None, config: GemvConfig | None = None,
         out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for a few rows: one PDL kernel (equal to ``F.linear`` up to the order
    of the float32 summation).

    Args:
        x: [M, K], M at most :data:`MAX_ROWS`, float32/bfloat16/float16, last dimension contiguous.
        weight: [N, K] in ``x``'s dtype (``nn.Linear`` layout).
        bias: [N] or ``None``.
        out_dtype: the output dtype (default ``x.dtype``; float32 for logits).
        config: override the meta-parameters (benchmarks, tests); default :func:`choose_config`.
        out: where to write the result ([M, N] of the output dtype, last dimension contiguous: a
            graph's static logits buffer), or ``None`` for a fresh tensor.

    Returns:
        [M, N]: ``out``, or a fresh tensor.

    Raises:
        ValueError: shapes, dtypes or devices that do not fit together (the message names them),
            more than :data:`MAX_ROWS` rows, an ``out`` of another shape, dtype or device, a config
            whose ``ahead`` is not 1 or 2, or ``GRAPHSERVING_GEMV_AHEAD`` set to anything else.
    """
    return _launch(x, None, None, weight, bias, 0.0, None, out_dtype, config, out=out)[0]


def fused_add_rms_norm_gemv(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    activation: str | None = None,
    *,
    config: GemvConfig | None = None,
    return_normed: bool = False,
) -> tuple[torch.Tensor, ...]:
    """``s = x + residual``; ``h = rms_norm(s) * norm_weight``; ``out = h @ weight.T + bias`` (and
    ``silu(gate) * up`` with ``activation="silu_and_mul"``) for a few rows: one PDL kernel.

    The contract of ``kernels.fused_add_rms_norm_linear`` (same arguments, same result up to the
    order of the float32 summation) for at most :data:`MAX_ROWS` rows.

    Args:
        x: [M, K], M at most :data:`MAX_ROWS`.
        residual: [M, K] of ``x``'s dtype, or ``None`` (plain RMSNorm of ``x``).
        norm_weight: [K].
        weight: [N, K] in ``x``'s dtype; with ``"silu_and_mul"`` the fused gate/up projection
            ``[2 * I, K]``, gate rows first.
        bias: [N] or ``None``.
        eps: added to the mean of squares.
        activation: ``None`` or ``"silu_and_mul"``.
        config: override the meta-parameters; default :func:`choose_config`.
        return_normed: also return ``h`` [M, K] in ``x.dtype`` (fresh; stored by the first column
            block): a mixture-of-experts layer's router projection hands the normed rows to the
            experts without a norm kernel of its own.

    Returns:
        ``(out, s)``: ``out`` [M, N] (``[M, I]`` with SwiGLU) in ``x.dtype``; ``s`` the residual stream
        ``x + residual`` [M, K] (fresh), or ``x`` itself when ``residual`` is ``None``. With
        ``return_normed``, ``(out, s, h)``.

    Raises:
        ValueError: as :func:`gemv`, an unknown activation or an odd ``N`` with ``"silu_and_mul"``, and
            ``return_normed`` with an empty weight.
    """
    if return_normed and weight.shape[0] == 0:
        raise ValueError("return_normed needs a weight of at least one row (its first column block stores h)")
    normed = torch.empty_like(x, memory_format=torch.contiguous_format) if return_normed else None
    out, stream = _launch(x, residual, norm_weight, weight, bias, eps, activation, None, config, normed)
    stream = x if residual is None else stream
    return (out, stream, normed) if return_normed else (out, stream)


def fused_add_rms_norm_gemv_route(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    router: torch.Tensor,
    eps: float,
    *,
    top_k: int,
    normalize: bool,
    slot_mapping: torch.Tensor | None,
    ticket: torch.Tensor,
    config: GemvConfig | None = None,
) -> tuple[torch.Tensor, ...]:
    """A mixture-of-experts layer's add, norm, router projection and top-k routing in one PDL kernel:
    :func:`fused_add_rms_norm_gemv` with ``return_normed`` for the router, then ``moe.route_topk``'s
    routing of the logits in the program that finishes last (a ticket per call), so the route
    kernel's launch is saved (``moe.ROUTE_IN_ROUTER`` says whether the model takes it).

    Args:
        x, residual, norm_weight, eps, config: as :func:`fused_add_rms_norm_gemv`.
        router: [E, K] in ``x``'s dtype, E at most 1024.
        top_k, normalize, slot_mapping: as ``graphserving.runtime.model.moe.route_topk`` (a negative slot
            marks a padding row: id E, weight 0).
        ticket: int32 [1] on ``x``'s device, 0 between calls (the kernel sets it back): one per
            router, never shared by two calls that may run at once.

    Returns:
        ``(logits [M, E] in x.dtype, s [M, K], h [M, K], weights float32 [M, top_k], ids int32
        [M, top_k])``: as :func:`fused_add_rms_norm_gemv`'s ``(out, s, h)``, then the routing.

    Raises:
        ValueError: as :func:`fused_add_rms_norm_gemv`; ``top_k`` outside 1..E, more than 1024
            experts, a ticket that is not int32 [1] on ``x``'s device, or a ``slot_mapping`` that
            is not an integer tensor of at least M entries on that device.
    """
    num_rows, num_experts = x.shape[0], router.shape[0]
    if not 1 <= top_k <= num_experts or num_experts > 1024:
        raise ValueError(f"top_k={top_k} with {num_experts} experts: need 1 <= top_k <= E <= 1024")
    if ticket.shape != (1,) or ticket.dtype != torch.int32 or ticket.device != x.device:
        raise ValueError(f"ticket must be int32 [1] on {x.device}; got {ticket.dtype} {list(ticket.shape)} on "
                         f"{ticket.device}")
    if slot_mapping is not None and (slot_mapping.dtype.is_floating_point or slot_mapping.dim() != 1
                                     or slot_mapping.shape[0] < num_rows or slot_mapping.device != x.device):
        raise ValueError(f"slot_mapping must be an integer [>= {num_rows}] tensor on {x.device}")
    route = RouteOutputs(ticket, slot_mapping, top_k, normalize,
                         torch.empty((num_rows, top_k), dtype=torch.float32, device=x.device),
                         torch.empty((num_rows, top_k), dtype=torch.int32, device=x.device))
    normed = torch.empty_like(x, memory_format=torch.contiguous_format)
    out, stream = _launch(x, residual, norm_weight, router, None, eps, None, None, config, normed, route=route)
    return out, x if residual is None else stream, normed, route.weights, route.ids
