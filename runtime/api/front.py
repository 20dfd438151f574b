"""The lifecycle endpoints: liveness, readiness, metrics, the graph report and recapture.

They answer from the moment the server starts (before warmup and capture), so that Kubernetes
probes see a live process; every other path answers 503 until the engine serves
(runtime/api/app.py). See docs/architecture.md, "Lifecycle".

- ``GET /healthz`` (and ``GET /health``, the path vLLM and load balancers probe): 200
  ``{"alive": true, "phase"}`` while the process and (once started) the engine loop are alive;
  500 ``{"alive": false, "reason"}`` once the engine loop stopped.
- ``GET /version``: ``{"version"}``, the installed ``graphserving`` distribution's version.
- ``GET /readyz``: 200 only when the lifecycle's readiness holds and the engine serves; 503 with
  ``{"ready", "phase", "reason"}`` otherwise.
- ``GET /metrics``: engine and graph metrics (Prometheus text format).
- ``GET /v1/graphs``: the current :class:`~graphserving.contract.report.WorkerReport`.
- ``POST /v1/graphs/recapture``: body a ``GraphConfig`` (fields not given keep their current
  values) or a ``RecaptureRequest`` (a whole GraphConfig): recapture in place on the engine loop
  thread, without reloading the model; answers with the new report (409 while starting or
  draining, 400 naming the field for an invalid body or capture size).
"""

from __future__ import annotations

import asyncio
import importlib.metadata
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError

from graphserving.contract.graph_policy import CaptureSizeError
from graphserving.contract.report import Phase, RecaptureRequest, WorkerReport
from graphserving.contract.worker_config import GraphConfig, WorkerConfig
from ..lifecycle.outcome import Readiness
from ..lifecycle.phases import RecaptureRefused
from .protocol import APIError

if TYPE_CHECKING:
    from .app import ServerState


class Lifecycle(Protocol):
    """What the endpoints read of the worker's lifecycle (runtime/lifecycle/phases.py,
    ``WorkerLifecycle``)."""

    phase: Phase
    readiness: Readiness
    config: WorkerConfig

    def report(self) -> WorkerReport: ...

    def recapture(self, graphs: GraphConfig) -> WorkerReport:
        """Recapture in place (on the engine loop thread). Raises CaptureSizeError, RecaptureRefused."""
        ...


def not_serving(state: ServerState) -> APIError:
    """The 503 (``code`` ``not_ready``) that every path but the lifecycle endpoints answers until
    the engine serves."""
    return APIError(503, f"the worker is not serving yet (phase {state.lifecycle.phase.value})",
                    type="service_unavailable", code="not_ready")


async def healthz(request: Request):
    state: ServerState = request.app.state.server
    if state.engine is not None and not state.engine.is_running:
        return JSONResponse({"alive": False, "reason": "engine loop stopped"}, status_code=500)
    return {"alive": True, "phase": state.lifecycle.phase.value}


async def version(_request: Request):
    return {"version": importlib.metadata.version("graphserving")}


async def readyz(request: Request):
    state: ServerState = request.app.state.server
    lifecycle = state.lifecycle
    readiness = lifecycle.readiness
    # the lifecycle decides before the engine loop serves: wait for it too
    ready = readiness.ready and state.serving
    reason = readiness.reason if state.serving or not readiness.ready else "starting the server"
    body = {"ready": ready, "phase": lifecycle.phase.value, "reason": reason}
    return JSONResponse(body, status_code=200 if ready else 503)


async def metrics(request: Request):
    state: ServerState = request.app.state.server
    return Response(await asyncio.to_thread(state.metrics.render), media_type=CONTENT_TYPE_LATEST)


async def graphs(request: Request):
    state: ServerState = request.app.state.server
    return Response(state.lifecycle.report().to_json(), media_type="application/json")


async def recapture(request: Request):
    state: ServerState = request.app.state.server
    try:
        body = await request.json()
    except (ValueError, RecursionError):
        return APIError(400, "the body is not valid JSON", code="invalid_json").response()
    try:
        new_graphs = _requested_graphs(state, body)
    except APIError as exc:
        return exc.response()
    if not state.serving:
        return APIError(409, f"cannot recapture during start-up (phase {state.lifecycle.phase.value})",
                        code="not_ready", type="conflict").response()
    lifecycle = state.lifecycle
    try:
        report = await asyncio.wrap_future(state.engine.call_in_loop(lambda: lifecycle.recapture(new_graphs)))
    except CaptureSizeError as exc:
        param = "piecewise_capture_sizes" if "max_num_batched_tokens" in str(exc) else "capture_sizes"
        return APIError(400, str(exc), param=param, code="invalid_value").response()
    except RecaptureRefused as exc:
        return APIError(409, str(exc), code="not_ready", type="conflict").response()
    return Response(report.to_json(), media_type="application/json")


def _requested_graphs(state: ServerState, body: Any) -> GraphConfig:
    """The graph config a recapture body asks for: a ``RecaptureRequest`` (it has ``graphs``),
    or a partial ``GraphConfig`` over the current one.

    Raises:
        APIError: 400 when the body is not a JSON object or a field is invalid (``param``).
    """
    if not isinstance(body, dict):
        raise APIError(400, f"the body must be a JSON object, got {type(body).__name__}", code="invalid_value")
    try:
        if "graphs" in body:
            return RecaptureRequest.model_validate(body).graphs
        current = state.lifecycle.config.graphs.model_dump()  # fields not given keep their values
        return GraphConfig.model_validate({**current, **body})
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or "body"
        raise APIError(400, f"{field}: {err['msg']}", param=field, code="invalid_value") from None


ROUTES: tuple[tuple[str, Callable, str], ...] = (
    ("/healthz", healthz, "GET"),
    ("/health", healthz, "GET"),
    ("/version", version, "GET"),
    ("/readyz", readyz, "GET"),
    ("/metrics", metrics, "GET"),
    ("/v1/graphs", graphs, "GET"),
    ("/v1/graphs/recapture", recapture, "POST"),
)
"""(path, endpoint, method) of each lifecycle endpoint; these paths answer while the worker starts."""
