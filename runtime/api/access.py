"""What every HTTP request passes through first: its request id, the API key, the access log.

- Request id: the ``X-Request-Id`` header when the client sends one (1 to
  :data:`MAX_REQUEST_ID_CHARS` visible ASCII characters; anything else is a 400 naming the
  header), else 32 random hex digits. It is echoed in the response's ``X-Request-Id``, names the
  request in the access log, and rides along in the engine's log line of an abort
  (:func:`current_request_id`).
- API key (optional: ``--api-key`` or ``GRAPHSERVING_API_KEY``, runtime/worker.py): every path but
  :func:`is_open` needs ``Authorization: Bearer <key>``; a missing or wrong key is a 401 in the
  OpenAI error shape (``code`` ``invalid_api_key``). Probes, metrics, the worker report, the
  version and the API's schema stay open, so Kubernetes and Prometheus need no key.
- Served-by headers: every response names the worker that answered it, ``X-GraphServing-Pod``
  (``POD_NAME``) and ``X-GraphServing-Revision`` (``GRAPHSERVING_REVISION``, the Pod's
  ``graphserving.io/revision`` label that the operator passes through the downward API), so that a
  client behind a gateway can tell which revision served it (:func:`served_by_headers`).
- Access log: one line per request on the ``graphserving.access`` logger (INFO): method, path,
  status, duration in milliseconds, request id. A stream is logged when it ends.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Awaitable, Callable
from contextvars import ContextVar

from .protocol import APIError, random_hex

access_log = logging.getLogger("graphserving.access")

REQUEST_ID_HEADER = b"x-request-id"
POD_HEADER = b"x-graphserving-pod"
REVISION_HEADER = b"x-graphserving-revision"
MAX_REQUEST_ID_CHARS = 128
"""Longest ``X-Request-Id`` accepted (a UUID has 36 characters; tracing ids fit too)."""

OPEN_PATHS = frozenset({"/healthz", "/readyz", "/health", "/version", "/metrics", "/openapi.json"})
"""Paths that answer without the API key (GET /v1/graphs too: :func:`is_open`)."""

_request_id: ContextVar[str | None] = ContextVar("graphserving_request_id", default=None)

App = Callable[[dict, Callable, Callable], Awaitable[None]]


def current_request_id() -> str | None:
    """The request id of the HTTP request being answered (in its task and the tasks it starts)."""
    return _request_id.get()


def accepted_request_id(value: bytes | None) -> str:
    """The request id for a request whose ``X-Request-Id`` header is ``value`` (pure but for the
    random id of a request without one).

    Raises:
        APIError: 400 naming ``X-Request-Id`` when it is empty, longer than
            :data:`MAX_REQUEST_ID_CHARS` or not visible ASCII (it goes into logs verbatim).
    """
    if value is None:
        return random_hex()
    if not 0 < len(value) <= MAX_REQUEST_ID_CHARS or any(not 0x21 <= b <= 0x7E for b in value):
        shown = value[:MAX_REQUEST_ID_CHARS].decode("latin-1")
        raise APIError(400, f"X-Request-Id: must be 1 to {MAX_REQUEST_ID_CHARS} visible ASCII characters "
                            f"(no spaces), got {shown!r} ({len(value)} bytes)", param="X-Request-Id", code="invalid_value")
    return value.decode("ascii")


def served_by_headers(pod: str | None, revision: str | None) -> tuple[tuple[bytes, bytes], ...]:
    """The response headers naming the worker (pure): :data:`POD_HEADER` and
    :data:`REVISION_HEADER` for the values given (a worker outside a Pod sends neither). Values that
    are not visible ASCII are left out (they come from the environment, not from a client)."""
    pairs = ((POD_HEADER, pod), (REVISION_HEADER, revision))
    return tuple((name, value.encode()) for name, value in pairs
                 if value and value.isascii() and value.isprintable() and " " not in value)


def is_open(method: str, path: str) -> bool:
    """Whether ``method path`` answers without the API key (pure): :data:`OPEN_PATHS`, and
    ``GET /v1/graphs`` (the worker report). Recapture (``POST /v1/graphs/recapture``) needs it."""
    return path in OPEN_PATHS or (path == "/v1/graphs" and method in ("GET", "HEAD"))


def key_error(authorization: bytes | None, api_key: str) -> APIError | None:
    """The 401 of a request whose ``Authorization`` header is ``authorization`` when the server
    wants ``api_key`` (pure), or None when it holds ``Bearer <api_key>``; compared in constant time."""
    if authorization is None:
        return APIError(401, "no API key given: send it as the header `Authorization: Bearer <key>`",
                        code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
    scheme, _, token = authorization.partition(b" ")
    if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), api_key.encode()):
        return APIError(401, "the API key is not valid (expected the header `Authorization: Bearer <key>`)",
                        code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
    return None


async def serve(app: App, api_key: str | None, scope: dict, receive, send,
                served_by: tuple[tuple[bytes, bytes], ...] = ()) -> None:
    """Answer one HTTP request through ``app`` with the request id, the API key check, the
    ``served_by`` headers (:func:`served_by_headers`) and the access-log line (module docstring).
    ``api_key`` None: no key is needed."""
    start = time.perf_counter()
    method, path = scope["method"], scope["path"]
    request_id_header = authorization = None
    for name, value in scope["headers"]:
        if name == REQUEST_ID_HEADER and request_id_header is None:
            request_id_header = value
        elif name == b"authorization" and authorization is None:
            authorization = value
    status = 0
    try:
        request_id, error = accepted_request_id(request_id_header), None
    except APIError as exc:
        request_id, error = random_hex(), exc
    echoed = ((REQUEST_ID_HEADER, request_id.encode()), *served_by)

    async def send_with_id(message) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
            message = {**message, "headers": [*message.get("headers", ()), *echoed]}
        await send(message)

    if error is None and api_key and not is_open(method, path):
        error = key_error(authorization, api_key)
    token = _request_id.set(request_id)
    try:
        if error is not None:
            await error.response()(scope, receive, send_with_id)
        else:
            await app(scope, receive, send_with_id)
    finally:
        _request_id.reset(token)
        access_log.info("%s %s %d %.1fms request_id=%s", method, path, status, (time.perf_counter() - start) * 1e3,
                        request_id)
