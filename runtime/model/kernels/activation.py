"""SwiGLU's gate: ``silu(gate) * up`` from the fused gate/up projection, one kernel."""

from __future__ import annotations

import torch
import triton.language as tl

from .backend import DeviceKernel
from .pdl import pdl_enter

_BLOCK = 1024


def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, INTERMEDIATE: tl.constexpr, BLOCK: tl.constexpr,
                         USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTERMEDIATE
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + INTERMEDIATE + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    # silu rounds to the activation dtype before the product, as F.silu(gate) * up does.
    activated = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    out = activated.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


_KERNEL = DeviceKernel(_silu_and_mul_kernel, pdl=True)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` where ``gate, up = gate_up.chunk(2, dim=-1)``: one kernel.

    Args:
        gate_up: [..., 2 * I], the fused gate/up projection output (gate first, as
            ``DecoderLayer.gate_up_proj`` lays it out).

    Returns:
        [..., I] in ``gate_up.dtype`` (a fresh tensor).

    Raises:
        ValueError: an odd last dimension.
    """
    width = gate_up.shape[-1]
    if width % 2:
        raise ValueError(f"gate_up's last dimension must be 2 * I, got {width}")
    inter = width // 2
    rows = gate_up.reshape(-1, width)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty((rows.shape[0], inter), dtype=gate_up.dtype, device=gate_up.device)
    if rows.shape[0] > 0 and inter > 0:
        block = min(_BLOCK, 1 << max(0, inter - 1).bit_length())
        _KERNEL.on(gate_up.device, tokens=rows.shape[0])[(rows.shape[0], -(-inter // block))](
            rows, out, rows.stride(0), out.stride(0), INTERMEDIATE=inter, BLOCK=block, num_warps=4,
        )
    return out.view(*gate_up.shape[:-1], inter)
