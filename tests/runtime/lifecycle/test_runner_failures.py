"""A graph runner that cannot be configured (its static buffers not allocated: a CUDA out-of-memory)
fails the worker's graphs, never the worker: it keeps serving eagerly, reports the failure with a
valid report, and a later recapture brings it back. Emulated graphs on the CPU, a real Worker."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

torch = pytest.importorskip("torch")

from graphserving.contract.report import Phase  # noqa: E402
from graphserving.contract.worker_config import EngineLimits, GraphConfig, ReadinessPolicy, WorkerConfig  # noqa: E402
from graphserving.runtime import worker as worker_mod  # noqa: E402
from graphserving.runtime.graphs import runner as runner_mod  # noqa: E402
from tiny_preset import tiny_loaded  # noqa: E402

CONFIG = WorkerConfig(
    model_name="tiny", model_path="tiny",
    engine=EngineLimits(max_num_seqs=4, max_num_batched_tokens=64, num_kv_blocks=64, block_size=16),
    graphs=GraphConfig(capture_sizes=[1, 2, 4], piecewise_capture_sizes=[16, 32, 64],
                       readiness=ReadinessPolicy(min_coverage=0.5)),
)




def failing_serving_buffers(monkeypatch, fail_on: set[int]) -> list[int]:
    """Make the n-th allocation of a serving runner's static buffers (n in ``fail_on``, from 1)
    raise as a CUDA out-of-memory would; warmup's and the start-up placeholder's (1 row) succeed."""
    real, builds = runner_mod.StaticBuffers, []

    def allocate(max_tokens, *args, **kwargs):
        if max_tokens > 1:
            builds.append(max_tokens)
            if len(builds) in fail_on:
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(max_tokens, *args, **kwargs)

    monkeypatch.setattr(runner_mod, "StaticBuffers", allocate)
    return builds


async def _serving(http: httpx.AsyncClient, worker) -> None:
    end = time.time() + 120
    while not worker.server.serving and time.time() < end:
        await asyncio.sleep(0.05)
    assert worker.server.serving


def run_worker(talk) -> None:
    worker = worker_mod.Worker(CONFIG, tiny_loaded(), 0.1, environ={"GRAPHSERVING_EMULATE_GRAPHS": "1"})
    published = []
    worker.lifecycle.listeners.append(published.append)

    async def main():
        transport = httpx.ASGITransport(app=worker.app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://w", timeout=120) as http:
            worker.start()
            await _serving(http, worker)
            await talk(http, worker, published)

    try:
        asyncio.run(main())
    finally:
        worker.shutdown()


def test_a_runner_that_cannot_be_configured_at_start_up_fails_the_graphs_and_still_serves(monkeypatch):
    failing_serving_buffers(monkeypatch, fail_on={1})

    async def talk(http, worker, published):
        report = (await http.get("/v1/graphs")).json()
        assert report["phase"] == "Failed" and "out of memory" in report["failureReason"]
        assert report["coverage"] == 0.0 and report["kvCache"]["numBlocks"] == 64
        r = await http.post("/v1/completions", json={"model": "tiny", "prompt": [5, 6], "max_tokens": 2})
        assert r.status_code == 200, r.text  # served eagerly
        r = await http.post("/v1/graphs/recapture", json={"capture_sizes": [1, 2, 4]})
        assert r.status_code == 200, r.text
        assert r.json()["phase"] == "Ready" and r.json()["coverage"] == 1.0
        assert published[-1].phase is Phase.READY

    run_worker(talk)


def test_a_recapture_that_cannot_allocate_fails_with_a_valid_published_report(monkeypatch):
    failing_serving_buffers(monkeypatch, fail_on={2})

    async def talk(http, worker, published):
        assert (await http.get("/v1/graphs")).json()["phase"] == "Ready"
        r = await http.post("/v1/graphs/recapture", json={"capture_sizes": [4], "piecewise_capture_sizes": [64]})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["phase"] == "Failed" and "out of memory" in body["failureReason"]
        assert body["coverage"] == 0.0  # every graph was dropped, none recaptured
        assert published[-1].phase is Phase.FAILED
        assert (await http.get("/v1/graphs")).status_code == 200
        r = await http.post("/v1/completions", json={"model": "tiny", "prompt": [5, 6], "max_tokens": 2})
        assert r.status_code == 200, r.text

    run_worker(talk)
