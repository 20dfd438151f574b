"""Fused Triton kernels for the decoder layer (CUDA), with the pure-torch code as the reference.

A decode step of the reference path launches about 50 small kernels per layer (RMSNorm alone is
eight elementwise ops; RoPE about ten; the batched paged attention gathers the whole block
table). Inside a CUDA graph the launch overhead is gone, but each kernel still costs a few
microseconds, and the reference attention reads all W blocks of the block table whatever the
context. With these kernels a layer is nine or ten kernels::

    fused_add_rms_norm -> QKV GEMM -> rope_and_write_kv -> paged_decode_attention (1 or 2 kernels)
    -> O GEMM -> fused_add_rms_norm -> gate/up GEMM -> silu_and_mul -> down GEMM

(the residual adds are folded into the norms that follow them), and, where
:func:`use_fused_norm_linear` allows it (off by default: not faster than cuBLAS on the H200 yet),
six or seven::

    fused_add_rms_norm_linear (norm + QKV) -> rope_and_write_kv -> paged_decode_attention
    -> O GEMM -> fused_add_rms_norm_linear (add + norm + gate/up + SwiGLU) -> down GEMM

At batch 1 (:func:`use_gemv`: weights up to 1 GiB, hidden sizes up to 2048, on some devices more)
the same six with the skinny GEMM in place of ``fused_add_rms_norm_linear`` and cuBLAS, every one a
PDL kernel::

    fused_add_rms_norm_gemv (norm + QKV) -> rope_and_write_kv -> paged_decode_attention -> gemv (O)
    -> fused_add_rms_norm_gemv (add + norm + gate/up + SwiGLU) -> gemv (down)

where the attention's split combine moves into the O projection (:func:`combine_gemv`) and, for head
dimensions up to 128, RoPE (and Qwen3's q/k norm) and the cache write into the attention kernel
(:func:`rope_write_and_decode_attention`): five kernels a layer.

Public functions (each documented in its module):

- :func:`fused_add_rms_norm`, :func:`rms_norm` (``norm.py``)
- :func:`fused_add_rms_norm_linear`, :func:`use_fused_norm_linear` (``norm_linear.py``): the norm
  fused into the projection after it, and the shape policy that decides when the model uses it
- :func:`gemv`, :func:`fused_add_rms_norm_gemv`, :func:`use_gemv` (``skinny_gemm.py``): the
  projections of batches of at most eight rows as PDL kernels (the norm and SwiGLU folded in), so
  that a small decode step's layer is a chain of PDL kernels with no cuBLAS GEMM in it, and the
  shape policy (one row, weights up to 1 GiB, hidden sizes up to 2048 by default)
- :func:`rope_and_write_kv` (``rope.py``)
- :func:`paged_decode_attention`, :func:`rope_write_and_decode_attention` (``decode_attention.py``;
  the second folds ``rope_and_write_kv`` into the first kernel, used where
  :func:`use_fused_rope_decode` says so: head dimensions up to 128 by default; with
  ``defer_combine`` the partials come back uncombined as :class:`DecodePartials`); their split
  count from :func:`choose_num_splits` (``decode_splits.py``)
- :func:`combine_gemv`, :func:`use_combine_gemv` (``o_proj.py``): a one-row O projection that
  merges the attention's partials in its prologue (the combine kernel's launch saved)
- :func:`silu_and_mul` (``activation.py``)
- :func:`fused_route_topk`, :func:`fused_moe` (``moe.py``): mixture-of-experts routing and the
  grouped expert GEMMs, capturable for any routing; :func:`fused_add_rms_norm_gemv_route`
  (``skinny_gemm.py``) routes inside the router projection's kernel where :func:`use_route_in_router`
  says so
- :func:`available`: whether the model should call them for a device (``backend.py``).

On Hopper the kernels of batches of at most ``backend.PDL_MAX_TOKENS`` rows launch with programmatic
dependent launch (``pdl.py``; docs/architecture.md, "Kernels"; ``GRAPHSERVING_PDL=0`` turns it off).
``GRAPHSERVING_KERNELS=torch`` forces the reference path on CUDA (A/B benchmarks); the CPU always
takes the reference path. Every kernel also runs on CPU tensors through Triton's interpreter (for
the tests; orders of magnitude slower). Importing this package does not import Triton: the kernel
modules load on first use.
"""

from __future__ import annotations

import importlib

from .backend import KERNELS_ENV, available, mm_writes_float32, requested_path, triton_importable

_LAZY = {
    "fused_add_rms_norm": "norm",
    "rms_norm": "norm",
    "rope_and_write_kv": "rope",
    "paged_decode_attention": "decode_attention",
    "rope_write_and_decode_attention": "decode_attention",
    "use_fused_rope_decode": "decode_attention",
    "DecodePartials": "decode_attention",
    "choose_num_splits": "decode_splits",
    "combine_gemv": "o_proj",
    "use_combine_gemv": "o_proj",
    "silu_and_mul": "activation",
    "fused_add_rms_norm_linear": "norm_linear",
    "use_fused_norm_linear": "norm_linear",
    "gemv": "skinny_gemm",
    "fused_add_rms_norm_gemv": "skinny_gemm",
    "fused_add_rms_norm_gemv_route": "skinny_gemm",
    "use_gemv": "skinny_gemm",
    "fused_route_topk": "moe",
    "fused_moe": "moe",
    "use_route_in_router": "moe",
}

__all__ = ["KERNELS_ENV", "available", "mm_writes_float32", "requested_path", "triton_importable", *_LAZY]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
