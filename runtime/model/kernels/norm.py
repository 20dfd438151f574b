"""RMSNorm, optionally fused with the residual add before it: one kernel per call.

Numerics follow the Hugging Face reference (and ``graphserving.runtime.model.llama.rms_norm``): the
residual add rounds to the activation dtype (as ``x + residual`` in torch does), the mean of
squares and the scaling by ``rsqrt(mean + eps)`` run in float32, the normalised row is cast to
the activation dtype, and only then multiplied by the weight (rounded once more). With float32
activations the result equals the reference up to the order of the float32 summation.
"""

from __future__ import annotations

import torch
import triton.language as tl

from .backend import DeviceKernel, next_power_of_2
from .pdl import pdl_enter


def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
    eps,
    stride_x, stride_residual, stride_out, stride_residual_out,
    HIDDEN: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_residual_out + cols, x, mask=mask)
    h = x.to(tl.float32)
    mean_square = tl.sum(h * h, axis=0) / HIDDEN
    normed = (h * tl.rsqrt(mean_square + eps)).to(x.dtype)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = weight.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


_KERNEL = DeviceKernel(_rms_norm_kernel, pdl=True)


def _num_warps(block: int) -> int:
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


def _check(name: str, t: torch.Tensor, hidden: int, device: torch.device) -> None:
    if t.shape[-1] != hidden:
        raise ValueError(f"{name} has hidden size {t.shape[-1]}, expected {hidden}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")


def _rows(t: torch.Tensor, hidden: int) -> torch.Tensor:
    rows = t.reshape(-1, hidden)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual = x + residual`` (when given), then RMSNorm of it: one kernel.

    Args:
        x: [..., H], float32/bfloat16/float16.
        residual: [..., H] of ``x``'s shape and dtype, or ``None`` (plain RMSNorm of ``x``).
        weight: [H].
        eps: added to the mean of squares (the model's ``rms_norm_eps``).

    Returns:
        ``(normed, new_residual)``: ``normed`` [..., H] in the promoted dtype of ``x`` and
        ``weight`` (as the reference's ``weight * h``), ``new_residual`` = ``x + residual`` in
        ``x.dtype`` (``x`` itself when ``residual`` is ``None``). Fresh tensors; inputs are not
        modified.

    Raises:
        ValueError: mismatched hidden sizes, shapes, dtypes or devices.
    """
    hidden = x.shape[-1]
    _check("weight", weight, hidden, x.device)
    if weight.dim() != 1:
        raise ValueError(f"weight must be 1-D [H], got shape {tuple(weight.shape)}")
    if residual is not None:
        _check("residual", residual, hidden, x.device)
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} does not match "
                             f"x {tuple(x.shape)} {x.dtype}")
    rows = _rows(x, hidden)
    out = torch.empty(rows.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if residual is None:
        res_in, res_out = rows, rows  # unused by the kernel (HAS_RESIDUAL=False)
    else:
        res_in = _rows(residual, hidden)
        res_out = torch.empty_like(rows)
    if rows.shape[0] > 0:
        weight = weight if weight.stride(0) == 1 else weight.contiguous()
        block = next_power_of_2(hidden)
        _KERNEL.on(x.device, tokens=rows.shape[0])[(rows.shape[0],)](
            rows, res_in, weight, out, res_out,
            eps,
            rows.stride(0), res_in.stride(0), out.stride(0), res_out.stride(0),
            HIDDEN=hidden, BLOCK=block, HAS_RESIDUAL=residual is not None, num_warps=_num_warps(block),
        )
    new_residual = x if residual is None else res_out.view(x.shape)
    return out.view(x.shape), new_residual


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x`` [..., H] with ``weight`` [H]: one kernel (see :func:`fused_add_rms_norm`)."""
    return fused_add_rms_norm(x, None, weight, eps)[0]
