"""The reconcile work queue: one run per key at a time, events during a run re-run it once."""

from __future__ import annotations

import asyncio
import threading

from graphserving.operator.workqueue import WorkQueue


async def _until(predicate):
    while not predicate():
        await asyncio.sleep(0.01)


async def test_keys_added_many_times_before_a_run_are_processed_once():
    runs: list[tuple] = []
    queue = WorkQueue(lambda *key: runs.append(key), workers=2)
    for _ in range(5):
        queue.add(("ns", "a"))
    queue.add(("ns", "b"))
    queue.start()
    await asyncio.wait_for(_until(lambda: len(runs) == 2 and queue.idle), 10)
    await queue.stop()
    assert sorted(runs) == [("ns", "a"), ("ns", "b")]


async def test_an_event_during_a_run_reruns_the_key_once_after_it():
    release = threading.Event()
    runs: list[int] = []

    def process(*key):
        runs.append(len(runs))
        if len(runs) == 1:
            release.wait(5)

    queue = WorkQueue(process, workers=3)
    queue.start()
    queue.add(("ns", "a"))
    await asyncio.wait_for(_until(lambda: runs), 5)
    queue.add(("ns", "a"))
    queue.add(("ns", "a"))
    release.set()
    await asyncio.wait_for(_until(lambda: len(runs) == 2 and queue.idle), 5)
    await queue.stop()
    assert runs == [0, 1]


async def test_a_failing_reconcile_is_retried():
    attempts: list[int] = []

    def process(*key):
        attempts.append(1)
        if len(attempts) < 2:
            raise RuntimeError("API unavailable")

    queue = WorkQueue(process, workers=1)
    queue.start()
    queue.add(("ns", "a"))
    await asyncio.wait_for(_until(lambda: len(attempts) == 2 and queue.idle), 10)
    await queue.stop()
    assert len(attempts) == 2
