"""The worker report: what a worker captured, measured and decided (docs/architecture.md, "Lifecycle").

A worker publishes it as the JSON annotation :data:`REPORT_ANNOTATION` on its own Pod (and serves it
at ``GET /v1/graphs``); the operator validates it (:mod:`graphserving.operator.report_validation`)
before it sets the Pod's readiness gate. Pure pydantic: importable without torch.

Size: an annotation value may not exceed 256 KiB in total with all other annotations; a report is
bounded by :data:`MAX_REPORT_BYTES` (32 KiB). :meth:`WorkerReport.to_annotation` compacts a report
that would exceed it (per-key details dropped, aggregates kept, ``truncated`` set) rather than fail.

Staleness: ``worker.instance`` is unique per worker process start and ``generation`` increases with
every report that process publishes, so ``(instance, generation)`` orders the reports of one Pod.
``graph_config_hash`` (:func:`config_hash` of the worker's :class:`GraphConfig`) tells the operator
which graph configuration the report is about, so a report from before a recapture is recognised.
"""

from __future__ import annotations

import datetime as dt
import enum
import hashlib
import json
import statistics
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

from graphserving.contract.graph_policy import GraphMode
from graphserving.contract.worker_config import GraphConfig

REPORT_ANNOTATION = "graphserving.io/report"
#: Annotation the operator writes on a Pod to ask its worker to recapture (JSON of RecaptureRequest).
RECAPTURE_ANNOTATION = "graphserving.io/recapture"
REPORT_SCHEMA_VERSION = 1
#: Version of the graph key definition (what a dispatch key contains); bumped when it changes.
GRAPH_KEY_CONTRACT_VERSION = 1
#: Bound on the serialised report (compact JSON, UTF-8), far below the 256 KiB annotation limit.
MAX_REPORT_BYTES = 32 * 1024
MAX_KEYS = 1024
#: Bound on a reported capacity (tokens/s): far above any one worker, small enough to sum safely.
MAX_CAPACITY_TOKENS_PER_SECOND = 1e9
MAX_PHASES = 64

_CONFIG = ConfigDict(
    alias_generator=to_camel,
    validate_by_name=True,
    validate_by_alias=True,
    serialize_by_alias=True,
    extra="forbid",
    frozen=True,
    allow_inf_nan=False,
)


def config_hash(model: BaseModel) -> str:
    """A stable 16-hex-digit sha256 prefix of a pydantic model's canonical JSON.

    Both sides compute it on the same model (e.g. the worker's ``GraphConfig``), so equal hashes mean
    equal configuration. Key order and whitespace do not matter; field values do.
    """
    canonical = json.dumps(model.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


class Phase(str, enum.Enum):
    """Worker lifecycle phases, in order (``Recapturing`` and ``Draining`` come later, if at all)."""

    LOADING = "Loading"
    WARMUP = "Warmup"
    PROFILING = "Profiling"
    CAPTURING = "Capturing"
    CANARY = "Canary"
    READY = "Ready"
    DEGRADED = "Degraded"
    FAILED = "Failed"
    RECAPTURING = "Recapturing"
    DRAINING = "Draining"

    @property
    def is_terminal_serving(self) -> bool:
        return self in (Phase.READY, Phase.DEGRADED)


class _Report(BaseModel):
    model_config = _CONFIG


class WorkerIdentity(_Report):
    """Who wrote the report."""

    pod_name: str | None = Field(None, max_length=253, description="POD_NAME; None outside Kubernetes.")
    namespace: str | None = Field(None, max_length=63)
    instance: str = Field(..., min_length=1, max_length=64, description="Unique per process start (e.g. a uuid4).")
    started_at: dt.datetime


class PhaseRecord(_Report):
    phase: Phase
    started_at: dt.datetime
    duration_seconds: float | None = Field(None, ge=0, description="None while the phase runs.")


class Progress(_Report):
    """Progress of a long phase (e.g. keys captured so far out of the total)."""

    done: int = Field(..., ge=0)
    total: int = Field(..., ge=0)


class ModeKeys(_Report):
    """Configured vs captured capture sizes of one graph kind.

    ``kind`` is ``FULL`` (sizes in requests, uniform decode) or ``PIECEWISE`` (sizes in tokens).
    """

    kind: Literal["FULL", "PIECEWISE"]
    configured: list[int] = Field(default_factory=list, max_length=MAX_KEYS)
    captured: list[int] = Field(default_factory=list, max_length=MAX_KEYS)


class CanaryResult(_Report):
    """Graph replay vs eager on the same fresh inputs, for one key."""

    passed: bool
    max_relative_logit_error: float = Field(..., ge=0)
    top1_agreement: float = Field(..., ge=0, le=1, description="Fraction of rows (above the margin) agreeing.")
    min_top1_margin: float | None = Field(None, ge=0, description="Smallest top-1/top-2 logit margin seen.")
    reason: str | None = Field(None, max_length=256)


class OnlineCanary(_Report):
    """The online canary's tally for one key since its capture (docs/reliability.md, "Graphs are
    watched while they serve").

    A sampled replay of the key is re-run eagerly on the same inputs, in the step it samples, and
    compared under the same :class:`~graphserving.contract.worker_config.CanaryThresholds` as the pre-ready
    canary. A divergence takes the key out of dispatch (it runs eagerly, reason
    ``canary_divergence``) until the next capture.
    """

    comparisons: int = Field(0, ge=0, description="Sampled replays compared with eager execution.")
    divergences: int = Field(0, ge=0, description="Comparisons outside the canary thresholds.")
    last_divergence: CanaryResult | None = Field(None, description="The comparison that took the key out.")


class KeyReport(_Report):
    """One graph key: capture, canary, memory and timing."""

    kind: Literal["FULL", "PIECEWISE"]
    size: int = Field(..., ge=1)
    query_len: int | None = Field(
        None, ge=2, description="Query rows per request of a speculative decoding verification key (k + 1; "
                                "docs/worker.md); None: one (a decode key), or a PIECEWISE key."
    )
    captured: bool
    capture_seconds: float | None = Field(None, ge=0)
    memory_estimate_bytes: int | None = Field(None, ge=0)
    memory_bytes: int | None = Field(None, ge=0, description="Measured growth of the graph pool.")
    decode_step_seconds: float | None = Field(None, ge=0, description="Measured replay step latency.")
    canary: CanaryResult | None = None
    online_canary: OnlineCanary | None = Field(None, description="None while the online canary is off.")
    eager_reason: str | None = Field(
        None, max_length=64, description="Why a captured key runs eagerly now (e.g. canary_divergence); None: it replays."
    )


class GraphMemory(_Report):
    estimate_bytes: int = Field(0, ge=0)
    actual_bytes: int = Field(0, ge=0)


class KvCacheCapacity(_Report):
    num_blocks: int = Field(..., ge=0)
    block_size: int = Field(..., ge=1)
    tokens: int = Field(..., ge=0, description="num_blocks * block_size.")


class PrefixCacheReport(_Report):
    """The prefix cache's totals since the worker started (runtime/engine/prefix_cache.py; the same
    values as the metrics ``graphserving_prefix_cache_*``, docs/worker.md, "Prefix caching")."""

    enabled: bool = Field(..., description="Whether prefix caching is on (runtime.engine.prefixCaching).")
    query_tokens: int = Field(0, ge=0, description="Tokens of admitted sequences looked up in the prefix cache.")
    hit_tokens: int = Field(0, ge=0, description="Of those, tokens found cached (their prefill was skipped).")
    cached_blocks: int = Field(0, ge=0, description="KV blocks in the prefix cache now, referenced or evictable.")

    @model_validator(mode="after")
    def _hits_within_queries(self) -> PrefixCacheReport:
        if self.hit_tokens > self.query_tokens:
            raise ValueError(f"prefixCache.hitTokens {self.hit_tokens} exceeds queryTokens {self.query_tokens}")
        return self


class SpecDecodeReport(_Report):
    """Speculative decoding's totals since the worker started (runtime/engine/spec_decode/acceptance.py;
    the same values as the metrics ``graphserving_spec_decode_*``, docs/worker.md, "Speculative decoding")."""

    num_speculative_tokens: int = Field(..., ge=1, le=8, description="k of runtime.engine.speculative (ngram:k).")
    verifications: int = Field(0, ge=0, description="Requests verified (one per request per verification step).")
    proposed_tokens: int = Field(0, ge=0, description="Draft tokens sent to verification.")
    accepted_tokens: int = Field(0, ge=0, description="Of those, tokens the target model kept.")
    emitted_tokens: int = Field(0, ge=0, description="Tokens verifications emitted (accepted drafts + one each).")
    acceptance_rate: float | None = Field(None, ge=0, le=1, description="accepted / proposed; None before a proposal.")
    acceptance_rate_per_position: list[float | None] = Field(
        default_factory=list, max_length=8, description="Per draft position j: accepted / proposed at j.")
    mean_acceptance_length: float | None = Field(
        None, ge=1, le=9, description="Tokens emitted per verification (accepted drafts + 1).")

    @model_validator(mode="after")
    def _accepted_within_proposed(self) -> SpecDecodeReport:
        if self.accepted_tokens > self.proposed_tokens:
            raise ValueError(f"specDecode.acceptedTokens {self.accepted_tokens} exceeds proposedTokens "
                             f"{self.proposed_tokens}")
        return self


class WorkerReport(_Report):
    """The report a worker publishes (schema version :data:`REPORT_SCHEMA_VERSION`)."""

    schema_version: Literal[1] = REPORT_SCHEMA_VERSION
    worker: WorkerIdentity
    model_name: str = Field(..., min_length=1, max_length=253)
    model_revision: str | None = Field(None, max_length=64, description="Verified sha256; None if unchecked.")
    dtype: str | None = Field(None, max_length=16)
    device: str | None = Field(None, max_length=32, description="e.g. cpu, cuda:0 (rank 0's under tensor parallelism).")
    parallel_layout: str | None = Field(
        None, max_length=32, pattern=r"^tp[0-9]+-pp[0-9]+$",
        description="tp<N>-pp<M> of a worker whose model is split over several ranks, as in its graph keys (graph "
                    "memory then counts all ranks); None (left out): one rank, so that an operator of the schema "
                    "before the field still accepts the reports of single-GPU workers.")
    graph_key_contract_version: int = Field(GRAPH_KEY_CONTRACT_VERSION, ge=1)
    graph_config_hash: str = Field(..., min_length=1, max_length=64, description="config_hash(GraphConfig).")
    mode: GraphMode
    generation: int = Field(..., ge=1, description="Increases with every report of this instance.")
    phase: Phase
    phases: list[PhaseRecord] = Field(default_factory=list, max_length=MAX_PHASES)
    progress: Progress | None = None
    modes: list[ModeKeys] = Field(default_factory=list, max_length=2)
    coverage: float = Field(..., ge=0, le=1, description="Configured keys captured and passing canary / configured keys (1.0 if none).")
    keys: list[KeyReport] = Field(default_factory=list, max_length=MAX_KEYS)
    canary_failures: int = Field(0, ge=0, description="Keys whose canary failed (kept when keys are compacted).")
    online_canary_comparisons: int = Field(0, ge=0, description="Online canary comparisons, all keys.")
    online_canary_divergences: int = Field(
        0, ge=0, description="Online canary divergences, all keys (each took its key out of dispatch)."
    )
    graph_memory: GraphMemory = Field(default_factory=GraphMemory)
    kv_cache: KvCacheCapacity | None = None
    prefix_cache: PrefixCacheReport | None = Field(
        None, description="Prefix-cache totals as of updatedAt; None before the engine exists."
    )
    spec_decode: SpecDecodeReport | None = Field(
        None, description="Speculative-decoding totals as of updatedAt; None when it is off (or before the engine)."
    )
    capture_seconds_p50: float | None = Field(None, ge=0)
    capture_seconds_max: float | None = Field(None, ge=0)
    effective_capacity_tokens_per_second: float = Field(
        0.0, ge=0, le=MAX_CAPACITY_TOKENS_PER_SECOND,
        description="Estimated decode throughput at the configured batch, tokens/s.",
    )
    degraded_reason: str | None = Field(None, max_length=1024)
    failure_reason: str | None = Field(None, max_length=1024)
    truncated: bool = Field(False, description="Per-key details were dropped to fit MAX_REPORT_BYTES.")
    updated_at: dt.datetime

    @model_validator(mode="after")
    def _consistent(self) -> WorkerReport:
        if self.phase is Phase.DEGRADED and not self.degraded_reason:
            raise ValueError("degradedReason is required when phase is Degraded")
        if self.phase is Phase.FAILED and not self.failure_reason:
            raise ValueError("failureReason is required when phase is Failed")
        if self.progress is not None and self.progress.done > self.progress.total:
            raise ValueError(f"progress.done {self.progress.done} exceeds progress.total {self.progress.total}")
        return self

    # ---- derived values -----------------------------------------------------------------------

    def canary_passed(self) -> bool:
        """True when no captured key failed its canary."""
        return self.canary_failures == 0 and all(
            k.canary is None or k.canary.passed for k in self.keys if k.captured
        )

    def phase_seconds(self, phase: Phase) -> float | None:
        """Total measured duration of ``phase`` (None if never completed)."""
        done = [p.duration_seconds for p in self.phases if p.phase is phase and p.duration_seconds is not None]
        return sum(done) if done else None

    @staticmethod
    def capture_stats(keys: list[KeyReport]) -> tuple[float | None, float | None]:
        """(p50, max) of the capture seconds of captured keys."""
        seconds = [k.capture_seconds for k in keys if k.captured and k.capture_seconds is not None]
        if not seconds:
            return None, None
        return statistics.median(seconds), max(seconds)

    # ---- serialisation ------------------------------------------------------------------------

    def to_json(self) -> str:
        return self.model_dump_json(by_alias=True, exclude_none=True)

    def compacted(self) -> WorkerReport:
        """The same report without per-key details and phase history beyond the last of each phase.

        Aggregates (coverage, canary failures, capture p50/max, total graph memory, modes) stay.
        """
        p50, pmax = self.capture_stats(self.keys) if self.keys else (self.capture_seconds_p50, self.capture_seconds_max)
        failures = self.canary_failures or sum(
            1 for k in self.keys if k.captured and k.canary is not None and not k.canary.passed
        )
        last: dict[Phase, PhaseRecord] = {}
        for record in self.phases:
            last[record.phase] = record
        return self.model_copy(
            update={
                "keys": [],
                "phases": sorted(last.values(), key=lambda r: r.started_at),
                "canary_failures": failures,
                "capture_seconds_p50": p50,
                "capture_seconds_max": pmax,
                "truncated": True,
            }
        )

    def to_annotation(self) -> str:
        """Compact JSON for the Pod annotation, at most :data:`MAX_REPORT_BYTES` bytes.

        Raises:
            ValueError: even the compacted report exceeds the bound (e.g. huge capture-size lists).
        """
        text = self.to_json()
        if len(text.encode()) <= MAX_REPORT_BYTES:
            return text
        text = self.compacted().to_json()
        size = len(text.encode())
        if size > MAX_REPORT_BYTES:
            raise ValueError(f"report is {size} bytes even compacted; the bound is {MAX_REPORT_BYTES}")
        return text

    @classmethod
    def from_annotation(cls, text: str) -> WorkerReport:
        """Parse an annotation value.

        Raises:
            ValueError: the value exceeds :data:`MAX_REPORT_BYTES`.
            pydantic.ValidationError: malformed JSON or a contract violation (fields named).
        """
        size = len(text.encode())
        if size > MAX_REPORT_BYTES:
            raise ValueError(f"report annotation is {size} bytes; the bound is {MAX_REPORT_BYTES}")
        return cls.model_validate_json(text)


class RecaptureRequest(_Report):
    """What the operator asks a running worker to capture instead (``POST /v1/graphs/recapture``
    body, and the value of :data:`RECAPTURE_ANNOTATION`). ``graph_config_hash`` is
    ``config_hash(graphs)``."""

    graph_config_hash: str = Field(..., min_length=1, max_length=64)
    graphs: GraphConfig
