"""Warming L2 with the next kernel's weights: a kernel that leaves memory bandwidth idle asks the L2
cache for the weights the kernel after it will stream.

A one-row decode layer alternates kernels bound by weight bytes (the projections) with kernels
that read almost nothing from memory (the attention over a short context, the MoE route). The
projection after such a kernel starts cold: its first loads wait a whole memory latency, and until
its programs have enough loads in flight the memory system runs below its bandwidth. Here the
kernel before it issues ``prefetch.global.L2`` for the projection's weights (one instruction per
128-byte line, no register holds the data, nothing waits for it), spread over its programs, so
the projection's loads hit L2. The weights are written by no kernel of the forward pass, so the
prefetch may run before the PDL wait (``pdl.py``).

Who warms what (only where :func:`warm_l2_enabled` says so for a batch, off by default, for A/B
rounds: ``GRAPHSERVING_L2_PREFETCH=N``, batches of at most N rows):

- the decode attention warms the O projection's weight (``paged_decode_attention(warm_l2=...)``);
- the MoE layer's direct gate/up kernel warms the down projection's weights of its pair's expert
  (``moe.fused_moe``).

The interpreter (CPU tests) has no cache to warm: its launches pass ``WARM_L2=False``, which
compiles the prefetch away; the results never depend on it.
"""

from __future__ import annotations

import torch
import triton.language as tl

from .backend import device_function, env_count

L2_PREFETCH_ENV = "GRAPHSERVING_L2_PREFETCH"
"""Environment variable, read at import: the largest batch (rows) whose kernels warm L2 with the
next kernel's weights; unset or 0: never (the default until a device round measures it)."""

L2_PREFETCH_MAX_TOKENS = env_count(L2_PREFETCH_ENV, "a whole number of rows, 0 or more", lowest=0) or 0

LINE_BYTES = 128
"""Bytes of one L2 cache line on Hopper (the unit ``prefetch.global.L2`` fetches)."""

PREFETCH_BLOCK = 128
"""Lines a program asks for per loop iteration (one per thread at 4 warps)."""

_EVICT_LAST = env_count("GRAPHSERVING_L2_PREFETCH_EVICT_LAST", "0 or 1", lowest=0, highest=1) == 1
_PREFETCH_ASM = tl.constexpr("prefetch.global.L2::evict_last [$1];" if _EVICT_LAST else "prefetch.global.L2 [$1];")
"""The instruction (``GRAPHSERVING_L2_PREFETCH_EVICT_LAST=1``, read at import, for A/B rounds: the
warmed lines are evicted after the ones streamed around them)."""


def warm_l2_enabled(device: torch.device, num_tokens: int) -> bool:
    """Whether the kernels of a batch of ``num_tokens`` rows on ``device`` warm L2 for the next
    kernel: CUDA, and at most :data:`L2_PREFETCH_MAX_TOKENS` rows."""
    return device.type == "cuda" and 0 < num_tokens <= L2_PREFETCH_MAX_TOKENS


def line_count(t: torch.Tensor) -> int:
    """128-byte lines spanned by a contiguous tensor's bytes (from its first element).

    Raises:
        ValueError: ``t`` is not contiguous (its bytes would not be one range).
    """
    if not t.is_contiguous():
        raise ValueError(f"an L2 warm-up needs a contiguous tensor; got strides {t.stride()}")
    return -(-t.numel() * t.element_size() // LINE_BYTES)


@device_function
def prefetch_l2(base_ptr, num_lines, part, parts, ENABLED: tl.constexpr, BLOCK: tl.constexpr):
    """Ask L2 for part ``part`` of ``parts`` (about equal runs of lines) of the ``num_lines``
    128-byte lines from ``base_ptr``; nothing when ``ENABLED`` is False (the interpreter)."""
    if ENABLED:
        per_part = tl.cdiv(num_lines, parts)
        first = part * per_part
        bytes_ptr = base_ptr.to(tl.pointer_type(tl.int8))
        for i in range(0, per_part, BLOCK):
            # past the end: the last line again (a repeated prefetch costs nothing and needs no mask)
            line = tl.minimum(first + i + tl.arange(0, BLOCK), num_lines - 1).to(tl.int64)
            tl.inline_asm_elementwise(_PREFETCH_ASM, "=r,l", [bytes_ptr + line * 128],
                                      dtype=tl.int32, is_pure=False, pack=1)
