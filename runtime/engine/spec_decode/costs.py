"""What a verification pass costs against a decode step, measured on the device as the engine runs.

Whether verifying a batch pays depends on the batch: at batch 1 a pass of ``k + 1`` rows per
request reads the same weights as a decode step and costs little more for a large model, but for
a small one its sampler, step kernel and longer GEMMs cost about twice a decode step, and at larger
batches the extra rows approach compute-bound (bench/RESULTS.md, "Speculative decoding resident on
the device"). The engine therefore times its own runs: each continuation of a multi-step decode run
and of a resident verification run (queued while the device is still busy with the run before, so
its events measure device time, not host queuing) records a CUDA event before and after its work;
once both have fired, its device milliseconds per step go into a moving average per kind and batch
size. :meth:`PassCosts.ratio` divides the two for ``policy.verification_pays``.

Only CUDA runs are timed: on the CPU the ratio stays unmeasured (None) and the engine assumes
``policy.UNMEASURED_VERIFICATION_COST``, so CPU runs decide the same way every time.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

DECODE = "decode"
VERIFY = "verify"

SMOOTHING = 0.25
"""Weight of a new run's time in the moving average (the last few runs dominate: batch contents,
context lengths and clocks drift)."""


@dataclass
class PassCosts:
    """Moving averages of device milliseconds per step, per ``(kind, batch size)``.

    Attributes:
        ms_per_step: ``{(DECODE | VERIFY, rows): ms}`` once a run of that kind and size was timed.
        pending: timed runs whose end event has not fired yet: ``(kind, rows, steps, start, end)``.
    """

    ms_per_step: dict[tuple[str, int], float] = field(default_factory=dict)
    pending: list[tuple[str, int, int, torch.cuda.Event, torch.cuda.Event]] = field(default_factory=list)

    @contextmanager
    def timing(self, kind: str, rows: int, steps: int, device: torch.device) -> Iterator[None]:
        """Time the work queued on the current CUDA stream inside the block as one run of ``steps``
        steps of ``rows`` rows (nothing on other devices). Does not wait: :meth:`poll` folds the
        time in once the device has done it."""
        if device.type != "cuda" or steps < 1:
            yield
            return
        stream = torch.cuda.current_stream(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        yield
        end.record(stream)
        self.pending.append((kind, rows, steps, start, end))

    def poll(self) -> None:
        """Fold every finished timed run into :attr:`ms_per_step` (non-blocking)."""
        waiting = []
        for item in self.pending:
            kind, rows, steps, start, end = item
            if end.query():
                self.observe(kind, rows, start.elapsed_time(end) / steps)
            else:
                waiting.append(item)
        self.pending = waiting

    def observe(self, kind: str, rows: int, ms: float) -> None:
        """One run's milliseconds per step into the moving average (pure bookkeeping)."""
        old = self.ms_per_step.get((kind, rows))
        self.ms_per_step[(kind, rows)] = ms if old is None else old + SMOOTHING * (ms - old)

    def ratio(self, rows: int) -> float | None:
        """A verification pass's time in decode steps at ``rows`` rows, or None before both kinds
        were timed at that size."""
        self.poll()
        verify, decode = self.ms_per_step.get((VERIFY, rows)), self.ms_per_step.get((DECODE, rows))
        return verify / decode if verify is not None and decode else None
