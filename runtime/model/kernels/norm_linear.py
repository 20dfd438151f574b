"""RMSNorm (with the residual add before it) fused into the projection after it: one kernel.

``fused_add_rms_norm`` followed by ``F.linear`` is two kernels and a round trip of the normalised
activations through memory; at decode sizes (a few token rows, a weight of a few MB) each kernel
costs its launch latency and its ramp-up far more than its FLOPs or bytes. Here one kernel does
both, and with ``activation="silu_and_mul"`` the SwiGLU gate as well (the fused gate/up
projection, ``silu(h @ Wg.T) * (h @ Wu.T)``): a decoder layer's ``norm -> QKV GEMM`` and
``add -> norm -> gate/up GEMM -> silu_and_mul`` become one kernel each.

Work split: a grid of (output-column blocks, row blocks). Each program recomputes the RMS of its
``BLOCK_M`` rows (a first pass over K, loads only and unrolled so that they are in flight
together: the rows are short and read from L2 by every program), then walks K again
(software-pipelined over ``num_stages`` K tiles; at batch 1 all of SmolLM2's are in flight at
once), normalising each ``BLOCK_M x BLOCK_K`` tile of activations on the fly and
feeding it to ``tl.dot`` against a ``BLOCK_N x BLOCK_K`` tile of the weight (two tiles, gate and
up rows, in the SwiGLU variant). The programs of the first column block also store the residual
stream ``x + residual``. Small ``BLOCK_N`` (16-64) gives enough programs to spread a small weight
over the device's SMs: at batch 1 the kernel is bound by latency and bandwidth, not FLOPs.

Numerics equal ``kernels.fused_add_rms_norm`` then ``F.linear``: the residual add rounds to the
activation dtype, the mean of squares and ``rsqrt`` run in float32, the normalised row is
rounded to the activation dtype, multiplied by the norm weight and rounded again (the ``h`` that
``F.linear`` sees); the matmul accumulates in float32 (IEEE float32 for float32 inputs, no TF32),
the bias is added in float32 and the result is rounded once. In the SwiGLU variant the gate and
up results are rounded to the activation dtype before ``silu(gate) * up`` exactly as
``kernels.silu_and_mul`` does on the stored projection, so the fused and unfused paths differ
only by the order of the float32 summation.

Whether the model takes this path is :func:`use_fused_norm_linear` (a pure function of shapes, so
warmup, capture and replay agree); meta-parameters come from :func:`choose_config` (shapes and
the device's SM count only: no autotuning, so everything compiles during the eager warmup).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton.language as tl

from .backend import DeviceKernel, multiprocessor_count, next_power_of_2
from .pdl import pdl_enter

MAX_FUSED_TOKENS = 0
"""Default policy: fuse for at most this many token rows; 0 turns the fused path off.

Off by default because it did not pay on the H200 (``bench/kernel_bench.py --only norm_linear``,
2026-11-29, weights streamed from HBM): SmolLM2 norm+QKV 5.6 us fused vs 5.5 us for the norm
kernel + cuBLAS at batch 1, 8.8 vs 5.4 us at batch 64; Llama-3.2-1B 18.6 vs 8.3 us at batch 1.
The kernel stays, tested, for tuning (``--sweep``); set this to 64 to enable it for small models."""

MAX_FUSED_HIDDEN = 2048
"""Default policy: fuse for hidden sizes up to this (every program re-reads its rows twice, which
grows with ``num_tokens * hidden``; Llama-3-8B's 4096 is left to cuBLAS until measured)."""

ACTIVATIONS = (None, "silu_and_mul")


def use_fused_norm_linear(num_tokens: int, hidden: int, out_features: int) -> bool:
    """Whether the model should run norm + projection as :func:`fused_add_rms_norm_linear`.

    ``0 < num_tokens <= MAX_FUSED_TOKENS and hidden <= MAX_FUSED_HIDDEN``; with the default
    ``MAX_FUSED_TOKENS = 0`` never (measured slower than ``fused_add_rms_norm`` + cuBLAS, see
    :data:`MAX_FUSED_TOKENS`). ``out_features`` is the weight's row count (``2 * I`` for the
    fused gate/up projection); unused by the default, there for tuning (``bench/kernel_bench.py``
    times both paths per shape).

    A pure function of shapes: eager warmup, CUDA-graph capture and replay of one token count
    always take the same path.
    """
    del out_features  # the default does not depend on it
    return 0 < num_tokens <= MAX_FUSED_TOKENS and hidden <= MAX_FUSED_HIDDEN


SHARED_MEMORY_BUDGET = 128 * 1024
"""Bytes of shared memory the K pipeline may use per program (H100/H200: 228 KB per SM)."""

MAX_STAGES = 8
"""Deepest K pipeline :func:`choose_config` picks."""


@dataclass(frozen=True)
class NormLinearConfig:
    """Meta-parameters of one launch (see :func:`choose_config`).

    ``norm_unroll`` is the unroll factor of the first pass (the row RMS): unrolled, its loads
    are all in flight together instead of one L2 round trip per K tile.
    """

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    norm_unroll: int = 1


def choose_config(num_rows: int, hidden: int, out_cols: int, gated: bool, num_sms: int,
                  element_size: int = 2) -> NormLinearConfig:
    """Meta-parameters from shapes (and the device's SM count) only: no autotuning.

    - ``block_m``: the row count rounded up to a power of two, 16..64 (``tl.dot`` needs 16), so
      up to 64 rows are one row block and each weight tile is read once;
    - ``block_n``: the widest of 64/32/16 output columns (per gate and up in the SwiGLU variant)
      that still gives at least ``num_sms`` programs, else 16 (SmolLM2's QKV, 960 columns: 60
      programs of 16 rows of the weight);
    - ``block_k``: 128 (fewer, larger K steps; a masked tail costs no memory traffic), at most the
      hidden size rounded up to a power of two;
    - ``num_stages``: as many K tiles in flight as the K loop has (all of them for SmolLM2: the
      kernel is bound by memory latency at batch 1), at most :data:`MAX_STAGES` and
      :data:`SHARED_MEMORY_BUDGET` bytes of activation and weight tiles, at least 2;
    - ``norm_unroll``: the first pass fully unrolled up to 16 K tiles;
    - 4 warps (8 when a tile exceeds 2048 elements, i.e. 64-row blocks).

    Args:
        num_rows: token rows M.
        hidden: K.
        out_cols: output columns (``I`` for the SwiGLU variant, the weight's rows otherwise).
        gated: the SwiGLU variant (two weight tiles per program).
        num_sms: streaming multiprocessors of the device (a small constant in the interpreter).
        element_size: bytes per activation/weight element.
    """
    block_m = min(64, max(16, next_power_of_2(num_rows)))
    row_blocks = -(-max(num_rows, 1) // block_m)
    block_n = 16
    for candidate in (64, 32, 16):
        if -(-out_cols // candidate) * row_blocks >= num_sms:
            block_n = candidate
            break
    block_k = max(16, min(128, next_power_of_2(hidden)))
    k_tiles = -(-hidden // block_k)
    weight_rows = block_n * (2 if gated else 1)
    stage_bytes = (2 * block_m * block_k + block_k + weight_rows * block_k) * element_size  # x, residual, norms, W
    num_stages = max(2, min(k_tiles, MAX_STAGES, SHARED_MEMORY_BUDGET // stage_bytes))
    tile = block_m * max(weight_rows, block_k)
    return NormLinearConfig(block_m, block_n, block_k, num_warps=4 if tile <= 2048 else 8,
                            num_stages=num_stages, norm_unroll=min(k_tiles, 16))


def _norm_linear_kernel(
    x_ptr, residual_ptr, norm_weight_ptr, weight_ptr, bias_ptr, out_ptr, residual_out_ptr,
    num_rows, eps,
    stride_xm, stride_rm, stride_wn, stride_om, stride_rom,
    HIDDEN: tl.constexpr, OUT_COLS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr, SILU_AND_MUL: tl.constexpr, IEEE_FP32: tl.constexpr,
    NORM_UNROLL: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_mask = rows < num_rows
    k_range = tl.arange(0, BLOCK_K)
    act_dtype = weight_ptr.dtype.element_ty

    # Pass 1: each row's mean square. Loads only, no stores: unrolled, they are all in flight at once.
    sum_sq = tl.zeros([BLOCK_M], tl.float32)
    stream_rows = tl.where(pid_n == 0, num_rows, 0)  # only the first column block stores the stream
    for k0 in tl.range(0, HIDDEN, BLOCK_K, loop_unroll_factor=NORM_UNROLL):
        cols = k0 + k_range
        mask = row_mask[:, None] & (cols < HIDDEN)[None, :]
        s = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(residual_ptr + rows[:, None] * stride_rm + cols[None, :], mask=mask, other=0.0)
            s = (s.to(tl.float32) + r.to(tl.float32)).to(residual_out_ptr.dtype.element_ty)
        sf = s.to(tl.float32)
        sum_sq += tl.sum(sf * sf, axis=1)
    rstd = tl.rsqrt(sum_sq / HIDDEN + eps)

    # Pass 2 (pipelined over K by num_stages): normalise each K tile on the fly and multiply it with
    # the weight tile(s); the first column block also stores the residual stream.
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < OUT_COLS
    w_rows = n.to(tl.int64) * stride_wn
    w_up_rows = (n + OUT_COLS).to(tl.int64) * stride_wn  # SwiGLU: the matching up rows
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        cols = k0 + k_range
        k_mask = cols < HIDDEN
        mask = row_mask[:, None] & k_mask[None, :]
        s = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(residual_ptr + rows[:, None] * stride_rm + cols[None, :], mask=mask, other=0.0)
            s = (s.to(tl.float32) + r.to(tl.float32)).to(residual_out_ptr.dtype.element_ty)
            tl.store(residual_out_ptr + rows[:, None] * stride_rom + cols[None, :], s,
                     mask=mask & (rows < stream_rows)[:, None])
        normed = (s.to(tl.float32) * rstd[:, None]).to(s.dtype)
        norm_w = tl.load(norm_weight_ptr + cols, mask=k_mask, other=0.0)
        h = (norm_w.to(tl.float32)[None, :] * normed.to(tl.float32)).to(act_dtype)
        w_mask = n_mask[:, None] & k_mask[None, :]
        w = tl.load(weight_ptr + w_rows[:, None] + cols[None, :], mask=w_mask, other=0.0)
        if IEEE_FP32:
            acc = tl.dot(h.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(h, tl.trans(w), acc)
        if SILU_AND_MUL:
            w_up = tl.load(weight_ptr + w_up_rows[:, None] + cols[None, :], mask=w_mask, other=0.0)
            if IEEE_FP32:
                acc_up = tl.dot(h.to(tl.float32), tl.trans(w_up.to(tl.float32)), acc_up, input_precision="ieee")
            else:
                acc_up = tl.dot(h, tl.trans(w_up), acc_up)

    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        if SILU_AND_MUL:
            acc_up += tl.load(bias_ptr + OUT_COLS + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if SILU_AND_MUL:
        # Round gate and up as the stored projection would be, then exactly kernels.silu_and_mul.
        g = acc.to(act_dtype).to(tl.float32)
        up = acc_up.to(act_dtype).to(tl.float32)
        activated = (g / (1.0 + tl.exp(-g))).to(act_dtype)
        acc = activated.to(tl.float32) * up
    tl.store(out_ptr + rows[:, None] * stride_om + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & n_mask[None, :])


# The row count changes with the batch size; leaving it generic keeps one compiled variant for
# every M of a row-block size (Triton would otherwise specialise M == 1 and M % 16 == 0).
_KERNEL = DeviceKernel(_norm_linear_kernel, pdl=True, do_not_specialize=["num_rows"])


def _target_programs(device: torch.device) -> int:
    if device.type == "cuda":
        return multiprocessor_count(device.index if device.index is not None else torch.cuda.current_device())
    return 4  # the interpreter: a few programs, so small tests still cross column blocks


def _shape(t: torch.Tensor | None) -> tuple | None:
    return None if t is None else tuple(t.shape)


def check_norm_linear_inputs(x, residual, norm_weight, weight, bias, activation) -> None:
    """Raise ValueError naming the argument whose shape, dtype or device does not fit
    :func:`fused_add_rms_norm_linear`'s contract (also the skinny GEMM's, where ``norm_weight`` may
    be ``None``)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K], got shape {tuple(x.shape)}")
    num_rows, hidden = x.shape
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual {_shape(residual)} {residual.dtype} does not match x {tuple(x.shape)} {x.dtype}")
    if norm_weight is not None and tuple(norm_weight.shape) != (hidden,):
        raise ValueError(f"norm_weight has shape {tuple(norm_weight.shape)}, expected ({hidden},) for x "
                         f"{tuple(x.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden:
        raise ValueError(f"weight has shape {tuple(weight.shape)}, expected [N, K={hidden}] for x {tuple(x.shape)}")
    if weight.dtype != x.dtype:
        raise ValueError(f"weight dtype {weight.dtype} does not match x dtype {x.dtype}")
    out_features = weight.shape[0]
    if bias is not None and tuple(bias.shape) != (out_features,):
        raise ValueError(f"bias has shape {tuple(bias.shape)}, expected ({out_features},) for weight "
                         f"{tuple(weight.shape)}")
    if activation == "silu_and_mul" and out_features % 2:
        raise ValueError(f"silu_and_mul needs weight rows 2 * I, got weight {tuple(weight.shape)}")
    for name, t in (("residual", residual), ("norm_weight", norm_weight), ("weight", weight), ("bias", bias)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, expected {x.device} (x's device)")



def fused_add_rms_norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    activation: str | None = None,
    *,
    config: NormLinearConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + residual``; ``h = rms_norm(s) * norm_weight``; ``out = h @ weight.T + bias``: one kernel.

    Equal to ``h, s = kernels.fused_add_rms_norm(x, residual, norm_weight, eps)`` followed by
    ``F.linear(h, weight, bias)`` (and ``kernels.silu_and_mul`` of that with
    ``activation="silu_and_mul"``), up to the order of the float32 summation (module docstring).

    Args:
        x: [M, K], float32/bfloat16/float16, last dimension contiguous.
        residual: [M, K] of ``x``'s dtype, or ``None`` (plain RMSNorm of ``x``).
        norm_weight: [K].
        weight: [N, K] in ``x``'s dtype (``nn.Linear`` layout). With ``activation="silu_and_mul"``
            the fused gate/up projection ``[2 * I, K]``, gate rows first.
        bias: [N] or ``None``.
        eps: added to the mean of squares.
        activation: ``None`` or ``"silu_and_mul"`` (SwiGLU in the epilogue).
        config: override the meta-parameters (benchmarks and tuning); default :func:`choose_config`.

    Returns:
        ``(out, s)``: ``out`` [M, N] (``[M, I]`` with SwiGLU) in ``x.dtype``; ``s`` the new residual
        stream ``x + residual`` [M, K], a fresh tensor, or ``x`` itself (not a copy) when
        ``residual`` is ``None``. Inputs are not modified.

    Raises:
        ValueError: shapes, dtypes or devices that do not fit together (the message names them),
            an unknown activation, or an odd ``N`` with ``"silu_and_mul"``.
    """
    check_norm_linear_inputs(x, residual, norm_weight, weight, bias, activation)
    num_rows, hidden = x.shape
    out_features = weight.shape[0]
    out_cols = out_features // 2 if activation == "silu_and_mul" else out_features
    x_in = x
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    norm_weight = norm_weight if norm_weight.stride(0) == 1 else norm_weight.contiguous()
    out = torch.empty((num_rows, out_cols), dtype=x.dtype, device=x.device)
    if residual is None:
        res_in = res_out = x  # unused by the kernel (HAS_RESIDUAL=False)
    else:
        res_in = residual if residual.stride(-1) == 1 else residual.contiguous()
        res_out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if num_rows == 0 or out_cols == 0:
        if residual is not None:
            res_out.copy_(x + res_in)
        return out, (x_in if residual is None else res_out)
    if bias is not None and bias.stride(0) != 1:
        bias = bias.contiguous()

    launcher = _KERNEL.on(x.device, tokens=num_rows)
    cfg = config or choose_config(num_rows, hidden, out_cols, activation is not None, _target_programs(x.device),
                                  x.element_size())
    grid = (-(-out_cols // cfg.block_n), -(-num_rows // cfg.block_m))
    launcher[grid](
        x, res_in, norm_weight, weight, weight if bias is None else bias, out, res_out,
        num_rows, eps,
        x.stride(0), res_in.stride(0), weight.stride(0), out.stride(0), res_out.stride(0),
        HIDDEN=hidden, OUT_COLS=out_cols,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None,
        SILU_AND_MUL=activation == "silu_and_mul",
        # The interpreter cannot run tl.dot on bfloat16; float32 inputs must not round to TF32.
        IEEE_FP32=DeviceKernel.is_interpreted(launcher) or x.dtype == torch.float32,
        NORM_UNROLL=cfg.norm_unroll,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out, (x_in if residual is None else res_out)
