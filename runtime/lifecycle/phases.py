"""The worker lifecycle: load -> warmup -> profile -> capture -> canary -> outcome -> report -> serve.

docs/architecture.md, section "Lifecycle". Each phase is timed and recorded in the report (and in
metrics), so probes and rollout deadlines can be set from measured values:

``Loading``    the model at its exact revision (done in the foreground by the worker: a bad path,
               revision or architecture exits with one clear line);
``Warmup``     eager passes on representative shapes (lazy initialisation, cuBLAS handles,
               allocator growth happen here, outside any capture);
``Profiling``  graph-memory estimate, then the KV cache is sized from the free memory minus the
               estimate and its margin (runtime/lifecycle/profiling.py); the KV cache is
               allocated, the graph runner built over it (with no graphs yet) and the engine
               over both;
``Capturing``  the runner configured for the graph configuration (its keys and static buffers),
               then every key captured, largest first, one shared pool; progress keys done / total;
``Canary``     every captured key replayed against eager on fresh inputs (runtime/graphs/canary.py),
               over KV blocks reserved for it in Profiling (never a request's), then the decode
               capacity measured; a key whose canary finds no KV block at all (a cache too small
               to reserve any, held by requests) is a capacity shortfall, retried later between
               engine steps (:data:`CANARY_RETRY_DELAYS_S`), never a divergence;
then ``Ready``, ``Degraded`` or ``Failed`` (runtime/lifecycle/outcome.py, :func:`decide_outcome`),
and the report (runtime/lifecycle/report.py). ``Recapturing`` and ``Draining`` come later on
request.

This module orchestrates; the measurements, decisions and the report live in the sibling modules.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager

import torch

from graphserving.contract.graph_policy import GraphMode
from graphserving.contract.report import KeyReport, Phase, PhaseRecord, Progress, WorkerIdentity, WorkerReport
from graphserving.contract.worker_config import GraphConfig, WorkerConfig, speculative_mode_error
from ..engine.core import LLMEngine
from ..graphs.canary import CanaryCapacityError, CanaryResult, canary_blocks_needed, canary_reserve, run_canary
from ..graphs.key import (FallbackReason, GraphKey, GraphRuntimeMode, configured_keys,
                          decode_query_lens, full_key, piecewise_key)
from ..graphs.parallel import CommandChannel, LeaderRunner
from ..graphs.runner import GraphRunner, KeyCapture, StepStats
from .outcome import Outcome, Readiness, coverage, decide_outcome, failed, passing_keys, resolve_graphs, unproven_reason
from ..graphs.online_canary import OnlineCanary
from .profiling import borrowed_blocks, estimate_graph_memory, measure_capacity, size_kv_cache
from .report import ReportState, build_report, canary_report, key_report, kv_cache_capacity, with_online_canary
from .follower import block_table_width, build_graph_runner, graph_contract, max_model_len
from .warmup import warm_up

log = logging.getLogger(__name__)

#: Delays (seconds) before each retry of the canaries that found no KV blocks to run on; the retry
#: runs between engine steps, after requests have had time to finish and free blocks (about a
#: minute in all, then the keys stay eager with reason ``canary_not_run`` until a recapture).
CANARY_RETRY_DELAYS_S = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0)
#: A key report's ``eager_reason`` while its canary waits for KV blocks, and once no retry is left.
CANARY_PENDING = "canary_pending: no free KV blocks"
CANARY_NOT_RUN = "canary_not_run: no free KV blocks"


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


class RecaptureRefused(RuntimeError):
    """A recapture was asked for in a phase that cannot take one."""


class WorkerLifecycle:
    """Drives one worker process through its phases and keeps its report.

    Args:
        config: the worker configuration.
        loaded: the model, loaded in the foreground (``model_loader.load_model``).
        loading_seconds: how long loading took (recorded as the Loading phase).
        pod_name / namespace: identity in Kubernetes (None outside).
        metrics / graph_metrics: the engine's and the graphs' Prometheus metrics, or None.
        capture_fault: test hook passed to the graph runner (raise to fail a key's capture).
        canary_fault: test hook called before each key's canary (raise to fail it).
        emulate_graphs: without CUDA, capture and canary on the emulated backend and treat its
            graphs as available (tests of the lifecycle on CPU; never for serving).
        canary_retry_delays_s: seconds before each retry of canaries that found no KV blocks
            (default :data:`CANARY_RETRY_DELAYS_S`); the retries run through :meth:`attach_loop`.

    Raises:
        CaptureSizeError: capture sizes that contradict the engine limits.
    """

    def __init__(
        self,
        config: WorkerConfig,
        loaded,
        *,
        loading_seconds: float = 0.0,
        pod_name: str | None = None,
        namespace: str | None = None,
        metrics=None,
        graph_metrics=None,
        capture_fault: Callable[[GraphKey], None] | None = None,
        canary_fault: Callable[[GraphKey], None] | None = None,
        emulate_graphs: bool = False,
        canary_retry_delays_s: Sequence[float] = CANARY_RETRY_DELAYS_S,
        channel: CommandChannel | None = None,
    ):
        self.config = config
        self.loaded = loaded
        self.device = loaded.device
        self.dtype = loaded.dtype
        self.metrics = metrics
        self.graph_metrics = graph_metrics
        self.capture_fault = capture_fault
        self.canary_fault = canary_fault
        self.identity = WorkerIdentity(pod_name=pod_name, namespace=namespace, instance=uuid.uuid4().hex,
                                       started_at=_now())
        self.readiness = Readiness(ready=False, reason="starting")
        self.graphs = resolve_graphs(config.graphs, config.engine.max_num_seqs, config.engine.max_num_batched_tokens)
        self.graphs_available = self.device.type == "cuda" or emulate_graphs
        self.contract = graph_contract(loaded)
        self.channel = channel  # to the tensor-parallel followers (runtime/lifecycle/follower.py); None: one rank
        self.error: Exception | None = None  # what made run() fail, if it did
        self.phase = Phase.LOADING
        self._phases: list[PhaseRecord] = []
        started = _now() - dt.timedelta(seconds=loading_seconds)
        self._phases.append(PhaseRecord(phase=Phase.LOADING, started_at=started, duration_seconds=loading_seconds))
        self.progress: Progress | None = None
        self.generation = 0
        self.outcome: Outcome | None = None
        self.engine: LLMEngine | None = None
        self.runner: GraphRunner | LeaderRunner | None = None
        self.graph_memory_estimate = 0
        self.key_reports: dict[GraphKey, KeyReport] = {}
        self.capacity_tokens_per_second = 0.0
        self.listeners: list[Callable[[WorkerReport], None]] = []
        self._lock = threading.RLock()
        # canary retries after a capacity shortfall: the last canary's problems and the keys it
        # found no KV blocks for, the retries made for this configuration (its serial)
        self._canary_retry_delays = tuple(canary_retry_delays_s)
        self._canary_problems: list[str] = []
        self._canary_starved: list[GraphKey] = []
        self._canary_attempts = 0
        self._config_serial = 0
        self._call_in_loop: Callable[[Callable[[], object]], Future] | None = None
        self._retry_timer: threading.Timer | None = None
        self._retry_token: tuple[int, int] | None = None  # (configuration serial, attempts) it retries
        self._online: OnlineCanary | None = None

    # -- phases ---------------------------------------------------------------------------

    @contextmanager
    def _phase(self, phase: Phase) -> Iterator[None]:
        """Run a phase: recorded, published and timed (also when it raises).

        Once draining has begun, the work still runs but the phase stays Draining: a later
        phase must not replace it (the outcome would then bring the worker back into traffic).
        """
        start = time.perf_counter()
        with self._lock:
            if self.phase is Phase.DRAINING:
                record_index = None
            else:
                self.phase = phase
                self.progress = None
                record_index = len(self._phases)
                self._phases.append(PhaseRecord(phase=phase, started_at=_now()))
        if record_index is None:
            log.info("phase %s runs while draining", phase.value)
            yield
            return
        log.info("phase %s", phase.value)
        if self.graph_metrics is not None:
            self.graph_metrics.set_phase(phase.value)
        self._publish()
        try:
            yield
        finally:
            seconds = time.perf_counter() - start
            with self._lock:
                self._phases[record_index] = self._phases[record_index].model_copy(
                    update={"duration_seconds": seconds})
            if self.graph_metrics is not None:
                self.graph_metrics.observe_phase(phase.value, seconds)
            log.info("phase %s took %.2f s", phase.value, seconds)

    def run(self) -> None:
        """Warmup, profiling, engine, capture and canary; never raises (failures become Failed)."""
        try:
            with self._phase(Phase.WARMUP):
                self._warmup()
            with self._phase(Phase.PROFILING):
                self._profile_and_build_engine()
            self._capture_and_canary()
        except Exception as exc:  # the worker stays up and says why
            self.error = exc
            log.exception("worker lifecycle failed")
            self._finish(failed("failed", f"{type(exc).__name__}: {exc}"))

    # -- warmup ---------------------------------------------------------------------------

    def _warmup(self) -> None:
        warm_up(self.loaded, self.config, self.graphs, self.contract, self._max_model_len())

    def _max_model_len(self) -> int:
        return max_model_len(self.config, self.loaded)

    # -- profiling and the engine ---------------------------------------------------------

    def _profile_and_build_engine(self) -> None:
        """Estimate the graph memory, size and allocate the KV cache, build the graph runner over
        it (configured for no graphs: the capture phase configures it, so a failure there leaves
        a serving engine) and the engine over both."""
        limits, cfg = self.config.engine, self.loaded.config
        self.graph_memory_estimate = estimate_graph_memory(
            self.loaded.model, cfg, self.graphs, self.contract, block_size=limits.block_size,
            max_model_len=self._max_model_len(), dtype=self.dtype, device=self.device,
        )
        num_blocks = size_kv_cache(limits, cfg, self.dtype, self.device,
                                   graph_memory_estimate=self.graph_memory_estimate,
                                   graph_memory_margin_fraction=self.config.graphs.graph_memory_margin_fraction)
        width = block_table_width(limits, cfg, num_blocks)
        self.runner = build_graph_runner(self.loaded, limits, self.contract, num_blocks, width)
        if self.channel is not None:  # the followers size theirs as this rank did, and mirror its runner
            self.channel.send("build", num_blocks, width)
            self.runner = LeaderRunner(self.runner, self.channel)
        self.engine = LLMEngine(self.loaded.model, cfg, self.loaded.tokenizer, limits, device=self.device,
                                dtype=self.dtype, seed=self.config.seed, metrics=self.metrics,
                                kv_caches=self.runner.kv_caches, graph_runner=self.runner)
        self._reserve_canary_blocks()

    def _reserve_canary_blocks(self) -> None:
        """Set aside the KV blocks the canary of the largest keys needs, before any request
        (:func:`~graphserving.runtime.graphs.canary.canary_reserve`; runtime/graphs/canary.py,
        "KV blocks", says why a reserve and not a wait or a preemption). Only where graphs can
        be captured and the mode captures some: a worker started in mode NONE, or without CUDA,
        keeps every block for requests."""
        if not self.graphs_available or self.graphs.config.mode is GraphMode.NONE:
            return
        limits, bm = self.config.engine, self.engine.block_manager
        largest = [full_key(limits.max_num_seqs, self.contract, limits.num_speculative_tokens + 1),
                   piecewise_key(limits.max_num_batched_tokens, self.contract)]
        count = canary_reserve(largest, block_size=limits.block_size, max_model_len=self.engine.max_model_len,
                               usable_blocks=bm.num_total_blocks)
        bm.reserve(count)
        log.info("KV cache: %d of %d blocks reserved for the graph canary", count, bm.num_total_blocks + count)

    def _disable_without_graphs(self) -> None:
        """Without graphs on this device, every batch runs eagerly, counted under its reason."""
        if not self.graphs_available:
            mode = self.graphs.config.mode
            self.runner.disable(FallbackReason.MODE_NONE if mode is GraphMode.NONE else FallbackReason.DEGRADED)

    # -- capture and canary ---------------------------------------------------------------

    def _capture_and_canary(self, phase: Phase = Phase.CAPTURING) -> None:
        """Configure the graph runner for the current graph configuration, capture every
        configured key, canary the captured ones, measure the capacity and finish with the
        outcome; the runner then counts serving passes only.

        Raises:
            RuntimeError: the runner could not be configured (its static buffers not allocated);
                it keeps its previous configuration and the key reports stay as they were.
        """
        graphs = self.graphs
        self.runner.reconfigure(graphs.config.mode, graphs.full_sizes, graphs.piecewise_sizes,
                                capture_fault=self.capture_fault)
        self._disable_without_graphs()
        self.key_reports = {}
        self.runner.metrics = None  # canary and capacity passes are not serving passes
        self.runner.online_canary = None  # nor are they sampled by the online canary
        problems = self._capture(phase)
        with self._phase(Phase.CANARY):
            failures, starved = self._canary()
            self.capacity_tokens_per_second = measure_capacity(
                self.runner, self.engine.block_manager, self.contract, batch=self.config.engine.max_num_seqs,
                vocab_size=self.loaded.config.vocab_size, max_model_len=self.engine.max_model_len,
                device=self.device, previous=self.capacity_tokens_per_second,
            )
        self._canary_problems, self._canary_starved = problems + failures, starved
        self._mark_starved()
        outcome = self._decide()
        if outcome.phase is Phase.FAILED and self.graphs_available:
            self.runner.disable(FallbackReason.NOT_CAPTURED)
        self.runner.stats = StepStats()
        self.runner.metrics = self.graph_metrics  # count serving passes only, not canary/capacity runs
        self._start_online_canary()
        self._finish(outcome)
        self._schedule_canary_retry()

    def _decide(self) -> Outcome:
        """The outcome of the last capture and canary (:func:`decide_outcome`), the keys whose
        canary found no KV blocks counted as unproven, not failed."""
        graphs = self.graphs
        return decide_outcome(
            graphs.config.readiness, graphs.config.mode, graphs_available=self.graphs_available,
            configured=self._configured_keys(), passing=self._passing_keys(),
            captured_modes={k.mode for k in self.runner.captured_keys()}, problems=self._canary_problems,
            unproven=[k.mode for k in self._canary_starved], unproven_reason=self._starved_reason(),
        )

    def _capture(self, phase: Phase) -> list[str]:
        """Capture every configured key (when the runner is enabled) in ``phase``; the problems
        name each key whose capture failed."""
        captures: list[KeyCapture] = []
        if self.runner.enabled:
            if self.graph_metrics is not None:
                self.graph_metrics.start_capture()
            with self._phase(phase):
                with torch.inference_mode():
                    captures = self.runner.capture_all(progress=self._on_capture_progress)
        for c in captures:
            self.key_reports[c.key] = key_report(c)
        return [f"capture of {c.key.label()} failed: {c.error}" for c in captures if not c.ok]

    def _on_capture_progress(self, done: int, total: int, result: KeyCapture) -> None:
        with self._lock:
            self.progress = Progress(done=done, total=total)
        log.info("captured %d/%d %s%s", done, total, result.key.label(), "" if result.ok else f" FAILED: {result.error}")
        if self.graph_metrics is not None:
            self.graph_metrics.observe_capture(result.key.label(), result.ok, result.capture_seconds)
        self._publish()

    @torch.inference_mode()
    def _canary(self) -> tuple[list[str], list[GraphKey]]:
        """Canary every captured key over the reserved KV blocks, topped up with free ones where
        the reserve is short; failing keys are dropped (they fall back to eager).

        Returns:
            The problems (one per failing key) and the keys whose canary found no KV block at all
            (:class:`CanaryCapacityError`): dropped too, but unproven, not failed.
        """
        if not self.runner.graphs:
            return [], []
        limits, bm, model_len = self.config.engine, self.engine.block_manager, self.engine.max_model_len
        thresholds = self.config.graphs.canary
        generator = torch.Generator().manual_seed(self.config.seed)
        problems: list[str] = []
        starved: list[GraphKey] = []
        keys = self.runner.captured_keys()
        reserved = bm.reserved_blocks
        wanted = max(canary_blocks_needed(k, limits.block_size, model_len) for k in keys)
        with borrowed_blocks(bm, max(0, wanted - len(reserved))) as extra:
            blocks = reserved + extra
            for key in keys:
                try:
                    if self.canary_fault is not None:
                        self.canary_fault(key)
                    result = run_canary(self.runner, key, blocks, limits.block_size, model_len, thresholds, generator)
                except CanaryCapacityError as exc:  # a capacity shortfall, retried: never a divergence
                    log.warning("canary of %s not run: %s (%d KV blocks free)", key.label(), exc, bm.num_free_blocks)
                    starved.append(key)
                    self.runner.drop(key, f"canary not run: {exc}")
                    continue
                except Exception as exc:  # a canary that cannot run otherwise is a failed canary
                    result = CanaryResult(key, False, float("inf"), 0.0, 0, 0, 0.0, 0.0, 0.0,
                                          reason=f"{type(exc).__name__}: {exc}")
                self.key_reports[key] = self.key_reports[key].model_copy(update={
                    "canary": canary_report(result),
                    "decode_step_seconds": result.replay_seconds if key.mode is GraphRuntimeMode.FULL else None,
                })
                if self.graph_metrics is not None:
                    self.graph_metrics.observe_canary(key.label(), result.passed)
                if not result.passed:
                    problems.append(f"canary failed for {key.label()}: {result.reason}")
                    self.runner.drop(key, f"canary failed: {result.reason}")
        return problems, starved

    # -- the online canary ----------------------------------------------------------------

    def _start_online_canary(self) -> None:
        """Sample serving replays from now on (runtime/graphs/online_canary.py), with this
        configuration's thresholds; the totals carry over from earlier captures."""
        if not self.runner.graphs:
            return
        thresholds = self.config.graphs.canary
        if self._online is None:
            self._online = OnlineCanary(thresholds, self.dtype, seed=self.config.seed, metrics=self.graph_metrics,
                                        on_divergence=self._on_online_divergence)
        else:
            self._online.reset(thresholds)
        self.runner.online_canary = self._online

    def _on_online_divergence(self, key: GraphKey, result: CanaryResult) -> None:
        """A served replay of ``key`` diverged (on the engine thread; the runner has dropped the
        key): its report says ``canary_divergence``, coverage no longer counts it, and the outcome
        is decided again under the same policy (Degraded or Failed below minCoverage)."""
        with self._lock:
            if key in self.key_reports:
                self.key_reports[key] = self.key_reports[key].model_copy(
                    update={"eager_reason": FallbackReason.CANARY_DIVERGENCE.value})
            self._canary_problems = [*self._canary_problems, f"online canary: {key.label()} diverged: {result.reason}"]
        self._finish(self._decide())

    # -- canary retries after a capacity shortfall -----------------------------------------

    def attach_loop(self, call_in_loop: Callable[[Callable[[], object]], Future]) -> None:
        """The engine loop serves now: retries of canaries that found no KV blocks run through
        ``call_in_loop`` (``AsyncLLMEngine.call_in_loop``: between two steps); one pending since
        the last canary is scheduled now."""
        self._call_in_loop = call_in_loop
        self._schedule_canary_retry()

    def _retries_left(self) -> int:
        return len(self._canary_retry_delays) - self._canary_attempts

    def _starved_reason(self) -> str:
        """The reasons' words for the keys whose canary found no KV blocks ('' when none)."""
        labels = [k.label() for k in self._canary_starved]
        return unproven_reason(labels, self._canary_attempts, self._canary_retry_delays) if labels else ""

    def _mark_starved(self) -> None:
        """Each key whose canary found no KV blocks says so in its report (it runs eagerly)."""
        reason = CANARY_PENDING if self._retries_left() > 0 else CANARY_NOT_RUN
        for key in self._canary_starved:
            if key in self.key_reports:
                self.key_reports[key] = self.key_reports[key].model_copy(update={"eager_reason": reason})

    def _schedule_canary_retry(self) -> None:
        """Retry the starved canaries after the next delay, on the engine loop (once attached)."""
        token = (self._config_serial, self._canary_attempts)
        if not self._canary_starved or self._call_in_loop is None or self._retries_left() <= 0:
            return
        if token == self._retry_token:  # scheduled already
            return
        call = self._call_in_loop
        self._retry_token = token
        self._retry_timer = threading.Timer(self._canary_retry_delays[self._canary_attempts],
                                            lambda: call(lambda: self._retry_canary(token)))
        self._retry_timer.daemon = True
        self._retry_timer.start()

    def _retry_canary(self, token: tuple[int, int]) -> None:
        """One retry (on the engine loop, between steps): once a KV block is free, recapture the
        same configuration (a dropped graph is gone); otherwise count it and schedule the next.
        A newer recapture, a retry already made, or a drain makes it a no-op."""
        if token != (self._config_serial, self._canary_attempts) or not self._canary_starved:
            return
        if self.phase is Phase.DRAINING:
            return
        self._canary_attempts += 1
        free = self.engine.block_manager.num_free_blocks
        total = len(self._canary_retry_delays)
        if free == 0:
            log.info("canary retry %d/%d: every KV block is still held by requests", self._canary_attempts, total)
            self._mark_starved()
            self._finish(self._decide(), record=False)
            self._schedule_canary_retry()
            return
        log.info("canary retry %d/%d: %d KV blocks free, recapturing", self._canary_attempts, total, free)
        self._recapture()

    # -- outcome and report ---------------------------------------------------------------

    def _finish(self, outcome: Outcome, *, record: bool = True) -> None:
        """Take ``outcome``: phase, readiness, metrics, the report published; ``record`` adds a
        phase record (not for an outcome restated in the same phase, e.g. after a canary retry)."""
        with self._lock:  # checked and set under the lock that start_draining takes
            if self.phase is Phase.DRAINING:  # a drain started meanwhile wins: stay out of traffic
                log.info("lifecycle outcome %s ignored: the worker is draining", outcome.phase.value)
                return
            self.outcome = outcome
            self.phase = outcome.phase
            self.progress = None
            if record:
                self._phases.append(PhaseRecord(phase=outcome.phase, started_at=_now(), duration_seconds=0.0))
            if outcome.ready:
                self.readiness.set_ready(outcome.reason)
            else:
                self.readiness.set_not_ready(outcome.reason)
        log.info("worker %s: %s", outcome.phase.value, outcome.reason)
        if self.graph_metrics is not None:
            self.graph_metrics.set_phase(outcome.phase.value)
            self.graph_metrics.set_graph_state(self.report())
        self._publish()

    def _passing_keys(self) -> int:
        """Keys captured whose canary passed (or has not run)."""
        return passing_keys(list(self.key_reports.values()))  # list() copies atomically

    def _configured_keys(self) -> int:
        """Keys of the graph configuration the worker serves (one per capture size; two per FULL
        size with speculative decoding: query lengths 1 and k + 1), also while the runner is not
        configured for them yet, or could not be."""
        return len(configured_keys(self.graphs.config.mode, self.graphs.full_sizes, self.graphs.piecewise_sizes,
                                   self.contract, decode_query_lens(self.config.engine.num_speculative_tokens)))

    def coverage(self) -> float:
        """Fraction of the configured keys captured with a passing canary (1 in mode NONE)."""
        return coverage(self.graphs.config.mode, self._configured_keys(), self._passing_keys())

    def report(self) -> WorkerReport:
        """The current report (a new generation each call)."""
        with self._lock:
            self.generation += 1
            return build_report(self._report_state())

    def _report_state(self) -> ReportState:
        """A snapshot of what the report needs (call with the lock held)."""
        engine = self.engine
        kv = kv_cache_capacity(engine.num_kv_blocks, engine.limits.block_size) if engine is not None else None
        return ReportState(
            identity=self.identity,
            config=self.config,
            model_revision=self.loaded.revision,
            dtype=str(self.dtype).removeprefix("torch."),
            device=str(self.device),
            graphs=self.graphs,
            generation=self.generation,
            phase=self.phase,
            phases=list(self._phases),
            progress=self.progress,
            keys=self._key_reports_now(),
            configured_keys=self._configured_keys(),
            kv_cache=kv,
            graph_memory_estimate_bytes=self.graph_memory_estimate * self.config.tensor_parallel_size,  # every rank
            graph_memory_actual_bytes=self.runner.graph_memory_bytes() if self.runner else 0,
            capacity_tokens_per_second=self.capacity_tokens_per_second,
            outcome=self.outcome,
            updated_at=_now(),
            online_canary_comparisons=self._online.comparisons if self._online else 0,
            online_canary_divergences=self._online.divergences if self._online else 0,
            prefix_cache=engine.scheduler.prefix_cache_stats() if engine is not None else None,
            spec_decode=engine.spec.stats if engine is not None and engine.spec is not None else None,
            parallel_layout=self.contract.parallel_layout if self.config.tensor_parallel_size > 1 else None,
        )

    def _key_reports_now(self) -> list[KeyReport]:
        """The key reports with the online canary's tallies (copies: the engine thread writes)."""
        online = self.runner.online_canary if self.runner is not None else None
        return with_online_canary(dict(self.key_reports), dict(online.tallies) if online else {},
                                  dict(self.runner.diverged) if self.runner is not None else {},
                                  online is not None and online.rate > 0)

    def _publish(self) -> None:
        if not self.listeners:
            return
        report = self.report()
        for listener in self.listeners:
            try:
                listener(report)
            except Exception:  # a broken listener must not stop the lifecycle
                log.exception("report listener failed")

    # -- recapture and drain --------------------------------------------------------------

    def recapture(self, graphs: GraphConfig) -> WorkerReport:
        """Invalidate and recapture with a new graph configuration, without reloading the model.

        The same graph runner is reconfigured in place (same KV cache, same engine). Must run on
        the engine's loop thread (between steps), so no batch runs during capture.

        Raises:
            CaptureSizeError: the new sizes contradict the engine limits (nothing is changed).
            RecaptureRefused: the worker is draining, or speculative decoding is on and the new
                mode captures no FULL graphs (nothing is changed).
        """
        if self.phase is Phase.DRAINING:
            raise RecaptureRefused("the worker is draining; a recapture would bring it back into traffic")
        limits = self.config.engine
        if limits.speculative is not None and not graphs.mode.has_full:
            raise RecaptureRefused(speculative_mode_error(limits.speculative, graphs.mode))
        resolved = resolve_graphs(graphs, limits.max_num_seqs, limits.max_num_batched_tokens)
        self.config = self.config.model_copy(update={"graphs": graphs})
        self.graphs = resolved
        self._config_serial += 1  # a canary retry scheduled for the previous configuration is void
        self._canary_attempts = 0
        self._recapture()
        return self.report()

    def _recapture(self) -> None:
        """Capture, canary and outcome for the current configuration (on the engine loop)."""
        self.readiness.set_not_ready("recapturing")
        with self._lock:  # the reconfiguration below drops every graph: none is captured until it says so
            self.key_reports = {}
        try:
            self._capture_and_canary(Phase.RECAPTURING)
        except Exception as exc:
            log.exception("recapture failed")
            self._finish(failed("recapture failed", str(exc)))

    def start_draining(self) -> None:
        """Stop taking traffic (SIGTERM): readiness false, phase Draining, report published; a
        canary retry still scheduled is called off."""
        if self._retry_timer is not None:
            self._retry_timer.cancel()
        with self._lock:
            self.phase = Phase.DRAINING
            self._phases.append(PhaseRecord(phase=Phase.DRAINING, started_at=_now()))
            self.readiness.set_not_ready("draining")
        if self.graph_metrics is not None:
            self.graph_metrics.set_phase(Phase.DRAINING.value)
        self._publish()
