"""When the fused Triton kernels run, and how one kernel runs on CUDA *and* on the CPU.

- :func:`available` is the single switch the model and the attention code consult: the fused
  kernels run for CUDA tensors when Triton imports, unless ``GRAPHSERVING_KERNELS=torch`` forces
  the pure-torch reference path (for A/B benchmarks and for bisecting a numerical difference).
  The decision is made per call from the device, so CPU inference always takes the reference
  path. Change the variable only before a model is warmed up and its graphs are captured: a graph
  records whichever path ran at capture time.
- :class:`DeviceKernel` wraps one ``@triton.jit``-able function twice: compiled by Triton for CUDA
  tensors, and run by Triton's interpreter (numpy) for CPU tensors. The tests use the second form
  to check every kernel against the reference on machines without a GPU, in the same process as
  CUDA runs and whatever the import order (the interpreter is chosen per launch, not by the
  ``TRITON_INTERPRET`` variable at import time).
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch

KERNELS_ENV = "GRAPHSERVING_KERNELS"
"""Environment variable selecting the kernel path: ``triton`` (default) or ``torch`` (reference)."""

KERNEL_PATHS = ("triton", "torch")


def requested_path() -> str:
    """The kernel path named by ``GRAPHSERVING_KERNELS`` (default ``triton``).

    Raises:
        ValueError: any other value (the message names the variable, the value and the choices).
    """
    value = os.environ.get(KERNELS_ENV, "triton").strip().lower() or "triton"
    if value not in KERNEL_PATHS:
        raise ValueError(f"{KERNELS_ENV}={value!r} is not a kernel path; use one of {', '.join(KERNEL_PATHS)}")
    return value


@functools.cache
def triton_importable() -> bool:
    """True when ``triton`` and ``triton.language`` import (they ship with CUDA builds of torch)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # ImportError, or a broken install that fails on import
        return False
    return True


def available(device: torch.device | str) -> bool:
    """True when the fused Triton kernels should run for tensors on ``device``.

    CUDA device, Triton importable, and ``GRAPHSERVING_KERNELS`` not ``torch``. The CPU always
    gets ``False`` (the interpreter is for tests only: it is orders of magnitude slower).
    """
    if torch.device(device).type != "cuda":
        return False
    return requested_path() == "triton" and triton_importable()


def mm_writes_float32(x: torch.Tensor) -> bool:
    """True when ``torch.mm`` can write float32 straight from ``x``'s 16-bit dtype (cuBLAS with a
    float32 output: the ``out_dtype`` overload, CUDA only in the torch versions that have it), so a
    product that wants float32 needs no cast kernel after it."""
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and _has_mm_out_dtype()


@functools.cache
def _has_mm_out_dtype() -> bool:
    return hasattr(torch.ops.aten.mm, "dtype") and hasattr(torch.ops.aten.mm, "dtype_out")


@functools.cache
def multiprocessor_count(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device (a cached host query; no synchronisation)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_name(device_index: int | None) -> str:
    """A CUDA device's name (``torch.cuda.get_device_name``'s; the current device for None), from the
    same cached properties as :func:`multiprocessor_count`."""
    return torch.cuda.get_device_properties(device_index).name


def env_count(name: str, expected: str, lowest: int = 1, highest: int | None = None) -> int | None:
    """The whole number ``lowest..highest`` (no upper bound when None) in environment variable
    ``name``; None when unset or blank. Raises ``ValueError`` naming the variable and ``expected``
    otherwise. The kernels' A/B and policy knobs read their counts through it."""
    text = os.environ.get(name, "").strip()
    if not text:
        return None
    if not (text.isdigit() and lowest <= int(text) <= (int(text) if highest is None else highest)):
        raise ValueError(f"{name}={text!r}: expected {expected}")
    return int(text)


def num_programs_target(device: torch.device) -> int:
    """How many programs fill the device about twice (the split-K heuristic's target).

    On the CPU (interpreter) a small constant, so tests exercise the split path with few programs.
    """
    if device.type == "cuda":
        return 2 * multiprocessor_count(device.index if device.index is not None else torch.cuda.current_device())
    return 8


def require_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    """Raise ValueError unless ``t``'s last dimension is contiguous (what every kernel here indexes)."""
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension (stride {t.stride(-1)})")


class DeviceKernel:
    """One Triton kernel function, compiled for CUDA tensors and interpreted for CPU tensors.

    Use as ``kernel.on(tensor.device)[grid](*args, **constexprs)``. Both variants are built on
    first use; ``jit_options`` go to ``triton.jit`` (e.g. ``do_not_specialize``).
    :meth:`is_interpreted` tells a launcher which variant it got (the interpreter cannot run
    ``tl.dot`` on bfloat16 operands, so kernels upcast there).

    Why not just ``TRITON_INTERPRET=1``: Triton (3.x) reads that variable when
    ``triton.language`` is imported and when a function is decorated; its standard library
    (``tl.sum``, ``tl.max``, ``tl.cdiv``...) is itself ``@jit``-decorated, so whichever mode was
    active at import wins for the whole process. The interpreted launcher here runs those
    functions interpreted for the duration of one launch instead (see :func:`_interpreted_stdlib`),
    so CPU and CUDA launches can share one process in any import order.
    """

    def __init__(self, fn, *, pdl: bool = False, **jit_options):
        self.fn = fn
        self.pdl = pdl
        self.jit_options = jit_options
        self._compiled = None
        self._launchers: dict[bool, object] = {}
        self._interpreted = None
        functools.update_wrapper(self, fn)

    def on(self, device: torch.device, *, tokens: int | None = None):
        """The launchable kernel for tensors on ``device`` (``launchable[grid](*args, **kwargs)``).

        A kernel built with ``pdl=True`` takes a last ``USE_PDL: tl.constexpr`` parameter, which the
        launcher sets: True with programmatic dependent launch on CUDA where :func:`pdl_enabled`
        says so for a batch of ``tokens`` rows (the kernel must then call :func:`pdl_enter` before
        it reads anything an earlier kernel wrote), False in the interpreter and elsewhere.

        Raises:
            TypeError: a ``pdl=True`` kernel launched on CUDA without ``tokens``.
        """
        if device.type == "cpu":
            if self._interpreted is None:
                from triton.runtime.interpreter import InterpretedFunction

                self._interpreted = _InterpretedLauncher(InterpretedFunction(self.fn), self.fn.__globals__,
                                                         {"USE_PDL": False} if self.pdl else {})
            return self._interpreted
        if self._compiled is None:
            import triton

            self._compiled = triton.jit(self.fn, **self.jit_options)
        if not self.pdl:
            return self._compiled
        if tokens is None:
            raise TypeError(f"{self.fn.__name__} launches with programmatic dependent launch: pass tokens=")
        use = pdl_enabled(device, tokens)
        if use not in self._launchers:
            self._launchers[use] = _PdlLauncher(self._compiled, use)
        return self._launchers[use]

    @staticmethod
    def is_interpreted(launchable) -> bool:
        """True for the interpreter variant (or when ``TRITON_INTERPRET=1`` made ``triton.jit`` one)."""
        return isinstance(launchable, _InterpretedLauncher) or type(launchable).__name__ == "InterpretedFunction"


def device_function(fn):
    """A Triton device function that the kernels here call (``triton.jit(fn)``; the compiler
    inlines it). An interpreted launch of a kernel runs the device functions it names as module
    globals interpreted too (:func:`_interpreted_device_functions`), so one definition serves
    both variants of :class:`DeviceKernel`."""
    import triton

    return triton.jit(fn)


class _InterpretedLauncher:
    """``launcher[grid](...)`` runs the interpreted kernel with an interpreted standard library
    and interpreted device functions (and ``extra`` keyword arguments: ``USE_PDL=False``)."""

    def __init__(self, interpreted, kernel_globals: dict, extra: dict):
        self.interpreted = interpreted
        self.kernel_globals = kernel_globals
        self.extra = extra

    def __getitem__(self, grid):
        launch = self.interpreted[grid]

        def run(*args, **kwargs):
            with _interpreted_stdlib(), _interpreted_device_functions(self.kernel_globals):
                return launch(*args, **self.extra, **kwargs)

        return run


class _PdlLauncher:
    """``launcher[grid](...)`` of a compiled ``pdl=True`` kernel: sets ``USE_PDL`` and Triton's
    ``launch_pdl`` launch option (programmatic stream serialisation; inside a CUDA-graph capture a
    programmatic dependency edge) together."""

    def __init__(self, compiled, use_pdl: bool):
        self.compiled = compiled
        self.options = {"USE_PDL": True, "launch_pdl": True} if use_pdl else {"USE_PDL": False}

    def __getitem__(self, grid):
        launch = self.compiled[grid]
        return lambda *args, **kwargs: launch(*args, **self.options, **kwargs)


PDL_ENV = "GRAPHSERVING_PDL"
"""Environment variable: ``0`` turns programmatic dependent launch off, ``all`` on for every batch
size (A/B benchmarks, bisecting); by default it is on for batches of at most
:data:`PDL_MAX_TOKENS` rows where the device and Triton support it (:func:`pdl_enabled`)."""

PDL_MAX_TOKENS = 8
"""The largest batch (rows a kernel is launched for: a decode step's tokens) launched with PDL by
default. Measured on an H200 (bench/RESULTS.md, "Programmatic dependent launch"): PDL shortens the
graph replay at batches 1-8 by 1-8 % (Llama-3.2-1B, Qwen3-8B, Qwen3-30B-A3B shapes) and lengthens
it from batch 16 on SmolLM2-135M (3-5 %) and at 64 on Llama-3.2-1B and Qwen3-8B (about 1 %), where
the kernels fill the GPU and there is little launch latency left to hide. A graph that mixes PDL
and plain launches stays ordered: every pairing waits for the kernel before it."""


@functools.cache
def _pdl_supported(device_index: int) -> bool:
    import triton

    major = torch.cuda.get_device_capability(device_index)[0]
    version = tuple(int(p) for p in triton.__version__.split(".")[:2] if p.isdigit())
    return major >= 9 and version >= (3, 4)


def pdl_enabled(device: torch.device, tokens: int) -> bool:
    """Whether kernels built with ``pdl=True`` launch with programmatic dependent launch on
    ``device`` for a batch of ``tokens`` rows: compute capability 9.0 or newer (Hopper:
    ``griddepcontrol``), Triton 3.4 or newer (``launch_pdl``), and ``tokens`` at most
    :data:`PDL_MAX_TOKENS` unless ``GRAPHSERVING_PDL`` is ``all`` (``0``: never). Read per launch,
    so set the variable before warmup and capture, like :data:`KERNELS_ENV`.

    The contract (docs/architecture.md, "Kernels"): every such kernel calls :func:`pdl_enter`
    first, in every program, before any load of data an earlier kernel wrote and before any
    early exit, so it cannot complete before the kernel it overlaps; kernels launched without the
    attribute (cuBLAS, torch) keep ordinary stream order.
    """
    mode = os.environ.get(PDL_ENV, "").strip().lower()
    if mode not in ("", "1", "0", "all"):
        raise ValueError(f"{PDL_ENV}={mode!r}: expected 0 (off), 1 (default: batches of at most "
                         f"{PDL_MAX_TOKENS} rows) or all")
    if device.type != "cuda" or mode == "0" or (mode != "all" and tokens > PDL_MAX_TOKENS):
        return False
    return _pdl_supported(device.index if device.index is not None else torch.cuda.current_device())


@contextlib.contextmanager
def _interpreted_device_functions(kernel_globals: dict):
    """Swap the compiled device functions (:func:`device_function`) a kernel's module names for
    interpreted ones during one interpreted launch, then restore them (not thread-safe, as
    :func:`_interpreted_stdlib`); likewise in the modules those functions come from, transitively,
    so a device function imported from another module may call that module's own."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    swapped: list[tuple[dict, dict]] = []
    pending, seen = [kernel_globals], set()
    while pending:
        module_globals = pending.pop()
        if id(module_globals) in seen:
            continue
        seen.add(id(module_globals))
        compiled = {name: value for name, value in module_globals.items() if isinstance(value, JITFunction)}
        swapped.append((module_globals, compiled))
        pending.extend(value.fn.__globals__ for value in compiled.values())
    try:
        for module_globals, compiled in swapped:
            for name, value in compiled.items():
                module_globals[name] = InterpretedFunction(value.fn)
        yield
    finally:
        for module_globals, compiled in swapped:
            module_globals.update(compiled)


@contextlib.contextmanager
def _interpreted_stdlib():
    """Swap ``triton.language``'s compiled standard functions for interpreted ones, then restore.

    The interpreter patches ``triton.language`` (and ``triton.language.core``, whose builtins the
    standard functions call) while it runs and does not undo every patch made for nested
    function calls; everything it may touch is snapshotted here and restored afterwards, so the
    compiler sees an untouched ``triton.language`` in the same process.

    Not thread-safe: a kernel compiled in another thread meanwhile would see the swapped
    functions. Only the CPU (test) path uses it.
    """
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    touched = [tl, tl.core, tl.math, tl.core.tensor, tl.core.dtype]
    touched += [getattr(tl.core, name) for name in ("condition", "tensor_descriptor_base") if hasattr(tl.core, name)]
    snapshot = [(obj, dict(vars(obj))) for obj in touched]
    try:
        for name, member in list(vars(tl).items()):
            if isinstance(member, JITFunction):
                setattr(tl, name, InterpretedFunction(member.fn))
        yield
    finally:
        for obj, before in snapshot:
            now = vars(obj)
            if isinstance(obj, type):  # methods the interpreter added to a class (``__bool__``...)
                for name in [n for n in now if n not in before]:
                    delattr(obj, name)
            for name, value in before.items():
                if now.get(name, _MISSING) is not value:
                    setattr(obj, name, value)


_MISSING = object()


def next_power_of_2(n: int) -> int:
    """Smallest power of two ``>= n`` (``>= 1``); Triton block shapes must be powers of two."""
    return 1 << max(0, int(n) - 1).bit_length()
