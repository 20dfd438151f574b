"""Capture/replay backends: real CUDA graphs, and an emulation with the same contract for CPUs.

Both backends capture a zero-argument callable that reads only static tensors and writes its
results into static tensors (the graph runner's buffers); ``replay()`` re-executes that work. The emulated
backend enforces what a CUDA graph silently assumes, so CI catches contract violations without a
GPU:

- replay reads the *current contents* of the static buffers (stale rows are read, as on a GPU);
- replay writes into the *same static tensors* every time (a consumer holding a reference sees
  them overwritten by the next replay, as on a GPU);
- every tensor address recorded at capture (weights, KV cache, static buffers) must be unchanged
  at replay; otherwise :class:`StaleGraphError` (on a GPU the graph would read freed memory).
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch


class CaptureError(RuntimeError):
    """Capturing a graph failed (the message carries the cause)."""


class StaleGraphError(RuntimeError):
    """A graph would replay against tensors whose addresses changed since capture."""


@dataclass
class CapturedGraph:
    """One captured graph: ``replay()`` re-runs it; results land in its static tensors."""

    replay: Callable[[], None]
    memory_bytes: int
    capture_seconds: float


class GraphBackend:
    """Interface: ``capture(fn, watched)`` returns a :class:`CapturedGraph`."""

    name = "base"
    is_real = False

    def capture(
        self, fn: Callable[[], None], watched: Callable[[], Iterable[torch.Tensor]]
    ) -> CapturedGraph:
        """Capture ``fn``; ``watched()`` lists the tensors whose addresses the graph records."""
        raise NotImplementedError

    @contextlib.contextmanager
    def capture_session(self) -> Iterator[None]:
        """Around a batch of captures: every live object moved to the permanent generation, so that
        the collections a capture triggers (``torch.cuda.graph`` collects on entry) scan only what
        capture allocates and no finaliser of an older object runs mid-capture.

        A process that had already frozen its start-up objects (a serving worker recapturing in
        place) gets them back frozen, with the capture's long-lived objects joining them after one
        full collection; unfreezing alone would thaw start-up objects for the rest of its life."""
        was_frozen = gc.get_freeze_count() > 0
        gc.collect()
        gc.freeze()
        try:
            yield
        finally:
            gc.unfreeze()
            if was_frozen:
                gc.collect()
                gc.freeze()

    def synchronize(self) -> None:
        pass

    def memory_in_use(self) -> int:
        """Device bytes in use by this process's graphs and tensors (0 where not measurable)."""
        return 0


class EmulatedGraphBackend(GraphBackend):
    """Replays by calling the recorded callable again; enforces the CUDA-graph contract."""

    name = "emulated"

    def capture(self, fn, watched):
        start = time.perf_counter()
        fn()
        recorded = [(t.data_ptr(), tuple(t.shape)) for t in watched()]

        def replay() -> None:
            current = [(t.data_ptr(), tuple(t.shape)) for t in watched()]
            if current != recorded:
                moved = next((i for i, (a, b) in enumerate(zip(current, recorded)) if a != b), len(recorded))
                raise StaleGraphError(
                    f"watched tensor #{moved} moved or changed shape since capture; "
                    "invalidate and recapture the graph before replaying it"
                )
            fn()

        return CapturedGraph(replay, 0, time.perf_counter() - start)


class CudaGraphBackend(GraphBackend):
    """Real CUDA graphs: one memory pool shared by every graph, captured on a side stream.

    Graph memory per graph is the growth of device memory in use (``torch.cuda.mem_get_info``)
    across its capture, which counts the pool's new segments and the driver's graph objects.
    """

    name = "cuda"
    is_real = True

    def __init__(self, device: torch.device, warmup_runs: int = 2):
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device=device)
        self.warmup_runs = warmup_runs

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def memory_in_use(self) -> int:
        free, total = torch.cuda.mem_get_info(self.device)
        return total - free

    def capture(self, fn, watched):
        start = time.perf_counter()
        # Warm up on the capture stream: lazy initialisation (cuBLAS handles, autotuning, allocator
        # growth for temporaries) must happen outside the capture.
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for _ in range(self.warmup_runs):
                fn()
        self.synchronize()
        before = self.memory_in_use()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
                fn()
        except Exception as exc:  # the capture is unusable; report why
            raise CaptureError(f"{type(exc).__name__}: {exc}") from exc
        self.synchronize()
        used = max(0, self.memory_in_use() - before)
        return CapturedGraph(graph.replay, used, time.perf_counter() - start)


def make_backend(device: torch.device) -> GraphBackend:
    """The real CUDA backend on a CUDA device, the emulation elsewhere."""
    if device.type == "cuda":
        return CudaGraphBackend(device)
    return EmulatedGraphBackend()
