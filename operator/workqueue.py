"""A deduplicating work queue of GraphServing keys (the controller-runtime pattern, on asyncio).

Watch events only enqueue a key; workers run the (synchronous) reconcile in threads. A key is never
processed by two workers at once; an event for a key being processed marks it dirty, and it runs
again right after. A reconcile's return value schedules its next run (rollout deadline checks,
resync); a failure retries with exponential back-off. Depth, adds, wait and work durations and
retries are recorded in a :class:`~.metrics.WorkQueueMetrics` (controller-runtime's ``workqueue_*``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Hashable

from prometheus_client import CollectorRegistry

from .metrics import WorkQueueMetrics

log = logging.getLogger(__name__)

BACKOFF_BASE_SECONDS = 0.5
BACKOFF_MAX_SECONDS = 60.0


class WorkQueue:
    def __init__(self, process: Callable[..., float | None], workers: int = 4,
                 metrics: WorkQueueMetrics | None = None) -> None:
        """``process(*key)`` reconciles one key and returns seconds until its next run (or None).

        ``metrics``: where depth, adds, durations and retries go (the operator passes
        ``OperatorMetrics.workqueue``); default: a registry of the queue's own, unexported.
        """
        self._process = process
        self._metrics = metrics or WorkQueueMetrics(CollectorRegistry())
        self._workers = workers
        self._queue: asyncio.Queue[Hashable] = asyncio.Queue()
        self._queued: set[Hashable] = set()
        self._active: set[Hashable] = set()
        self._dirty: set[Hashable] = set()
        self._timers: dict[Hashable, asyncio.TimerHandle] = {}
        self._failures: dict[Hashable, int] = {}
        self._tasks: list[asyncio.Task] = []

    def add(self, key: Hashable, delay: float = 0.0) -> None:
        """Enqueue ``key`` now, or after ``delay`` seconds (an earlier pending run wins)."""
        loop = asyncio.get_running_loop()
        if delay > 0:
            pending = self._timers.get(key)
            when = loop.time() + delay
            if pending is not None and pending.when() <= when:
                return
            if pending is not None:
                pending.cancel()
            self._timers[key] = loop.call_at(when, self._fire, key)
            return
        if key in self._active:
            if key not in self._dirty:
                self._dirty.add(key)
                self._metrics.added(key)
        elif key not in self._queued:
            self._metrics.added(key)
            self._push(key)

    def _push(self, key: Hashable) -> None:
        self._queued.add(key)
        self._queue.put_nowait(key)

    def _fire(self, key: Hashable) -> None:
        self._timers.pop(key, None)
        self.add(key)

    def forget(self, key: Hashable) -> None:
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer.cancel()
        self._failures.pop(key, None)

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._worker(i)) for i in range(self._workers)]

    async def stop(self) -> None:
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    @property
    def idle(self) -> bool:
        return not self._queued and not self._active

    async def _worker(self, index: int) -> None:
        while True:
            key = await self._queue.get()
            self._queued.discard(key)
            self._active.add(key)
            self._metrics.started(key)
            requeue: float | None = None
            try:
                requeue = await asyncio.to_thread(self._process, *key)  # type: ignore[misc]
                self._failures.pop(key, None)
            except asyncio.CancelledError:
                raise
            except Exception:
                n = self._failures.get(key, 0) + 1
                self._failures[key] = n
                requeue = min(BACKOFF_MAX_SECONDS, BACKOFF_BASE_SECONDS * 2 ** (n - 1))
                self._metrics.retried()
                log.exception("reconcile of %s failed (attempt %d); retrying in %.1fs", key, n, requeue)
            finally:
                self._active.discard(key)
                self._metrics.finished(key)
            if key in self._dirty:
                self._dirty.discard(key)
                self._push(key)  # counted as an add when it was marked dirty
            elif requeue is not None:
                self.add(key, requeue)
