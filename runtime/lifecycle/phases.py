"""The worker lifecycle: load -> warmup -> profile -> capture -> canary -> report -> serve.

DESIGN.md section 3. Each phase is timed and recorded in the report (and in metrics), so probes
and rollout deadlines can be set from measured values:

``Loading``    the model at its exact revision (done in the foreground by the worker: a bad path,
               revision or architecture exits with one clear line);
``Warmup``     eager passes on representative shapes (lazy initialisation, cuBLAS handles,
               allocator growth happen here, outside any capture);
``Profiling``  graph-memory estimate (CUDA: the two largest keys of each kind captured into a
               throwaway runner, extrapolated as ``first + (n - 1) * second``, the estimate vLLM
               uses, shared/notes/graph-runtime-facts.md), then the KV cache is sized from the
               free memory minus the estimate and its margin;
``Capturing``  every configured key, largest first, one shared pool; progress keys done / total;
``Canary``     every captured key replayed against eager on fresh inputs (runtime/graphs/canary.py);
then ``Ready``, ``Degraded`` or ``Failed`` (see :func:`decide_outcome`). ``Recapturing`` and
``Draining`` come later on request.
"""

from __future__ import annotations

import datetime as dt
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from graphserving.contract.graph_policy import (
    GraphMode,
    default_piecewise_capture_sizes,
    resolve_capture_sizes,
)
from graphserving.contract.report import (
    CanaryResult as ReportCanary,
)
from graphserving.contract.report import (
    MAX_PHASES,
    GraphMemory,
    KeyReport,
    KvCacheCapacity,
    ModeKeys,
    Phase,
    PhaseRecord,
    Progress,
    WorkerIdentity,
    WorkerReport,
    config_hash,
)
from graphserving.contract.worker_config import GraphConfig, ReadinessPolicy, WorkerConfig
from ..graphs.canary import CanaryResult, canary_batch_for, run_canary
from ..graphs.key import (
    FallbackReason,
    GraphKey,
    GraphKeyContract,
    GraphRuntimeMode,
    full_key,
    piecewise_key,
)
from ..graphs.runner import GraphRunner, KeyCapture, StepStats

log = logging.getLogger(__name__)

NO_CUDA_REASON = "no CUDA: graphs need a CUDA device; serving eagerly"
# WorkerReport.degraded_reason / failure_reason hold at most this many characters; the reasons
# quote exception texts (a CUDA out-of-memory message alone is about 600 characters).
MAX_REASON_CHARS = 1024


def cut_reason(text: str) -> str:
    """``text`` cut to :data:`MAX_REASON_CHARS`, ending in ``...`` when it was cut."""
    return text if len(text) <= MAX_REASON_CHARS else text[: MAX_REASON_CHARS - 3] + "..."


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


@dataclass(frozen=True)
class ResolvedGraphs:
    """A GraphConfig with its capture sizes resolved against the engine limits."""

    config: GraphConfig
    full_sizes: list[int]
    piecewise_sizes: list[int]


def resolve_graphs(graphs: GraphConfig, max_num_seqs: int, max_num_batched_tokens: int) -> ResolvedGraphs:
    """Resolve capture sizes; the scheduler maxima are always captured.

    Raises:
        CaptureSizeError: a list that contradicts its maximum (the message names both values).
    """
    full = resolve_capture_sizes(graphs.capture_sizes, max_num_seqs, what="max_num_seqs") if graphs.mode.has_full else []
    piece = (
        resolve_capture_sizes(
            graphs.piecewise_capture_sizes, max_num_batched_tokens, what="max_num_batched_tokens",
            default=default_piecewise_capture_sizes,
        )
        if graphs.mode.has_piecewise
        else []
    )
    return ResolvedGraphs(graphs, full, piece)


@dataclass(frozen=True)
class Outcome:
    """The lifecycle's verdict after capture and canary."""

    phase: Phase
    ready: bool
    reason: str
    degraded_reason: str | None = None
    failure_reason: str | None = None


def decide_outcome(
    policy: ReadinessPolicy,
    mode: GraphMode,
    *,
    graphs_available: bool,
    configured: int,
    passing: int,
    captured_modes: set[GraphRuntimeMode],
    problems: list[str],
) -> Outcome:
    """Pure readiness decision from what was captured and what passed the canary.

    - coverage = passing / configured (1 when nothing is configured, i.e. mode NONE);
    - ready as a graph worker when coverage >= ``policy.min_coverage`` and every required mode
      has a passing key;
    - otherwise degraded (still serving, eagerly where graphs are missing) if
      ``policy.allow_degraded``; else not ready: ``Degraded`` when graphs are unavailable on this
      device (no CUDA: nothing failed, the operator's gate says ``DegradedNotAllowed``), ``Failed``
      when captures or canaries failed.

    The degraded and failure reasons are cut to :data:`MAX_REASON_CHARS` (the report's bound).
    """
    coverage = passing / configured if configured else 1.0
    missing_modes = []
    for required in policy.required_modes:
        kinds = []
        if required.has_full:
            kinds.append(GraphRuntimeMode.FULL)
        if required.has_piecewise:
            kinds.append(GraphRuntimeMode.PIECEWISE)
        if not all(k in captured_modes for k in kinds):
            missing_modes.append(required.value)
    no_graphs = not graphs_available and mode is not GraphMode.NONE
    if not no_graphs and coverage >= policy.min_coverage and not missing_modes:
        return Outcome(Phase.READY, True, f"graphs ready: coverage {coverage:.2f}")
    shortfall: list[str] = []
    if no_graphs:
        shortfall.append(NO_CUDA_REASON)
    else:
        if coverage < policy.min_coverage:
            shortfall.append(f"coverage {coverage:.2f} < minCoverage {policy.min_coverage:.2f}")
        if missing_modes:
            shortfall.append(f"required modes without a passing graph: {', '.join(missing_modes)}")
        shortfall += problems[:3]
    reason = "; ".join(shortfall)
    if policy.allow_degraded:
        return Outcome(Phase.DEGRADED, True, f"degraded: {reason}", degraded_reason=cut_reason(reason))
    if no_graphs:  # nothing failed: the worker is degraded by nature, and the policy keeps it out
        return Outcome(Phase.DEGRADED, False, f"not ready: degraded ({reason}) and allowDegraded is false",
                       degraded_reason=cut_reason(reason))
    return Outcome(Phase.FAILED, False, f"not ready: {reason} (allowDegraded is false)",
                   failure_reason=cut_reason(f"{reason} (allowDegraded is false)"))


class RecaptureRefused(RuntimeError):
    """A recapture was asked for in a phase that cannot take one."""


class WorkerLifecycle:
    """Drives one worker process through its phases and keeps its report.

    Args:
        config: the worker configuration.
        loaded: the model, loaded in the foreground (``model_loader.load_model``).
        loading_seconds: how long loading took (recorded as the Loading phase).
        pod_name / namespace: identity in Kubernetes (None outside).
        capture_fault: test hook passed to the graph runner (raise to fail a key's capture).
        canary_fault: test hook called before each key's canary (raise to fail it).
        emulate_graphs: without CUDA, capture and canary on the emulated backend and treat its
            graphs as available (tests of the lifecycle on CPU; never for serving).
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
    ):
        from ..api.app import Readiness

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
        self.contract = GraphKeyContract(model_revision=loaded.revision or "unverified",
                                         dtype=str(self.dtype).removeprefix("torch."))
        self.phase = Phase.LOADING
        self._phases: list[PhaseRecord] = []
        started = _now() - dt.timedelta(seconds=loading_seconds)
        self._phases.append(PhaseRecord(phase=Phase.LOADING, started_at=started, duration_seconds=loading_seconds))
        self.progress: Progress | None = None
        self.generation = 0
        self.outcome: Outcome | None = None
        self.engine = None
        self.runner: GraphRunner | None = None
        self.graph_memory_estimate = 0
        self.key_reports: dict[GraphKey, KeyReport] = {}
        self.capacity_tokens_per_second = 0.0
        self.listeners: list[Callable[[WorkerReport], None]] = []
        self._lock = threading.RLock()

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
            log.exception("worker lifecycle failed")
            self._finish(Outcome(Phase.FAILED, False, f"failed: {type(exc).__name__}: {exc}",
                                 failure_reason=cut_reason(f"{type(exc).__name__}: {exc}")))

    # -- warmup ---------------------------------------------------------------------------

    def _scratch_kv(self, num_blocks: int):
        from ..model.kv_cache import allocate_kv_cache

        return allocate_kv_cache(self.loaded.config, num_blocks, self.config.engine.block_size, self.dtype, self.device)

    @torch.inference_mode()
    def _warmup(self) -> None:
        limits = self.config.engine
        block_size = limits.block_size
        decode = max(self.graphs.full_sizes or [min(limits.max_num_seqs, 8)])
        chunk = limits.max_num_batched_tokens if self.device.type == "cuda" else min(limits.max_num_batched_tokens, 256)
        model_len = self._max_model_len()
        # one chunk with a block of cached context where the model is longer than a block
        chunk = min(chunk, model_len - block_size if model_len > block_size else model_len)
        blocks = decode * 2 + math.ceil(chunk / block_size) + 8
        kv = self._scratch_kv(blocks + 1)
        runner = GraphRunner(self.loaded.model, kv, mode=GraphMode.NONE, full_sizes=[], piecewise_sizes=[],
                             contract=self.contract, max_blocks_per_seq=1)
        generator = torch.Generator().manual_seed(0)
        ids = list(range(1, blocks + 1))
        vocab = self.loaded.config.vocab_size
        for key in (full_key(decode, self.contract), piecewise_key(chunk, self.contract)):
            meta = canary_batch_for(key, ids, block_size, vocab, self._max_model_len(), self.device, generator)
            for _ in range(2):
                runner.run_eager(meta)
        del runner, kv
        self._empty_cache()

    def _max_model_len(self) -> int:
        return min(self.config.engine.max_model_len or self.loaded.config.max_model_len, self.loaded.config.max_model_len)

    def _empty_cache(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    # -- profiling and the engine ---------------------------------------------------------

    @torch.inference_mode()
    def estimate_graph_memory(self) -> int:
        """Bytes the graphs of the configured keys will take (0 without CUDA).

        Captures the two largest keys of each kind into a throwaway runner over a small KV cache
        and extrapolates ``first + (n - 1) * second`` per kind; the throwaway runner's static
        buffers are counted in ``first``.
        """
        if self.device.type != "cuda" or self.graphs.config.mode is GraphMode.NONE:
            return 0
        limits = self.config.engine
        width = math.ceil(self._max_model_len() / limits.block_size)
        kv = self._scratch_kv(8)
        total = 0
        for kind, sizes in (("full", self.graphs.full_sizes), ("piecewise", self.graphs.piecewise_sizes)):
            if not sizes:
                continue
            probe_sizes = sorted(sizes)[-2:]
            self._empty_cache()
            before = _device_bytes_in_use(self.device)
            runner = GraphRunner(
                self.loaded.model, kv, mode=GraphMode.FULL if kind == "full" else GraphMode.PIECEWISE,
                full_sizes=probe_sizes if kind == "full" else [], piecewise_sizes=probe_sizes if kind != "full" else [],
                contract=self.contract, max_blocks_per_seq=width,
            )
            static = _device_bytes_in_use(self.device) - before
            captures = runner.capture_all()
            per_key = [c.memory_bytes for c in captures if c.ok]
            if per_key:
                first = static + per_key[0]
                second = per_key[1] if len(per_key) > 1 else per_key[0]
                total += first + (len(sizes) - 1) * second
            runner.invalidate("profiling done")
            del runner
        del kv
        self._empty_cache()
        return total

    def _profile_and_build_engine(self) -> None:
        from ..engine.core import LLMEngine
        from ..model.kv_cache import kv_cache_bytes_per_block

        limits = self.config.engine
        self.graph_memory_estimate = self.estimate_graph_memory()
        if limits.num_kv_blocks is None and self.device.type == "cuda":
            per_block = kv_cache_bytes_per_block(self.loaded.config, limits.block_size, self.dtype)
            free, _ = torch.cuda.mem_get_info(self.device)
            reserve = int(self.graph_memory_estimate * (1 + self.config.graphs.graph_memory_margin_fraction))
            budget = int(free * limits.kv_cache_memory_fraction) - reserve
            blocks = budget // per_block
            if blocks < 2:
                raise RuntimeError(f"no room for the KV cache: {free} bytes free, {reserve} reserved for graphs")
            limits = limits.model_copy(update={"num_kv_blocks": int(blocks)})
            log.info("KV cache sized after reserving %.1f MiB for graphs (estimate %.1f MiB + margin)",
                     reserve / 2**20, self.graph_memory_estimate / 2**20)
        self.engine = LLMEngine(self.loaded.model, self.loaded.config, self.loaded.tokenizer, limits,
                                device=self.device, dtype=self.dtype, seed=self.config.seed, metrics=self.metrics)

    # -- capture and canary ---------------------------------------------------------------

    def _capture_and_canary(self, phase: Phase = Phase.CAPTURING) -> None:
        limits = self.config.engine
        graphs = self.graphs
        width = math.ceil(self.engine.max_model_len / limits.block_size)
        self.runner = GraphRunner(
            self.loaded.model, self.engine.kv_caches, mode=graphs.config.mode, full_sizes=graphs.full_sizes,
            piecewise_sizes=graphs.piecewise_sizes, contract=self.contract, max_blocks_per_seq=width,
            capture_fault=self.capture_fault,
        )
        self.key_reports = {}
        if not self.graphs_available:
            self.runner.disable(FallbackReason.MODE_NONE if graphs.config.mode is GraphMode.NONE else FallbackReason.DEGRADED)
        self.engine.runner.graph_runner = self.runner
        captures: list[KeyCapture] = []
        if self.runner.enabled:
            if self.graph_metrics is not None:
                self.graph_metrics.start_capture()
            with self._phase(phase):
                with torch.inference_mode():
                    captures = self.runner.capture_all(progress=self._on_capture_progress)
        for c in captures:
            self.key_reports[c.key] = _key_report(c)
        problems: list[str] = [f"capture of {c.key.label()} failed: {c.error}" for c in captures if not c.ok]
        with self._phase(Phase.CANARY):
            problems += self._canary()
            self.capacity_tokens_per_second = self._measure_capacity()
        passing = self._passing_keys()
        captured_modes = {k.mode for k in self.runner.captured_keys()}
        outcome = decide_outcome(
            graphs.config.readiness, graphs.config.mode, graphs_available=self.graphs_available,
            configured=len(self.runner.keys), passing=passing, captured_modes=captured_modes, problems=problems,
        )
        if outcome.phase is Phase.FAILED and self.graphs_available:
            self.runner.disable(FallbackReason.NOT_CAPTURED)
        self.runner.stats = StepStats()
        self.runner.metrics = self.graph_metrics  # count serving passes only, not canary/capacity runs
        self._finish(outcome)

    def _on_capture_progress(self, done: int, total: int, result: KeyCapture) -> None:
        with self._lock:
            self.progress = Progress(done=done, total=total)
        log.info("captured %d/%d %s%s", done, total, result.key.label(), "" if result.ok else f" FAILED: {result.error}")
        if self.graph_metrics is not None:
            self.graph_metrics.observe_capture(result.key.label(), result.ok, result.capture_seconds)
        self._publish()

    @contextmanager
    def _borrowed_blocks(self, wanted: int) -> Iterator[list[int]]:
        bm = self.engine.block_manager
        seq_id = "__canary__"
        tokens = min(wanted, bm.num_free_blocks) * bm.block_size
        blocks = bm.allocate(seq_id, tokens) if tokens else []
        try:
            yield list(blocks)
        finally:
            if blocks:
                bm.free(seq_id)

    @torch.inference_mode()
    def _canary(self) -> list[str]:
        """Canary every captured key; failing keys are dropped (they fall back to eager)."""
        if not self.runner.graphs:
            return []
        limits = self.config.engine
        thresholds = self.config.graphs.canary
        generator = torch.Generator().manual_seed(self.config.seed)
        problems = []
        wanted = max(2 * max(self.graphs.full_sizes or [1]), math.ceil(max(self.graphs.piecewise_sizes or [1]) / limits.block_size) + 8)
        with self._borrowed_blocks(wanted) as blocks:
            for key in self.runner.captured_keys():
                try:
                    if self.canary_fault is not None:
                        self.canary_fault(key)
                    result = run_canary(self.runner, key, blocks, limits.block_size, self.engine.max_model_len,
                                        thresholds, generator)
                except Exception as exc:  # a canary that cannot run is a failed canary
                    result = CanaryResult(key, False, float("inf"), 0.0, 0, 0, 0.0, 0.0, 0.0,
                                          reason=f"{type(exc).__name__}: {exc}")
                report = self.key_reports[key]
                self.key_reports[key] = report.model_copy(update={
                    "canary": _canary_report(result),
                    "decode_step_seconds": result.replay_seconds if key.mode is GraphRuntimeMode.FULL else None,
                })
                if self.graph_metrics is not None:
                    self.graph_metrics.observe_canary(key.label(), result.passed)
                if not result.passed:
                    problems.append(f"canary failed for {key.label()}: {result.reason}")
                    self.runner.drop(key, f"canary failed: {result.reason}")
        return problems

    @torch.inference_mode()
    def _measure_capacity(self, repeats: int = 3) -> float:
        """Decode tokens/s at the configured batch (``max_num_seqs``), as this worker will run it.

        Needs ``max_num_seqs`` free KV blocks; without them the previous measurement is kept.
        """
        limits = self.config.engine
        batch = limits.max_num_seqs
        generator = torch.Generator().manual_seed(1)
        with self._borrowed_blocks(2 * batch) as blocks:
            if len(blocks) < batch:  # requests hold the KV cache (a recapture): keep the last value
                return self.capacity_tokens_per_second
            key = full_key(batch, self.contract)
            meta = canary_batch_for(key, blocks, limits.block_size, self.loaded.config.vocab_size,
                                    self.engine.max_model_len, self.device, generator)
            self.runner.execute(meta)  # warm
            self.runner.backend.synchronize()
            start = time.perf_counter()
            for _ in range(repeats):
                self.runner.execute(meta)
            self.runner.backend.synchronize()
            seconds = (time.perf_counter() - start) / repeats
        return batch / seconds if seconds > 0 else 0.0

    # -- outcome and report ---------------------------------------------------------------

    def _finish(self, outcome: Outcome) -> None:
        with self._lock:  # checked and set under the lock that start_draining takes
            if self.phase is Phase.DRAINING:  # a drain started meanwhile wins: stay out of traffic
                log.info("lifecycle outcome %s ignored: the worker is draining", outcome.phase.value)
                return
            self.outcome = outcome
            self.phase = outcome.phase
            self.progress = None
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
        return sum(1 for k in list(self.key_reports.values()) if k.captured and (k.canary is None or k.canary.passed))

    def coverage(self) -> float:
        configured = len(self.runner.keys) if self.runner else len(self.graphs.full_sizes) + len(self.graphs.piecewise_sizes)
        if not configured or self.graphs.config.mode is GraphMode.NONE:
            return 1.0
        return self._passing_keys() / configured

    def report(self) -> WorkerReport:
        """The current report (a new generation each call)."""
        with self._lock:
            self.generation += 1
            keys = list(self.key_reports.values())  # list() copies atomically; the engine thread writes
            captured_full = sorted(k.size for k in keys if k.kind == "FULL" and k.captured)
            captured_piece = sorted(k.size for k in keys if k.kind == "PIECEWISE" and k.captured)
            modes = []
            if self.graphs.full_sizes:
                modes.append(ModeKeys(kind="FULL", configured=self.graphs.full_sizes, captured=captured_full))
            if self.graphs.piecewise_sizes:
                modes.append(ModeKeys(kind="PIECEWISE", configured=self.graphs.piecewise_sizes, captured=captured_piece))
            p50, pmax = WorkerReport.capture_stats(keys)
            engine = self.engine
            kv = None
            if engine is not None:
                kv = KvCacheCapacity(num_blocks=engine.num_kv_blocks, block_size=engine.limits.block_size,
                                     tokens=engine.num_kv_blocks * engine.limits.block_size)
            actual = self.runner.graph_memory_bytes() if self.runner else 0
            outcome = self.outcome
            return WorkerReport(
                worker=self.identity,
                model_name=self.config.model_name,
                model_revision=self.loaded.revision,
                dtype=str(self.dtype).removeprefix("torch."),
                device=str(self.device),
                graph_config_hash=config_hash(self.config.graphs),
                mode=self.graphs.config.mode,
                generation=self.generation,
                phase=self.phase,
                phases=_bounded_phases(self._phases),
                progress=self.progress,
                modes=modes,
                coverage=self.coverage(),
                keys=keys,
                canary_failures=sum(1 for k in keys if k.canary is not None and not k.canary.passed),
                graph_memory=GraphMemory(estimate_bytes=self.graph_memory_estimate, actual_bytes=actual),
                kv_cache=kv,
                capture_seconds_p50=p50,
                capture_seconds_max=pmax,
                effective_capacity_tokens_per_second=self.capacity_tokens_per_second,
                degraded_reason=outcome.degraded_reason if outcome and self.phase is Phase.DEGRADED else None,
                failure_reason=outcome.failure_reason if outcome and self.phase is Phase.FAILED else None,
                updated_at=_now(),
            )

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

        Must run on the engine's loop thread (between steps), so no batch runs during capture.

        Raises:
            CaptureSizeError: the new sizes contradict the engine limits (nothing is changed).
            RecaptureRefused: the worker is draining (nothing is changed).
        """
        if self.phase is Phase.DRAINING:
            raise RecaptureRefused("the worker is draining; a recapture would bring it back into traffic")
        limits = self.config.engine
        resolved = resolve_graphs(graphs, limits.max_num_seqs, limits.max_num_batched_tokens)
        self.readiness.set_not_ready("recapturing")
        old = self.runner
        if old is not None:
            old.invalidate("recapture requested")
        self.config = self.config.model_copy(update={"graphs": graphs})
        self.graphs = resolved
        try:
            self._capture_and_canary(Phase.RECAPTURING)
        except Exception as exc:
            log.exception("recapture failed")
            self._finish(Outcome(Phase.FAILED, False, f"recapture failed: {exc}",
                                 failure_reason=cut_reason(str(exc))))
        return self.report()

    def start_draining(self) -> None:
        """Stop taking traffic (SIGTERM): readiness false, phase Draining, report published."""
        with self._lock:
            self.phase = Phase.DRAINING
            self._phases.append(PhaseRecord(phase=Phase.DRAINING, started_at=_now()))
            self.readiness.set_not_ready("draining")
        if self.graph_metrics is not None:
            self.graph_metrics.set_phase(Phase.DRAINING.value)
        self._publish()


def _bounded_phases(records: list[PhaseRecord]) -> list[PhaseRecord]:
    """At most ``MAX_PHASES`` records (the report's bound; each recapture adds three): the first
    half (start-up, whose durations probes and deadlines are set from) and the latest."""
    if len(records) <= MAX_PHASES:
        return list(records)
    head = MAX_PHASES // 2
    return records[:head] + records[len(records) - (MAX_PHASES - head):]


def _device_bytes_in_use(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return total - free


def _key_report(c: KeyCapture) -> KeyReport:
    full = c.key.mode is GraphRuntimeMode.FULL
    return KeyReport(
        kind="FULL" if full else "PIECEWISE",
        size=c.key.num_reqs if full else c.key.num_tokens,
        captured=c.ok,
        capture_seconds=c.capture_seconds,
        memory_bytes=c.memory_bytes if c.ok else None,
    )


def _canary_report(r: CanaryResult) -> ReportCanary:
    return ReportCanary(
        passed=r.passed,
        max_relative_logit_error=r.relative_error if math.isfinite(r.relative_error) else 1e30,
        top1_agreement=r.top1_agreement,
        min_top1_margin=max(0.0, r.min_margin),
        reason=(r.reason or None) and r.reason[:256],
    )
