"""Prometheus metrics of graphs and the worker lifecycle, registered beside the engine's.

Label sets are bounded by configuration: ``key`` takes one value per configured graph key (plus
``""`` for eager passes), ``reason`` one per :class:`~graphserving.runtime.graphs.key.FallbackReason`,
``phase`` one per lifecycle phase. Series whose label values are known in advance exist at zero
from registration on (eager passes by every fallback reason, every phase, both graph kinds), and a
key's pass and online-canary series from its capture on, so dashboards see zeros (a captured key
with no hits) instead of no data. Names follow the conventions stated in
:mod:`graphserving.runtime.engine.metrics` (``_ratio`` for a fraction in [0, 1]).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from graphserving.contract.report import Phase, WorkerReport
from .key import Dispatch, FallbackReason, GraphRuntimeMode

_PADDING_BUCKETS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.75, 0.9, 1.0)


class GraphMetrics:
    """Graph passes, padding, capture, canary, memory, coverage, phase and capacity.

    Args:
        registry: where to register (the engine's, so ``/metrics`` serves both).
        model_name: value of the ``model_name`` label.
    """

    def __init__(self, registry: CollectorRegistry, model_name: str):
        r, m = registry, ["model_name"]
        self.passes = Counter(
            "graphserving_graph_passes", "Forward passes by runtime mode (full, piecewise, eager), graph key "
            "(bucket hits) and fallback reason ('' for replays).", [*m, "mode", "key", "reason"], registry=r,
        )
        self.real_rows = Counter("graphserving_graph_real_rows", "Real token rows run through graphs.", m, registry=r)
        self.padded_rows = Counter("graphserving_graph_padded_rows", "Padded token rows run through graphs.", m, registry=r)
        self.padding_ratio = Histogram(
            "graphserving_graph_padding_ratio", "Padded rows / key rows of each graph replay.", m,
            buckets=_PADDING_BUCKETS, registry=r,
        )
        self.capture_seconds = Gauge("graphserving_graph_capture_seconds", "Capture time of each graph key.",
                                     [*m, "key"], registry=r)
        self.capture_failures = Counter("graphserving_graph_capture_failures", "Graph keys whose capture failed.",
                                        m, registry=r)
        self.canary_failures = Counter("graphserving_graph_canary_failures", "Graph keys whose canary failed.",
                                       m, registry=r)
        self.online_comparisons = Counter(
            "graphserving_graph_online_canary_comparisons", "Sampled graph replays compared with eager execution "
            "while serving (the online canary), by graph key.", [*m, "key"], registry=r,
        )
        self.online_divergences = Counter(
            "graphserving_graph_online_canary_divergences", "Online canary comparisons outside the canary "
            "thresholds, by graph key (each takes its key out of dispatch until the next capture).",
            [*m, "key"], registry=r,
        )
        self.phase_seconds = Gauge("graphserving_worker_phase_duration_seconds",
                                   "Duration of the last run of each lifecycle phase.", [*m, "phase"], registry=r)
        self.phase = Gauge("graphserving_worker_phase", "1 for the worker's current lifecycle phase, 0 otherwise.",
                           [*m, "phase"], registry=r)
        self.graph_memory = Gauge("graphserving_graph_memory_bytes",
                                  "Graph memory: the estimate the KV cache was sized with, and the measured actual.",
                                  [*m, "kind"], registry=r)
        self.coverage = Gauge("graphserving_graph_coverage_ratio",
                              "Configured graph keys captured and passing canary / configured keys, in [0, 1].",
                              m, registry=r)
        self.captured_keys = Gauge("graphserving_graph_captured_keys", "Captured graph keys by kind.",
                                   [*m, "kind"], registry=r)
        self.capacity = Gauge("graphserving_effective_capacity_tokens_per_second",
                              "Measured decode throughput at max_num_seqs, tokens/s (degraded workers: eager).",
                              m, registry=r)
        self.degraded = Gauge("graphserving_worker_degraded", "1 while the worker serves degraded.", m, registry=r)
        self._model = model_name
        self._pass_series: dict[Dispatch, tuple] = {}
        self._initialise_known_series()

    def _initialise_known_series(self) -> None:
        """Create, at zero, every series whose labels are known before the first event (a phase's
        duration is not: it has none until the phase ran)."""
        for metric in (self.real_rows, self.padded_rows, self.padding_ratio, self.capture_failures,
                       self.canary_failures, self.coverage, self.capacity, self.degraded):
            self._l(metric)
        for reason in FallbackReason:
            self._l(self.passes, mode=GraphRuntimeMode.EAGER.value, key="", reason=reason.value)
        for p in Phase:
            self._l(self.phase, phase=p.value)
        for kind in ("full", "piecewise"):
            self._l(self.captured_keys, kind=kind)
        for kind in ("estimate", "actual"):
            self._l(self.graph_memory, kind=kind)

    def _l(self, metric, **labels):
        return metric.labels(model_name=self._model, **labels)

    def observe_pass(self, decision: Dispatch, real_rows: int) -> None:
        """One forward pass, after dispatch. The labelled series of a decision are looked up once
        (a lookup costs microseconds of host time on every step)."""
        series = self._pass_series.get(decision)
        if series is None:
            series = self._pass_series[decision] = self._series_of(decision)
        series[0].inc()
        key = decision.key
        if key is None:
            return
        padded = key.num_tokens - real_rows
        series[1].inc(real_rows)
        series[2].inc(padded)
        series[3].observe(padded / key.num_tokens)

    def _series_of(self, decision: Dispatch) -> tuple:
        """(passes, real rows, padded rows, padding ratio) series a pass of ``decision`` counts in."""
        key = decision.key
        if key is None:
            reason = decision.reason.value if decision.reason else ""
            return (self._l(self.passes, mode="eager", key="", reason=reason),)
        return (self._l(self.passes, mode=key.mode.value, key=key.label(), reason=""), self._l(self.real_rows),
                self._l(self.padded_rows), self._l(self.padding_ratio))

    def set_phase(self, phase: str) -> None:
        for p in Phase:
            self._l(self.phase, phase=p.value).set(1.0 if p.value == phase else 0.0)

    def observe_phase(self, phase: str, seconds: float) -> None:
        self._l(self.phase_seconds, phase=phase).set(seconds)

    def observe_capture(self, key_label: str, ok: bool, seconds: float) -> None:
        """One key's capture (``key_label``: :meth:`GraphKey.label`, which starts with its mode);
        a captured key's replay and online-canary counters start at zero."""
        if ok:
            self._l(self.capture_seconds, key=key_label).set(seconds)
            self._l(self.passes, mode=key_label.split("-", 1)[0], key=key_label, reason="")
            self._l(self.online_comparisons, key=key_label)
            self._l(self.online_divergences, key=key_label)
        else:
            self._l(self.capture_failures).inc()

    def start_capture(self) -> None:
        """A capture (or recapture) begins: forget the capture times of the graphs it replaces."""
        self.capture_seconds.clear()

    def observe_canary(self, key_label: str, passed: bool) -> None:
        if not passed:
            self._l(self.canary_failures).inc()

    def observe_online_canary(self, key_label: str, passed: bool) -> None:
        """One online canary comparison of ``key_label``'s replay with eager execution."""
        self._l(self.online_comparisons, key=key_label).inc()
        if not passed:
            self._l(self.online_divergences, key=key_label).inc()

    def set_graph_state(self, report: WorkerReport) -> None:
        """Gauges that follow the report: memory, coverage, captured keys, capacity, degraded."""
        self._l(self.graph_memory, kind="estimate").set(report.graph_memory.estimate_bytes)
        self._l(self.graph_memory, kind="actual").set(report.graph_memory.actual_bytes)
        self._l(self.coverage).set(report.coverage)
        captured = {mode.kind.lower(): len(mode.captured) for mode in report.modes}
        for kind in ("full", "piecewise"):  # a kind recaptured away reads 0, not its old count
            self._l(self.captured_keys, kind=kind).set(captured.get(kind, 0))
        self._l(self.capacity).set(report.effective_capacity_tokens_per_second)
        self._l(self.degraded).set(1.0 if report.phase is Phase.DEGRADED else 0.0)
