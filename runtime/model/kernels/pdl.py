"""Programmatic dependent launch (PDL) inside the kernels: the one device function they call.

A kernel launched with PDL (``DeviceKernel(..., pdl=True)``, ``backend.pdl_enabled``) may start
while the kernel before it in the stream (or the graph) is still draining: its launch latency and
prologue overlap the previous kernel's tail. It must therefore not read what that kernel writes
before ``griddepcontrol.wait``, and it must not finish before it either (a later kernel waits on
this one only). :func:`pdl_enter`, the first statement of every program of such a kernel, does
both; then it lets the next kernel's programs launch (``griddepcontrol.launch_dependents``).
What no kernel of the forward pass writes may be loaded before it: weights (the skinny GEMM,
``skinny_gemm.py``, loads its first weight tile first), the RoPE tables, and the step's metadata
(positions, slot mapping, sequence lengths, block table: written before the pass by the host's
fill or the in-place advance between replays; a verification batch's rows are built at the start of
the pass, several kernels earlier, and the kernel in between waited for them). Those loads then
overlap the previous kernel's tail. Safe transitively: a kernel released by ``launch_dependents``
runs only once its predecessor has passed its own wait, i.e. once every earlier kernel finished.
"""

from __future__ import annotations

import triton.language as tl

from .backend import device_function


@device_function
def pdl_enter(USE_PDL: tl.constexpr):
    """Wait for the overlapped kernel (and its writes), then release the next one; nothing when
    ``USE_PDL`` is False (no PDL launch, the interpreter)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
