"""The work queue's metrics (controller-runtime's ``workqueue_*``), on a real WorkQueue with a
clock the test advances."""

from __future__ import annotations

import asyncio
import threading

from prometheus_client import CollectorRegistry

from graphserving.operator.metrics import WorkQueueMetrics
from graphserving.operator.workqueue import WorkQueue


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def value(registry: CollectorRegistry, name: str) -> float | None:
    return registry.get_sample_value(name, {"name": "graphserving"})


async def _until(predicate) -> None:
    while not predicate():
        await asyncio.sleep(0.01)


async def test_adds_depth_and_durations_follow_the_keys():
    registry, clock = CollectorRegistry(), Clock()
    done: list[tuple] = []

    def reconcile(*key):
        clock.now += 3.0
        done.append(key)

    queue = WorkQueue(reconcile, workers=1, metrics=WorkQueueMetrics(registry, clock=clock))
    for _ in range(3):
        queue.add(("ns", "a"))  # one add: the key already waits
    queue.add(("ns", "b"))
    assert value(registry, "workqueue_adds_total") == 2
    assert value(registry, "workqueue_depth") == 2
    clock.now += 2.0
    queue.start()
    await asyncio.wait_for(_until(lambda: len(done) == 2 and queue.idle), 10)
    await queue.stop()
    assert value(registry, "workqueue_depth") == 0
    assert value(registry, "workqueue_queue_duration_seconds_count") == 2
    assert value(registry, "workqueue_queue_duration_seconds_sum") == 2.0 + 5.0  # b waits for a's 3 s too
    assert value(registry, "workqueue_work_duration_seconds_count") == 2
    assert value(registry, "workqueue_work_duration_seconds_sum") == 6.0
    assert value(registry, "workqueue_retries_total") == 0


async def test_an_add_during_a_run_counts_once_and_waits_from_that_add():
    registry, clock = CollectorRegistry(), Clock()
    started, release = threading.Event(), threading.Event()
    runs: list[int] = []

    def reconcile(*key):
        runs.append(1)
        if len(runs) == 1:
            started.set()
            release.wait(5)

    metrics = WorkQueueMetrics(registry, clock=clock)
    queue = WorkQueue(reconcile, workers=2, metrics=metrics)
    queue.start()
    queue.add(("ns", "a"))
    await asyncio.wait_for(asyncio.to_thread(started.wait, 5), 10)
    clock.now += 4.0
    assert value(registry, "workqueue_longest_running_processor_seconds") == 4.0
    assert value(registry, "workqueue_unfinished_work_seconds") == 4.0
    queue.add(("ns", "a"))
    queue.add(("ns", "a"))
    assert value(registry, "workqueue_adds_total") == 2
    assert value(registry, "workqueue_depth") == 1
    clock.now += 1.0
    release.set()
    await asyncio.wait_for(_until(lambda: len(runs) == 2 and queue.idle), 10)
    await queue.stop()
    assert value(registry, "workqueue_depth") == 0
    assert value(registry, "workqueue_queue_duration_seconds_sum") == 0.0 + 1.0
    assert value(registry, "workqueue_work_duration_seconds_sum") == 5.0 + 0.0
    assert value(registry, "workqueue_longest_running_processor_seconds") == 0.0


async def test_a_failed_reconcile_counts_a_retry_and_its_delayed_add():
    registry = CollectorRegistry()
    attempts: list[int] = []

    def reconcile(*key):
        attempts.append(1)
        if len(attempts) == 1:
            raise RuntimeError("API unavailable")

    queue = WorkQueue(reconcile, workers=1, metrics=WorkQueueMetrics(registry))
    queue.start()
    queue.add(("ns", "a"))
    await asyncio.wait_for(_until(lambda: len(attempts) == 2 and queue.idle), 10)
    await queue.stop()
    assert value(registry, "workqueue_retries_total") == 1
    assert value(registry, "workqueue_adds_total") == 2
    assert value(registry, "workqueue_work_duration_seconds_count") == 2
