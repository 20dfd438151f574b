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
- Queue time: arrival to the sequence's first admission into the running batch (its time
  WAITING), seconds; one observation per sequence, so a request with ``n`` choices observes ``n``.
  A preempted sequence waits again before it resumes; only its first admission is observed.
- ITL (inter-token latency): the interval between consecutive output tokens of a sequence as the
  engine produces them, seconds; one observation per output token after the first. A multi-step
  run that hands a sequence ``n`` tokens at ``t``, its previous ones at ``t_prev``, is ``n``
  intervals of ``(t - t_prev) / n`` (a run that holds its first token: ``n - 1`` intervals of
  ``(t - first admission) / n``). Fed once per engine step for all sequences at once
  (:class:`WeightedHistogram`, exported by :class:`HistogramCollector`): one ``observe`` per token
  would cost about 1 µs each, 512 per step at 64 sequences x 8 steps.

Prefix cache (:mod:`.prefix_cache`): ``graphserving_prefix_cache_query_tokens`` counts the tokens
of admitted sequences looked up, ``graphserving_prefix_cache_hit_tokens`` those found cached (their
prefill skipped; hit rate = hits / queries, as vLLM's ``prefix_cache_queries`` / ``_hits``), both
counters; the gauge ``graphserving_prefix_cache_blocks`` the blocks cached now, referenced or
evictable. Evictable cached blocks count as free in the KV-cache gauges (they are handed out when
nothing else is free), so ``graphserving_kv_cache_usage_ratio`` is the share held by live sequences.

Speculative decoding (runtime/engine/speculative.py): ``graphserving_spec_decode_proposed_tokens``
counts the drafts sent to verification (padded positions are no proposals),
``graphserving_spec_decode_accepted_tokens`` those the target kept (acceptance rate = accepted /
proposed), and the ``_per_position`` pair the same by draft position (label ``position``, ``0`` ..
``7``: at most :data:`~graphserving.contract.worker_config.MAX_SPECULATIVE_TOKENS` positions, all at
zero from the start), whose ratio is the acceptance rate at each position (of the requests that
drafted position ``j``, the share whose drafts ``0 .. j`` were all accepted).

Router-facing aliases (:data:`ROUTER_ALIASES`, docs/dashboards.md, "Router-facing metrics"): the
Gateway API Inference Extension's endpoint picker reads waiting and running requests and KV-cache
usage (a fraction in [0, 1]) from each model server under vLLM's names, which we export next to
ours with the same values. Their colons are the one thing ``promtool check metrics`` flags
("metric names should not contain ':'": colons are for recording rules).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from graphserving.contract.graph_policy import default_capture_sizes
from graphserving.contract.worker_config import MAX_SPECULATIVE_TOKENS
from .scheduler import Scheduler, SchedulerOutput
from .sequence import FinishReason

# Latency buckets (seconds): fine below 100 ms for GPU decode, up to minutes for CPU prefill.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80, 160)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5, 5)
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 15, 20, 30, 40, 50, 60, 120, 240, 480, 960)
_ITERATION_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)

CONTENT_TYPE = CONTENT_TYPE_LATEST

#: Every ``finish_reason`` label value: the sequence's reasons, and ``error`` (a failed step).
FINISH_REASONS = (*(r.value for r in FinishReason), "error")

#: The router protocol's gauge names (vLLM's, which the Gateway API Inference Extension's endpoint
#: picker reads) -> our metric whose value each one repeats. All carry the label ``model_name``.
ROUTER_ALIASES = {
    "vllm:num_requests_waiting": "graphserving_requests_waiting",
    "vllm:num_requests_running": "graphserving_requests_running",
    "vllm:kv_cache_usage_perc": "graphserving_kv_cache_usage_ratio",
}


#: The queue and KV-cache gauges (name -> help), set together by :meth:`EngineMetrics.observe_queues`.
_QUEUE_GAUGES = {
    "graphserving_requests_running": "Sequences in the running batch.",
    "graphserving_requests_waiting": "Sequences waiting for admission.",
    "graphserving_kv_cache_used_blocks": "KV-cache blocks in use (referenced by sequences; evictable cached "
                                         "blocks count as free).",
    "graphserving_kv_cache_capacity_blocks": "Usable KV-cache blocks (the null block excluded).",
    "graphserving_kv_cache_usage_ratio":
        "KV-cache blocks in use / usable blocks, in [0, 1] (0 while no block is usable).",
}


class WeightedHistogram:
    """Histogram state fed in batches of weighted observations: ``add([v], [w])`` is ``w``
    observations of ``v``, one numpy pass for the whole batch. Thread-safe (the engine loop adds,
    the HTTP thread snapshots).

    Args:
        bounds: finite upper bounds (``le``, inclusive, as Prometheus buckets), ascending; the
            ``+Inf`` bucket is implicit.

    Raises:
        ValueError: ``bounds`` empty, not strictly ascending, or not finite.
    """

    def __init__(self, bounds: Sequence[float]):
        self.bounds = np.asarray(bounds, dtype=np.float64)
        if not len(self.bounds) or not np.all(np.isfinite(self.bounds)) or np.any(np.diff(self.bounds) <= 0):
            raise ValueError(f"bounds must be finite and strictly ascending, got {list(bounds)}")
        self._counts = np.zeros(len(self.bounds) + 1)  # per bucket (not cumulative); the last is +Inf
        self._sum = 0.0
        self._lock = threading.Lock()

    def add(self, values: Sequence[float], weights: Sequence[float]) -> None:
        """Add ``weights[i]`` observations of ``values[i]`` (seconds, >= 0) for every ``i``; a
        value on a bound counts in that bound's bucket."""
        v = np.asarray(values, dtype=np.float64)
        w = np.fromiter(weights, dtype=np.float64, count=len(weights))
        counts = np.bincount(self.bounds.searchsorted(v, side="left"), weights=w, minlength=len(self._counts))
        total = float(v.dot(w))
        with self._lock:
            self._counts += counts
            self._sum += total

    def snapshot(self) -> tuple[list[float], float]:
        """(cumulative count of every bucket, ``+Inf`` last: the total count; sum of the values)."""
        with self._lock:
            counts, total = self._counts.cumsum(), self._sum
        return counts.tolist(), total


class HistogramCollector(Collector):
    """Exposes a :class:`WeightedHistogram` as the Prometheus histogram ``name`` (samples
    ``_bucket`` with ``le`` including ``+Inf``, ``_count``, ``_sum``; no ``_created``), one series
    with ``labels``, present from registration on (at zero)."""

    def __init__(self, name: str, documentation: str, labels: dict[str, str], histogram: WeightedHistogram):
        self.name, self.documentation, self.histogram = name, documentation, histogram
        self._label_names, self._label_values = list(labels), list(labels.values())
        self._les = [*(floatToGoString(b) for b in histogram.bounds), "+Inf"]

    def describe(self) -> list[HistogramMetricFamily]:
        return [HistogramMetricFamily(self.name, self.documentation, labels=self._label_names)]

    def collect(self) -> Iterator[HistogramMetricFamily]:
        counts, total = self.histogram.snapshot()
        family = HistogramMetricFamily(self.name, self.documentation, labels=self._label_names)
        family.add_metric(self._label_values, list(zip(self._les, counts)), total)
        yield family


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
        self._queue_metrics(r, labels, model_name)
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
        self.prefix_queries = Counter(
            "graphserving_prefix_cache_query_tokens",
            "Tokens of admitted sequences looked up in the prefix cache (0 while it is off).", labels, registry=r,
        )
        self.prefix_hits = Counter(
            "graphserving_prefix_cache_hit_tokens",
            "Tokens of admitted sequences found in the prefix cache (their prefill was skipped).", labels, registry=r,
        )
        self.prefix_blocks = Gauge(
            "graphserving_prefix_cache_blocks", "KV-cache blocks in the prefix cache, referenced or evictable.",
            labels, registry=r,
        )
        self._spec_decode_metrics(r, labels)
        self._model = model_name
        self._children: dict[tuple[object, str | None], object] = {}
        for metric in (self.prompt_tokens, self.generation_tokens, self.preemptions, self.ttft, self.tpot, self.e2e,
                       self.iteration, self.batch_size, self.batch_tokens, *self.queue_gauges.values(), self.queue_time,
                       *self.router.values(), self.structured_requests, self.structured_steps, self.prefix_queries,
                       self.prefix_hits, self.prefix_blocks):
            self._l(metric)
        for reason in FINISH_REASONS:
            self._l(self.requests, finish_reason=reason)
        self._positions = [[m.labels(model_name=model_name, position=str(j)) for j in range(MAX_SPECULATIVE_TOKENS)]
                           for m in (self.spec_proposed_at, self.spec_accepted_at)]
        self._l(self.spec_proposed)
        self._l(self.spec_accepted)

    def _spec_decode_metrics(self, r: CollectorRegistry, labels: list[str]) -> None:
        """The speculative-decoding counters (module docstring)."""
        self.spec_proposed = Counter("graphserving_spec_decode_proposed_tokens",
                                     "Draft tokens proposed for verification (speculative decoding).", labels, registry=r)
        self.spec_accepted = Counter("graphserving_spec_decode_accepted_tokens",
                                     "Draft tokens the target model accepted (speculative decoding).", labels, registry=r)
        self.spec_proposed_at = Counter(
            "graphserving_spec_decode_proposed_tokens_per_position",
            "Draft tokens proposed at each draft position (0 first).", [*labels, "position"], registry=r)
        self.spec_accepted_at = Counter(
            "graphserving_spec_decode_accepted_tokens_per_position",
            "Draft tokens accepted at each draft position (0 first; a draft after a rejected one is never "
            "accepted).", [*labels, "position"], registry=r)

    def _queue_metrics(self, r: CollectorRegistry, labels: list[str], model_name: str) -> None:
        """The queue and KV-cache gauges, queue time and ITL, and the router-facing aliases."""
        self.queue_gauges = {name: Gauge(name, text, labels, registry=r) for name, text in _QUEUE_GAUGES.items()}
        self.queue_time = Histogram(
            "graphserving_request_queue_time_seconds",
            "Arrival to first admission into the running batch, per sequence (a request with n choices observes n; "
            "waits after a preemption are not observed).", labels, buckets=_TTFT_BUCKETS, registry=r,
        )
        self.itl = WeightedHistogram(_TPOT_BUCKETS)
        r.register(HistogramCollector(
            "graphserving_inter_token_latency_seconds",
            "Inter-token latency: interval between consecutive output tokens of a sequence, one per output token "
            "after the first (a multi-step run of n tokens: n intervals of its time / n).",
            {"model_name": model_name}, self.itl,
        ))
        self.router = {
            alias: Gauge(alias, f"{ours} under the name the Gateway API Inference Extension's endpoint picker reads "
                                f"(vLLM's).", labels, registry=r)
            for alias, ours in ROUTER_ALIASES.items()
        }

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
        self, *, seconds: float, sched: SchedulerOutput | None, scheduler: Scheduler, new_tokens: int,
        num_steps: int = 1,
    ) -> None:
        """Record one engine step: ``num_steps`` forward passes of ``sched``'s batch (None: no
        batch; multi-step decoding runs several), each observed as one iteration of
        ``seconds / num_steps``; ``new_tokens`` generated tokens kept; the queue gauges from
        ``scheduler`` and its block manager; ``sched``'s prefix-cache queries and hits (tokens)."""
        num_reqs = len(sched.scheduled) if sched is not None else 0
        num_tokens = sched.num_batched_tokens if num_reqs else 0
        for _ in range(num_steps):
            self._l(self.iteration).observe(seconds / num_steps)
            if num_reqs:
                self._l(self.batch_size).observe(num_reqs)
                self._l(self.batch_tokens).observe(num_tokens)
        bm = scheduler.block_manager
        self.observe_queues(running=scheduler.num_running, waiting=scheduler.num_waiting,
                            kv_used=bm.num_used_blocks, kv_total=bm.num_total_blocks)
        self._l(self.prefix_blocks).set(bm.num_cached_blocks)
        if new_tokens:
            self._l(self.generation_tokens).inc(new_tokens)
        if sched is not None and sched.preempted:
            self._l(self.preemptions).inc(len(sched.preempted))
        if sched is not None and sched.prefix_cache_query_tokens:
            self._l(self.prefix_queries).inc(sched.prefix_cache_query_tokens)
            self._l(self.prefix_hits).inc(sched.prefix_cache_hit_tokens)

    def observe_spec_decode(self, num_drafts: Sequence[int], num_accepted: Sequence[int]) -> None:
        """Count one verification step: each request's proposed and accepted drafts (host ints)."""
        self._l(self.spec_proposed).inc(sum(num_drafts))
        self._l(self.spec_accepted).inc(sum(num_accepted))
        proposed_at, accepted_at = self._positions
        for counts, children in ((num_drafts, proposed_at), (num_accepted, accepted_at)):
            for j, child in enumerate(children):
                if n := sum(1 for c in counts if c > j):
                    child.inc(n)

    def observe_queues(self, *, running: int, waiting: int, kv_used: int, kv_total: int) -> None:
        """Set the queue gauges: sequences running and waiting, KV blocks in use (``kv_used``) and
        usable (``kv_total``, exported as ``graphserving_kv_cache_capacity_blocks``), their ratio
        (``graphserving_kv_cache_usage_ratio``, 0 when ``kv_total`` is 0), and the router aliases."""
        values = {"graphserving_requests_running": running, "graphserving_requests_waiting": waiting,
                  "graphserving_kv_cache_used_blocks": kv_used, "graphserving_kv_cache_capacity_blocks": kv_total,
                  "graphserving_kv_cache_usage_ratio": kv_used / kv_total if kv_total > 0 else 0.0}
        for name, value in values.items():
            self._l(self.queue_gauges[name]).set(value)
        for alias, name in ROUTER_ALIASES.items():
            self._l(self.router[alias]).set(values[name])

    def observe_queue_times(self, seconds: Sequence[float]) -> None:
        """Record the queue times (seconds) of sequences admitted for the first time."""
        for value in seconds:
            self._l(self.queue_time).observe(max(0.0, value))

    def observe_token_intervals(self, intervals: Sequence[float], counts: Sequence[int]) -> None:
        """Record ``counts[i]`` inter-token latencies of ``intervals[i]`` seconds each, for every
        ``i`` (one call per engine step, every sequence that got tokens in it)."""
        if intervals:
            self.itl.add(intervals, counts)

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
