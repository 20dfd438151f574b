"""The worker's HTTP front: lifecycle endpoints always, the OpenAI API once the engine serves.

The server starts before warmup and capture so that Kubernetes probes see a live process:

- ``GET /healthz``: 200 while the process and (once started) the engine loop are alive;
- ``GET /readyz``: 200 only when the readiness policy holds (:class:`WorkerLifecycle`), 503 with
  the phase and reason otherwise;
- ``GET /v1/graphs``: the current :class:`~graphserving.contract.report.WorkerReport`;
- ``POST /v1/graphs/recapture``: body a ``GraphConfig`` (fields not given keep their current
  values) or a ``RecaptureRequest`` (a whole GraphConfig): recapture in place without reloading
  the model; answers with the new report (409 while starting or draining);
- ``GET /metrics``: engine and graph metrics (Prometheus text format);
- everything else goes to the OpenAI-compatible app (runtime/api/app.py) once it exists, and gets
  a 503 OpenAI-style error while the worker is still starting.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from graphserving.contract.graph_policy import CaptureSizeError
from graphserving.contract.report import RecaptureRequest
from graphserving.contract.worker_config import GraphConfig
from ..lifecycle.phases import RecaptureRefused
from .app import BodyLimit


def _error(status: int, message: str, *, param: str | None = None, code: str | None = None,
           kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status)


class _Forward:
    """ASGI: forwards to ``holder.inner_app`` when it exists, else answers 503."""

    def __init__(self, holder: Any):
        self.holder = holder

    async def __call__(self, scope, receive, send) -> None:
        inner = self.holder.inner_app
        if inner is None:
            if scope["type"] != "http":
                return
            phase = self.holder.lifecycle.phase.value if self.holder.lifecycle else "Loading"
            response = _error(503, f"the worker is not serving yet (phase {phase})", kind="service_unavailable",
                              code="not_ready")
            await response(scope, receive, send)
            return
        await inner(scope, receive, send)


class WorkerFront:
    """Holds what the front needs: the lifecycle, the inner app once built, the metrics."""

    def __init__(self, lifecycle, metrics, recapture):
        self.lifecycle = lifecycle
        self.metrics = metrics
        self.recapture = recapture  # async callable GraphConfig -> WorkerReport
        self.inner_app = None
        self.engine_alive = lambda: True


def build_worker_app(front: WorkerFront):
    """The ASGI app of a worker (see the module docstring): the front's routes, and the OpenAI
    app for every other path."""
    app = FastAPI(title="graphserving worker", docs_url=None, redoc_url=None)
    app.add_middleware(BodyLimit)  # the recapture body, as the OpenAI app's

    @app.get("/healthz")
    async def healthz():
        if not front.engine_alive():
            return JSONResponse({"alive": False, "reason": "engine loop stopped"}, status_code=500)
        return {"alive": True, "phase": front.lifecycle.phase.value}

    @app.get("/readyz")
    async def readyz():
        readiness = front.lifecycle.readiness
        # the lifecycle decides before the OpenAI app and the engine loop exist: wait for them too
        serving = front.inner_app is not None
        ready = readiness.ready and serving
        reason = readiness.reason if serving or not readiness.ready else "starting the server"
        body = {"ready": ready, "phase": front.lifecycle.phase.value, "reason": reason}
        return JSONResponse(body, status_code=200 if ready else 503)

    @app.get("/v1/graphs")
    async def graphs():
        return Response(front.lifecycle.report().to_json(), media_type="application/json")

    @app.post("/v1/graphs/recapture")
    async def recapture(request: Request):
        try:
            body = await request.json()
        except (ValueError, RecursionError):
            return _error(400, "the body is not valid JSON", code="invalid_json")
        if not isinstance(body, dict):
            return _error(400, f"the body must be a JSON object, got {type(body).__name__}", code="invalid_value")
        try:
            if "graphs" in body:
                graphs = RecaptureRequest.model_validate(body).graphs
            else:  # a partial GraphConfig: fields not given keep their current values
                current = front.lifecycle.config.graphs.model_dump()
                graphs = GraphConfig.model_validate({**current, **body})
        except ValidationError as exc:
            err = exc.errors()[0]
            field = ".".join(str(p) for p in err["loc"]) or "body"
            return _error(400, f"{field}: {err['msg']}", param=field, code="invalid_value")
        if front.inner_app is None:
            return _error(409, f"cannot recapture during start-up (phase {front.lifecycle.phase.value})",
                          code="not_ready", kind="conflict")
        try:
            report = await front.recapture(graphs)
        except CaptureSizeError as exc:
            param = "piecewise_capture_sizes" if "max_num_batched_tokens" in str(exc) else "capture_sizes"
            return _error(400, str(exc), param=param, code="invalid_value")
        except RecaptureRefused as exc:
            return _error(409, str(exc), code="not_ready", kind="conflict")
        return Response(report.to_json(), media_type="application/json")

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(await asyncio.to_thread(front.metrics.render), media_type=CONTENT_TYPE_LATEST)

    return _Dispatch(app, _Forward(front))


class _Dispatch:
    """ASGI: the front's own routes (and the lifespan) to the front app; every other HTTP request
    straight to :class:`_Forward`, without first passing the front app's middleware and router
    (a second FastAPI stack per completion request, a third of the front's CPU per request).

    ``front_app`` is the FastAPI app of the front's routes.
    """

    def __init__(self, front_app: FastAPI, forward: _Forward):
        self.front_app = front_app
        self.forward = forward
        self.paths = frozenset(route.path for route in front_app.routes if hasattr(route, "methods"))

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan" or scope.get("path") in self.paths:
            await self.front_app(scope, receive, send)
        else:
            await self.forward(scope, receive, send)
