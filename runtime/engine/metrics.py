"""Prometheus metrics of the serving engine, in a registry of their own.

Names follow the Prometheus naming conventions (``graphserving_`` prefix; base units, the unit as
the suffix: ``_seconds``, ``_blocks``; counters registered without ``_total``, which
prometheus_client appends, and no other type ending in it), as ``promtool check metrics`` checks
(tests/runtime/test_metric_names.py). Counters and histograms expose no ``_created`` series, and
every series whose label values are known in advance (each finish reason) exists at zero from
registration on, so dashboards and alerts read 0 instead of no data.

Latency definitions (as vLLM and the OpenAI benchmark tooling use them):

- TTFT: arrival of the request to its first generated token, seconds.
- TPOT: (finish - first token) / (output tokens - 1) per request, seconds; observed only for
  requests with at least two output tokens.
- e2e latency: arrival to finish, seconds.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from graphserving.contract.graph_policy import default_capture_sizes
from .sequence import FinishReason

# Latency buckets (seconds): fine below 100 ms for GPU decode, up to minutes for CPU prefill.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80, 160)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5, 5)
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 15, 20, 30, 40, 50, 60, 120, 240, 480, 960)
_ITERATION_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)

CONTENT_TYPE = CONTENT_TYPE_LATEST

#: Every ``finish_reason`` label value: the sequence's reasons, and ``error`` (a failed step).
FINISH_REASONS = (*(r.value for r in FinishReason), "error")


def batch_size_buckets(max_num_seqs: int) -> list[float]:
    """Batch-size histogram bounds: every size up to 64 (exact enough for the capture-size planner),
    then the default capture-size grid up to ``max_num_seqs``."""
    exact = list(range(1, min(max_num_seqs, 64) + 1))
    return [float(b) for b in sorted(set(exact) | set(default_capture_sizes(max_num_seqs)))]


def batch_token_buckets(max_num_batched_tokens: int) -> list[float]:
    """Token-count histogram bounds: powers of two up to ``max_num_batched_tokens``, and it."""
    bounds, b = [], 1
    while b < max_num_batched_tokens:
        bounds.append(float(b))
        b *= 2
    return [*bounds, float(max_num_batched_tokens)]


class EngineMetrics:
    """The engine's metrics. ``registry`` is private to this object (tests can make many).

    Building one turns off prometheus_client's ``_created`` series for the whole process (a global
    switch of the library; the worker builds this at start-up, before anything is scraped).

    Args:
        max_num_seqs / max_num_batched_tokens: the scheduler limits (histogram bounds).
        model_name: value of the ``model_name`` label on every metric.
    """

    def __init__(self, model_name: str, max_num_seqs: int = 64, max_num_batched_tokens: int = 2048):
        disable_created_metrics()
        self.registry = CollectorRegistry(auto_describe=True)
        r, labels = self.registry, ["model_name"]
        self.requests = Counter(
            "graphserving_requests",
            "Finished requests by finish reason (stop, length, abort, error); a request with n choices counts n.",
            [*labels, "finish_reason"], registry=r,
        )
        self.prompt_tokens = Counter("graphserving_prompt_tokens", "Prompt tokens of admitted requests.", labels, registry=r)
        self.generation_tokens = Counter("graphserving_generation_tokens", "Generated tokens.", labels, registry=r)
        self.preemptions = Counter(
            "graphserving_preemptions", "Sequences preempted (KV blocks freed, recomputed later).", labels, registry=r
        )
        self.ttft = Histogram(
            "graphserving_time_to_first_token_seconds", "Time to first token (arrival to first generated token).",
            labels, buckets=_TTFT_BUCKETS, registry=r,
        )
        self.tpot = Histogram(
            "graphserving_time_per_output_token_seconds", "Time per output token after the first, per request.",
            labels, buckets=_TPOT_BUCKETS, registry=r,
        )
        self.e2e = Histogram(
            "graphserving_e2e_request_latency_seconds", "Arrival to finish of a request.",
            labels, buckets=_E2E_BUCKETS, registry=r,
        )
        self.iteration = Histogram(
            "graphserving_iteration_seconds", "Wall time of one engine step (schedule, forward, sample).",
            labels, buckets=_ITERATION_BUCKETS, registry=r,
        )
        self.batch_size = Histogram(
            "graphserving_batch_size", "Requests (rows) in each forward pass.",
            labels, buckets=batch_size_buckets(max_num_seqs), registry=r,
        )
        self.batch_tokens = Histogram(
            "graphserving_batch_tokens", "Token rows in each forward pass.",
            labels, buckets=batch_token_buckets(max_num_batched_tokens), registry=r,
        )
        self.running = Gauge("graphserving_requests_running", "Sequences in the running batch.", labels, registry=r)
        self.waiting = Gauge("graphserving_requests_waiting", "Sequences waiting for admission.", labels, registry=r)
        self.kv_used_blocks = Gauge("graphserving_kv_cache_used_blocks", "KV-cache blocks in use.", labels, registry=r)
        self.kv_capacity_blocks = Gauge(
            "graphserving_kv_cache_capacity_blocks", "Usable KV-cache blocks (the null block excluded).", labels, registry=r
        )
        self.structured_requests = Counter(
            "graphserving_structured_output_requests",
            "Admitted requests whose output a grammar constrains (response_format, guided_*, a required tool call).",
            labels, registry=r,
        )
        self.structured_steps = Counter(
            "graphserving_structured_output_steps",
            "Engine steps whose batch held a grammar-constrained sequence (one decode step per launch: its "
            "allowed-token mask needs the previous token on the host).",
            labels, registry=r,
        )
        self._model = model_name
        self._children: dict[tuple[object, str | None], object] = {}
        for metric in (self.prompt_tokens, self.generation_tokens, self.preemptions, self.ttft, self.tpot, self.e2e,
                       self.iteration, self.batch_size, self.batch_tokens, self.running, self.waiting,
                       self.kv_used_blocks, self.kv_capacity_blocks, self.structured_requests, self.structured_steps):
            self._l(metric)
        for reason in FINISH_REASONS:
            self._l(self.requests, finish_reason=reason)

    def _l(self, metric, finish_reason: str | None = None):
        """The child of ``metric`` for this model (and ``finish_reason``), cached: ``labels()``
        validates and joins its arguments under a lock on every call, several times per engine
        step on the thread that holds the GIL against the HTTP server."""
        key = (metric, finish_reason)
        child = self._children.get(key)
        if child is None:
            extra = {} if finish_reason is None else {"finish_reason": finish_reason}
            child = self._children[key] = metric.labels(model_name=self._model, **extra)
        return child

    def observe_step(
        self, *, seconds: float, num_reqs: int, num_tokens: int, running: int, waiting: int,
        kv_used: int, kv_total: int, new_tokens: int, preemptions: int, num_steps: int = 1,
    ) -> None:
        """Record one engine step: ``num_steps`` forward passes of the same batch (multi-step
        decoding), each observed as one iteration of ``seconds / num_steps``."""
        for _ in range(num_steps):
            self._l(self.iteration).observe(seconds / num_steps)
            if num_reqs:
                self._l(self.batch_size).observe(num_reqs)
                self._l(self.batch_tokens).observe(num_tokens)
        self.observe_queues(running=running, waiting=waiting, kv_used=kv_used, kv_total=kv_total)
        if new_tokens:
            self._l(self.generation_tokens).inc(new_tokens)
        if preemptions:
            self._l(self.preemptions).inc(preemptions)

    def observe_queues(self, *, running: int, waiting: int, kv_used: int, kv_total: int) -> None:
        """Set the queue gauges: sequences running and waiting, KV blocks in use (``kv_used``) and
        usable (``kv_total``, exported as ``graphserving_kv_cache_capacity_blocks``)."""
        self._l(self.running).set(running)
        self._l(self.waiting).set(waiting)
        self._l(self.kv_used_blocks).set(kv_used)
        self._l(self.kv_capacity_blocks).set(kv_total)

    def observe_admitted(self, num_prompt_tokens: int, structured: bool = False) -> None:
        self._l(self.prompt_tokens).inc(num_prompt_tokens)
        if structured:
            self._l(self.structured_requests).inc()

    def observe_structured_step(self) -> None:
        """Count an engine step whose batch held a grammar-constrained sequence."""
        self._l(self.structured_steps).inc()

    def observe_finished(
        self, *, finish_reason: str, arrival: float, first_token: float | None, finish: float, num_output_tokens: int
    ) -> None:
        """Record a finished sequence (times from ``time.monotonic()``, seconds)."""
        self._l(self.requests, finish_reason=finish_reason).inc()
        self._l(self.e2e).observe(max(0.0, finish - arrival))
        if first_token is not None and num_output_tokens > 1:
            self._l(self.tpot).observe(max(0.0, finish - first_token) / (num_output_tokens - 1))

    def observe_failed(self) -> None:
        """Count a sequence that ended because an engine step failed (``finish_reason="error"``)."""
        self._l(self.requests, finish_reason="error").inc()

    def observe_first_token(self, seconds: float) -> None:
        """Record a time to first token, seconds (when the first token is generated)."""
        self._l(self.ttft).observe(max(0.0, seconds))

    def render(self) -> bytes:
        """The text exposition format (for ``GET /metrics``)."""
        return generate_latest(self.registry)
