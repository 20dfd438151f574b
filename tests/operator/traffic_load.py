"""A steady client load through the gateway, the HTTPRoute weights in force, and the split between them.

:class:`Load` runs client threads that send completions through the gateway (alternately streaming
and not) and records every outcome: when it was sent, which revision answered (the worker's
``X-GraphServing-Revision`` header), and how it failed if it did (a status other than 200, a
connection error, or a stream without its final chunk and ``[DONE]``). :class:`RouteWeights`
samples the GraphServing's HTTPRoute and records each change of its weights. :func:`windows` cuts
the timeline at those changes and compares each window's measured share per revision with the
weights in force (pure).
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time

import httpx

from graphserving.dev.demo import route_weights
from graphserving.operator import routing

#: Seconds after a weight change before a window counts: the gateway applies a changed route
#: within its watch latency (docs/gateway.md measured 0.2-1.7 s).
SETTLE_SECONDS = 2.0


@dataclasses.dataclass(frozen=True)
class Outcome:
    """One request: sent at ``start`` (``time.monotonic()`` s), answered by ``revision`` (None
    when no worker answered), ``error`` None when it succeeded completely."""

    start: float
    end: float
    stream: bool
    revision: str | None
    pod: str | None
    error: str | None


def stream_error(lines: list[str]) -> str | None:
    """None when an SSE body ends with a chunk carrying ``finish_reason`` and then ``[DONE]``."""
    data = [line[6:] for line in lines if line.startswith("data: ")]
    if not data or data[-1] != "[DONE]":
        return f"the stream ended without [DONE] after {len(data)} events"
    finishes = [json.loads(d)["choices"][0].get("finish_reason") for d in data[:-1] if '"choices"' in d]
    if not finishes or finishes[-1] not in ("stop", "length"):
        return f"the stream's last finish_reason is {finishes[-1] if finishes else None!r}"
    return None


#: Seconds a client waits after a failed request (a refused request fails at once: do not spin).
FAILURE_PAUSE = 0.2


class Load:
    """``clients`` threads sending requests to ``url`` (the gateway) back to back until :meth:`stop`.

    Each request is ``/v1/completions`` for ``model`` with ``max_tokens`` tokens and ``Host: host``
    (the HTTPRoute's hostname: the gateway is shared by every test of the session); every second
    one streams. ``pause`` seconds between one thread's requests set the rate."""

    def __init__(self, url: str, model: str, host: str, clients: int = 4, max_tokens: int = 4, pause: float = 0.0,
                 timeout: float = 120.0) -> None:
        self.url, self.model, self.host, self.clients = url, model, host, clients
        self.max_tokens, self.pause, self.timeout = max_tokens, pause, timeout
        self.outcomes: list[Outcome] = []
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def __enter__(self) -> Load:
        for i in range(self.clients):
            thread = threading.Thread(target=self._run, args=(i,), daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=self.timeout + 10)

    def _run(self, index: int) -> None:
        stream = bool(index % 2)
        with self.client() as client:
            while not self._stop.is_set():
                self.outcomes.append(outcome := self.send(client, stream))
                stream = not stream
                if self.pause or outcome.error is not None:
                    self._stop.wait(self.pause if outcome.error is None else FAILURE_PAUSE)

    def client(self) -> httpx.Client:
        """An HTTP client whose requests carry this load's ``Host``."""
        return httpx.Client(timeout=self.timeout, headers={"Host": self.host})

    def send(self, client: httpx.Client, stream: bool) -> Outcome:
        body = {"model": self.model, "prompt": "The capital of France is", "max_tokens": self.max_tokens,
                "temperature": 0, "stream": stream}
        start = time.monotonic()
        revision = pod = error = None
        try:
            with client.stream("POST", f"{self.url}/v1/completions", json=body) as response:
                revision = response.headers.get("x-graphserving-revision")
                pod = response.headers.get("x-graphserving-pod")
                text = response.read().decode(errors="replace")
                if response.status_code != 200:
                    error = f"HTTP {response.status_code}: {text[:200]}"
                elif stream:
                    error = stream_error(text.splitlines())
                elif json.loads(text)["choices"][0]["finish_reason"] not in ("stop", "length"):
                    error = f"finish_reason {json.loads(text)['choices'][0]['finish_reason']!r}"
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            error = f"{type(exc).__name__}: {exc}"
        return Outcome(start, time.monotonic(), stream, revision, pod, error)

    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.error is not None]


class RouteWeights:
    """Samples the HTTPRoute ``name`` in ``namespace`` every ``interval`` s; :attr:`changes` holds
    ``(time.monotonic(), {revision: weight})`` for each change of its weights (the first sample too)."""

    def __init__(self, custom, namespace: str, name: str, interval: float = 0.25) -> None:
        self.custom, self.namespace, self.name, self.interval = custom, namespace, name, interval
        self.changes: list[tuple[float, dict[str, int]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> RouteWeights:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                route = self.custom.get_namespaced_custom_object(routing.GROUP, routing.VERSION, self.namespace,
                                                                 routing.PLURAL, self.name)
                weights = route_weights(route, self.name)
                if not self.changes or self.changes[-1][1] != weights:
                    self.changes.append((time.monotonic(), weights))
            except Exception:  # noqa: BLE001  not created yet, or a transient API error: sample again
                pass
            self._stop.wait(self.interval)


@dataclasses.dataclass(frozen=True)
class Window:
    """Requests sent while one set of weights was in force (after :data:`SETTLE_SECONDS`)."""

    start: float
    end: float
    weights: dict[str, int]
    served: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.served.values())

    def share(self, revision: str) -> float:
        return self.served.get(revision, 0) / self.total if self.total else 0.0

    def deviation(self) -> float:
        """Largest |measured share - weight / 100| over the revisions, in fractions."""
        total_weight = sum(self.weights.values()) or 1
        names = set(self.weights) | set(self.served)
        return max(abs(self.share(r) - self.weights.get(r, 0) / total_weight) for r in names)


def windows(changes: list[tuple[float, dict[str, int]]], outcomes: list[Outcome], end: float,
            settle: float = SETTLE_SECONDS) -> list[Window]:
    """The windows between weight ``changes`` (sampled as :class:`RouteWeights` does, ending at
    ``end``), each with the successful requests sent in it after ``settle`` s, per revision (pure)."""
    result = []
    for i, (changed, weights) in enumerate(changes):
        stop = changes[i + 1][0] if i + 1 < len(changes) else end
        start = changed + settle
        served: dict[str, int] = {}
        for o in outcomes:
            if start <= o.start < stop and o.error is None and o.revision is not None:
                served[o.revision] = served.get(o.revision, 0) + 1
        result.append(Window(start, stop, weights, served))
    return result


def table(found: list[Window], origin: float) -> str:
    """The windows as a text table (times from ``origin``), for the test's log and docs."""
    lines = ["window (s)      requests  weights -> measured share"]
    for w in found:
        parts = ", ".join(f"{r[:8]} {w.weights.get(r, 0)}% -> {100 * w.share(r):.0f}%"
                          for r in sorted(set(w.weights) | set(w.served)))
        lines.append(f"{w.start - origin:6.1f}-{w.end - origin:6.1f}  {w.total:8d}  {parts}")
    return "\n".join(lines)
