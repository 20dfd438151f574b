"""A real uvicorn server for the API tests (an app on a free loopback port, in a thread), the
worker's app over a fresh engine on it, and the part of a worker's lifecycle its probes read."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from graphserving.contract.report import Phase
from graphserving.contract.worker_config import EngineLimits
from graphserving.runtime.api.app import ServerState, build_app
from graphserving.runtime.engine.async_engine import AsyncLLMEngine
from graphserving.runtime.engine.core import LLMEngine
from graphserving.runtime.engine.metrics import EngineMetrics
from graphserving.runtime.lifecycle.outcome import Readiness


class ReadyLifecycle:
    """What ``/healthz`` and ``/readyz`` read of a worker's lifecycle: serving and ready (the
    report and recapture endpoints are tested on a real worker, tests/runtime/test_worker_http.py)."""

    def __init__(self):
        self.phase = Phase.READY
        self.readiness = Readiness()
        self.readiness.set_ready("eager")


@contextlib.contextmanager
def serving_app(app, start_timeout_s: float = 30.0) -> Iterator[str]:
    """Serve ``app`` (ASGI) until the block ends; yields its base URL (``http://127.0.0.1:PORT``).

    Raises:
        AssertionError: uvicorn did not start within ``start_timeout_s`` seconds.
    """
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    uv = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    end = time.monotonic() + start_timeout_s
    while not uv.started and time.monotonic() < end:
        time.sleep(0.02)
    assert uv.started, "uvicorn did not start"
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        uv.should_exit = True
        thread.join(10)
        sock.close()


@dataclass
class EngineServer:
    """What :func:`serving_engine` serves: its URL, the app, the engine, its loop and metrics."""

    url: str
    app: object
    engine: LLMEngine
    async_engine: AsyncLLMEngine
    metrics: EngineMetrics


@contextlib.contextmanager
def serving_engine(loaded, limits: EngineLimits, model_name: str, *, lifecycle=None, api_key: str | None = None,
                   **bounds) -> Iterator[EngineServer]:
    """The worker's app over a fresh engine of ``loaded`` (a LoadedModel) with ``limits``, served
    until the block ends; ``bounds`` are AsyncLLMEngine's admission bounds, ``lifecycle`` what the
    probes read (default :class:`ReadyLifecycle`)."""
    metrics = EngineMetrics(model_name, limits.max_num_seqs, limits.max_num_batched_tokens)
    engine = LLMEngine(loaded.model, loaded.config, loaded.tokenizer, limits, metrics=metrics)
    async_engine = AsyncLLMEngine(engine, **bounds)
    async_engine.start()
    state = ServerState(model_name, lifecycle or ReadyLifecycle(), metrics, engine=async_engine, api_key=api_key)
    app = build_app(state)
    try:
        with serving_app(app) as url:
            yield EngineServer(url, app, engine, async_engine, metrics)
    finally:
        async_engine.shutdown()
