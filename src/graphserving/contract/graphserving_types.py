"""The GraphServing API (``graphserving.io/v1alpha1``): spec and status as pydantic models.

These models are the single source of the API. The CRD's OpenAPI schema is generated from them
(:mod:`graphserving.operator.crd`, checked in at ``manifests/crd/graphserving.io_graphservings.yaml``,
with its JSON Schema for editors at ``manifests/schema/``), so the API server and the operator validate
the same rules (``spec.runtime`` lives in :mod:`~graphserving.contract.runtime_spec`,
``spec.podTemplate`` in :mod:`~graphserving.contract.pod_template`; both are re-exported here):

- pydantic validators here raise with the field named;
- the same cross-field rules are attached as CEL ``x-kubernetes-validations`` (``json_schema_extra``)
  so the API server rejects an invalid object before the operator ever sees it.

JSON field names are camelCase (the Kubernetes convention) through aliases; Python code uses the
snake_case attribute names. Models reuse the worker contract's fields where they mean the same thing
(:class:`~graphserving.contract.worker_config.EngineLimits`, ``CanaryThresholds``, ``ReadinessPolicy``)
and convert to it with ``to_worker()``.

Kubernetes core types that the operator passes through verbatim (tolerations, affinity, env, volumes,
volume mounts) are kept as open objects (``x-kubernetes-preserve-unknown-fields``); the API server
validates them when the operator applies the Deployment, and the operator reports that failure.
"""

from __future__ import annotations

import datetime as dt
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from graphserving.contract import worker_config as wc
from graphserving.contract.graph_policy import GraphMode, resolve_capture_sizes
from graphserving.contract.api_base import CAMEL as _CAMEL
from graphserving.contract.api_base import ApiModel
from graphserving.contract.pod_template import PodTemplateOverrides
from graphserving.contract.runtime_spec import (  # noqa: F401  (re-exported: the API's runtime part)
    API_KEY_ENV,
    Engine,
    ResourceRequirements,
    RuntimeSpec,
    SecretKeySelector,
    ToolCallParser,
)

GROUP = "graphserving.io"
VERSION = "v1alpha1"
KIND = "GraphServing"
PLURAL = "graphservings"
SINGULAR = "graphserving"
SHORT_NAMES = ["gs"]
CATEGORIES = ["graphserving", "all"]
API_VERSION = f"{GROUP}/{VERSION}"

#: Longest GraphServing name: ``<name>-<10-char revision hash>`` must stay a DNS-1035 label (63).
MAX_NAME_LENGTH = 52
#: Upper bound on capture-size lists (keeps CEL rule costs bounded; far above any useful list).
MAX_CAPTURE_SIZES = 512

# ---------------------------------------------------------------------------------------- spec


class PersistentVolumeClaimSource(ApiModel):
    """Weights on a PersistentVolumeClaim, mounted read-only at ``/models`` in the worker."""

    claim_name: str = Field(..., min_length=1, max_length=253, description="PersistentVolumeClaim in this namespace.")
    sub_path: str = Field("", max_length=4096, description="Path of the weights inside the volume.")


class ImageSource(ApiModel):
    """Weights inside an OCI image, mounted read-only at ``/models`` (Kubernetes image volumes)."""

    reference: str = Field(..., min_length=1, max_length=1024, description="OCI image reference holding the weights.")
    sub_path: str = Field("", max_length=4096, description="Path of the weights inside the image.")
    pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        "IfNotPresent", description="When the kubelet pulls the image; default IfNotPresent."
    )


class ModelSource(ApiModel):
    """Where the weights are. Exactly one of ``path``, ``pvc``, ``image``."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "[has(self.path), has(self.pvc), has(self.image)].filter(x, x).size() == 1",
                    "message": "exactly one of path, pvc, image must be set",
                }
            ]
        }
    )

    path: str | None = Field(
        None, min_length=1, max_length=4096, description="File or directory on the node (development)."
    )
    pvc: PersistentVolumeClaimSource | None = None
    image: ImageSource | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> ModelSource:
        given = [n for n in ("path", "pvc", "image") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError(f"model.source: exactly one of path, pvc, image must be set, got {given or 'none'}")
        return self


class ModelSpec(ApiModel):
    """The model a GraphServing serves, at an exact revision."""

    name: str = Field(..., min_length=1, max_length=253, description="Name served at /v1/models.")
    source: ModelSource
    revision: str = Field(
        ...,
        pattern=r"^[0-9a-f]{64}$",
        description="sha256 of the weights (hex; for a directory, of its manifest): the worker "
        "refuses other bytes. Part of the revision hash.",
    )
    dtype: wc.Dtype | None = Field(None, description="Unset: float32 on CPU, bfloat16 on CUDA.")


class Canary(wc.CanaryThresholds):
    """Canary thresholds (the worker's :class:`CanaryThresholds`, camelCase)."""

    model_config = _CAMEL

    def to_worker(self) -> wc.CanaryThresholds:
        return wc.CanaryThresholds(**self.model_dump(by_alias=False))


class Readiness(wc.ReadinessPolicy):
    """When a worker counts as ready (the worker's :class:`ReadinessPolicy`, camelCase)."""

    model_config = _CAMEL

    required_modes: list[GraphMode] = Field(
        default_factory=list,
        max_length=len(GraphMode),
        description="Graph modes a worker must have captured graphs for; each must be captured by graphs.mode.",
        json_schema_extra={"x-kubernetes-list-type": "set"},
    )

    def to_worker(self) -> wc.ReadinessPolicy:
        return wc.ReadinessPolicy(**self.model_dump(by_alias=False))


class AutoCaptureSizes(ApiModel):
    """Capture sizes chosen by the planner from a batch-size histogram (``captureSizes: auto``)."""

    histogram_config_map: str = Field(
        ..., min_length=1, max_length=253, description="ConfigMap in this namespace holding the histogram."
    )
    key: str = Field("histogram.csv", min_length=1, max_length=253, description="CSV `batch_size,count`.")
    max_graphs: int = Field(
        16, ge=1, le=MAX_CAPTURE_SIZES,
        description="Most capture sizes the planner picks (maxNumSeqs always among them); default 16.",
    )


CaptureSize = Annotated[int, Field(ge=1, le=1 << 20)]
#: CEL list literals of the modes that capture full and piecewise graphs (GraphMode.has_full/_piecewise).
_FULL_MODES = "[" + ", ".join(f"'{m.value}'" for m in GraphMode if m.has_full) + "]"
_PIECEWISE_MODES = "[" + ", ".join(f"'{m.value}'" for m in GraphMode if m.has_piecewise) + "]"


def _sorted_rule(field: str) -> dict[str, Any]:
    # listType "set" rejects duplicates; isSorted() (Kubernetes CEL list library) rejects decreases.
    return {
        "x-kubernetes-list-type": "set",
        "x-kubernetes-validations": [
            {"rule": "self.isSorted()", "message": f"{field} must be strictly increasing"},
        ],
    }


class GraphsSpec(ApiModel):
    """What the workers capture, and when a worker counts as ready."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "!(has(self.captureSizes) && has(self.autoCaptureSizes))",
                    "message": "set captureSizes or autoCaptureSizes, not both",
                },
                {
                    # A required mode that graphs.mode never captures keeps every worker out of traffic.
                    "rule": "!has(self.readiness.requiredModes) || self.readiness.requiredModes.all(r, "
                    f"(!(r in {_FULL_MODES}) || self.mode in {_FULL_MODES}) && "
                    f"(!(r in {_PIECEWISE_MODES}) || self.mode in {_PIECEWISE_MODES}))",
                    "message": "readiness.requiredModes names graphs that graphs.mode does not capture: "
                    "no worker could ever become ready",
                    "fieldPath": ".readiness.requiredModes",
                    "reason": "FieldValueInvalid",
                },
            ]
        }
    )

    mode: GraphMode = Field(
        GraphMode.FULL_AND_PIECEWISE,
        description="Which passes replay from CUDA graphs (graphserving.contract.graph_policy.GraphMode). "
        "A graph mode without GPUs is valid: the workers run degraded when readiness.allowDegraded.",
    )
    capture_sizes: list[CaptureSize] | None = Field(
        None,
        min_length=1,
        max_length=MAX_CAPTURE_SIZES,
        description="Full-graph capture sizes in requests, strictly increasing, each <= "
        "runtime.engine.maxNumSeqs (always captured). Unset: the default grid.",
        json_schema_extra=_sorted_rule("captureSizes"),
    )
    piecewise_capture_sizes: list[CaptureSize] | None = Field(
        None,
        min_length=1,
        max_length=MAX_CAPTURE_SIZES,
        description="Piecewise capture sizes in tokens, strictly increasing, each <= "
        "runtime.engine.maxNumBatchedTokens (always captured). Unset: the default grid.",
        json_schema_extra=_sorted_rule("piecewiseCaptureSizes"),
    )
    auto_capture_sizes: AutoCaptureSizes | None = Field(
        None, description="Let the planner choose captureSizes from a histogram."
    )
    graph_memory_margin_fraction: float = Field(
        0.1, ge=0, le=10,
        description="Fraction added to the graph-memory estimate before the KV cache is sized; default 0.1.",
    )
    canary: Canary = Field(default_factory=Canary)
    readiness: Readiness = Field(default_factory=Readiness)

    @model_validator(mode="after")
    def _explicit_or_auto(self) -> GraphsSpec:
        if self.capture_sizes is not None and self.auto_capture_sizes is not None:
            raise ValueError("graphs: set captureSizes or autoCaptureSizes, not both")
        uncaptured = [
            r.value
            for r in self.readiness.required_modes
            if (r.has_full and not self.mode.has_full) or (r.has_piecewise and not self.mode.has_piecewise)
        ]
        if uncaptured:
            raise ValueError(
                f"graphs.readiness.requiredModes {uncaptured} need graphs that graphs.mode {self.mode.value} "
                "does not capture: no worker could ever become ready"
            )
        return self

    def to_worker(self, capture_sizes: list[int] | None = None) -> wc.GraphConfig:
        """The worker's GraphConfig; ``capture_sizes`` overrides (the planner's resolved list)."""
        return wc.GraphConfig(
            mode=self.mode,
            capture_sizes=capture_sizes if capture_sizes is not None else self.capture_sizes,
            piecewise_capture_sizes=self.piecewise_capture_sizes,
            graph_memory_margin_fraction=self.graph_memory_margin_fraction,
            canary=self.canary.to_worker(),
            readiness=self.readiness.to_worker(),
        )


class RolloutSpec(ApiModel):
    """How a revision change rolls out.

    Capacity is measured: each ready worker counts at the effective capacity (tokens/s) its report
    states, a degraded worker at its measured degraded capacity, any other pod at zero.
    """

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "self.maxSurge > 0 || self.minAvailableCapacity < 1.0",
                    "message": "maxSurge 0 with minAvailableCapacity 1.0 can never replace a pod: "
                    "allow a surge or lower minAvailableCapacity",
                    "fieldPath": ".maxSurge",
                }
            ]
        }
    )

    max_surge: int = Field(1, ge=0, le=100, description="Pods above spec.replicas during a rollout.")
    min_available_capacity: float = Field(
        1.0,
        ge=0,
        le=1,
        description="Fraction of the capacity measured when the rollout started that must stay served.",
    )
    progress_deadline_seconds: int = Field(
        1800, ge=30, le=86400,
        description="Seconds without progress before the rollout is DeadlineExceeded; default 1800.",
    )
    paused: bool = Field(False, description="Freeze the rollout: every revision keeps its replicas; default false.")
    auto_rollback: bool = Field(True, description="Return traffic to the previous revision when canaries fail.")

    @model_validator(mode="after")
    def _can_progress(self) -> RolloutSpec:
        if self.max_surge == 0 and self.min_available_capacity >= 1.0:
            raise ValueError(
                "rollout.maxSurge: 0 with minAvailableCapacity 1.0 can never replace a pod: "
                "allow a surge or lower minAvailableCapacity"
            )
        return self


# The Gateway API's own patterns (its HTTPRoute CRD, v1.6; tests/gateway/test_gateway_api_crds.py
# compares them with the installed CRD), so that a value the HTTPRoute would refuse is refused on
# the GraphServing, naming its field, instead of failing when the operator applies the route.
GATEWAY_NAMESPACE_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
GATEWAY_SECTION_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
GATEWAY_HOSTNAME_PATTERN = r"^(\*\.)?[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"

GatewayHostname = Annotated[str, Field(min_length=1, max_length=253, pattern=GATEWAY_HOSTNAME_PATTERN)]


class ParentReference(ApiModel):
    """A Gateway API parentRef (gateway.networking.k8s.io)."""

    name: str = Field(..., min_length=1, max_length=253, description="Name of the parent (the Gateway).")
    namespace: str | None = Field(None, min_length=1, max_length=63, pattern=GATEWAY_NAMESPACE_PATTERN,
                                  description="Namespace of the parent; unset: this one.")
    section_name: str | None = Field(None, min_length=1, max_length=253, pattern=GATEWAY_SECTION_NAME_PATTERN,
                                     description="Listener of the parent; unset: all.")
    group: str = Field(
        "gateway.networking.k8s.io", max_length=253,
        description="API group of the parent; default gateway.networking.k8s.io.",
    )
    kind: str = Field("Gateway", max_length=63, description="Kind of the parent; default Gateway.")
    port: int | None = Field(None, ge=1, le=65535, description="Listener port of the parent; unset: all.")


class RoutingSpec(ApiModel):
    """Capacity-weighted routing through a Gateway API HTTPRoute."""

    parent_refs: list[ParentReference] = Field(
        ..., min_length=1, max_length=32, description="Gateways the HTTPRoute attaches to."
    )
    hostnames: list[GatewayHostname] | None = Field(
        None, max_length=16, description="Host names the HTTPRoute matches (lower-case DNS names, an optional leading "
        "'*.'); unset: those of the Gateway."
    )


_API_KEY_TWICE = (f"podTemplate.env sets {API_KEY_ENV} and runtime.apiKeySecretRef names the Secret holding "
                  "the API key: set only one of them")


_SPECULATIVE_NOT_WITH_TP = ("runtime.engine.speculative is not supported with runtime.gpus above 1 (tensor "
                            "parallelism) yet: unset one of them")

_SPECULATIVE_NEEDS_FULL = ("runtime.engine.speculative needs a graphs.mode that captures FULL graphs (FULL, "
                           "FULL_DECODE_ONLY or FULL_AND_PIECEWISE): verification batches replay them")


class GraphServingSpec(ApiModel):
    """Desired state of a GraphServing."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "!has(self.graphs.captureSizes) || "
                    "self.graphs.captureSizes.max() <= self.runtime.engine.maxNumSeqs",
                    # A static message: Kubernetes estimates messageExpression costs far above budget here.
                    "message": "capture sizes must be <= runtime.engine.maxNumSeqs: a batch can never reach a larger one",
                    "fieldPath": ".graphs.captureSizes",
                    "reason": "FieldValueInvalid",
                },
                {
                    "rule": "!has(self.graphs.piecewiseCaptureSizes) || "
                    "self.graphs.piecewiseCaptureSizes.max() <= self.runtime.engine.maxNumBatchedTokens",
                    "message": "piecewise capture sizes must be <= runtime.engine.maxNumBatchedTokens",
                    "fieldPath": ".graphs.piecewiseCaptureSizes",
                    "reason": "FieldValueInvalid",
                },
                {
                    "rule": "!has(self.runtime.engine.speculative) || !has(self.graphs.mode) || "
                    f"self.graphs.mode in {_FULL_MODES}",
                    "message": _SPECULATIVE_NEEDS_FULL,
                    "fieldPath": ".runtime.engine.speculative",
                    "reason": "FieldValueInvalid",
                },
                {
                    "rule": "!has(self.runtime.engine.speculative) || !has(self.runtime.gpus) || self.runtime.gpus <= 1",
                    "message": _SPECULATIVE_NOT_WITH_TP,
                    "fieldPath": ".runtime.engine.speculative",
                    "reason": "FieldValueInvalid",
                },
                {
                    "rule": "!has(self.runtime.apiKeySecretRef) || !has(self.podTemplate.env) || "
                    f"!self.podTemplate.env.exists(e, e.name == '{API_KEY_ENV}')",
                    "message": _API_KEY_TWICE,
                    "fieldPath": ".podTemplate.env",
                    "reason": "FieldValueInvalid",
                },
            ]
        }
    )

    model: ModelSpec
    runtime: RuntimeSpec = Field(default_factory=RuntimeSpec)
    graphs: GraphsSpec = Field(default_factory=GraphsSpec)
    replicas: int = Field(1, ge=0, le=1000, description="Desired worker pods of the current revision; default 1.")
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    routing: RoutingSpec | None = None
    pod_template: PodTemplateOverrides = Field(default_factory=PodTemplateOverrides)

    @model_validator(mode="after")
    def _capture_sizes_fit_engine(self) -> GraphServingSpec:
        engine = self.runtime.engine
        try:
            if self.graphs.capture_sizes is not None:
                resolve_capture_sizes(self.graphs.capture_sizes, engine.max_num_seqs, what="runtime.engine.maxNumSeqs")
            if self.graphs.piecewise_capture_sizes is not None:
                resolve_capture_sizes(
                    self.graphs.piecewise_capture_sizes,
                    engine.max_num_batched_tokens,
                    what="runtime.engine.maxNumBatchedTokens",
                )
        except ValueError as exc:
            raise ValueError(f"graphs: {exc}") from exc
        if engine.speculative is not None and not self.graphs.mode.has_full:
            raise ValueError(f"{_SPECULATIVE_NEEDS_FULL}; graphs.mode is {self.graphs.mode.value}")
        if engine.speculative is not None and self.runtime.gpus > 1:
            raise ValueError(_SPECULATIVE_NOT_WITH_TP)
        if self.runtime.api_key_secret_ref is not None and any(
            e.get("name") == API_KEY_ENV for e in self.pod_template.env or []
        ):
            raise ValueError(_API_KEY_TWICE)
        return self


# -------------------------------------------------------------------------------------- status

ConditionType = Literal["Ready", "Progressing", "Degraded", "GraphsCaptured", "CanaryPassed", "Reconciled"]
"""The condition types of ``status.conditions``, in the order the operator writes them; each names a
state (the Kubernetes API conventions), docs/crd.md lists their reasons. ``Reconciled`` (formerly
``Warning``, which named no state): True when the operator carried the spec out as written, every child
accepted by the API server, no part of the spec fallen back to a default, the graph mode possible on the
resources asked for, and every serving worker's capacity counted as reported; False names what was not
(refused children first), with the first one as its reason."""
#: :data:`ConditionType`'s values, in order.
CONDITION_TYPES: tuple[str, ...] = get_args(ConditionType)
#: The ``Reconciled`` condition's type.
RECONCILED = "Reconciled"


class Condition(ApiModel):
    """A metav1.Condition."""

    type: str = Field(
        ...,
        max_length=316,
        pattern=r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])$",
        description="Condition type: Ready, Progressing, Degraded, GraphsCaptured, CanaryPassed or Reconciled.",
    )
    status: Literal["True", "False", "Unknown"] = Field(..., description="True, False or Unknown.")
    observed_generation: int | None = Field(None, ge=0, description="metadata.generation the condition was set from.")
    last_transition_time: dt.datetime = Field(..., description="When status last changed (RFC 3339).")
    reason: str = Field(
        ..., min_length=1, max_length=1024, pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$",
        description="CamelCase reason for the last transition.",
    )
    message: str = Field("", max_length=32768, description="Human-readable details of the transition.")


class RevisionStatus(ApiModel):
    """What one revision (one Deployment) serves."""

    hash: str = Field(..., max_length=63, description="Hash of model, runtime, podTemplate; names the Deployment.")
    model_revision: str = Field(..., max_length=64, description="spec.model.revision (sha256) it serves.")
    dtype: str | None = Field(None, max_length=16, description="Weight dtype it serves.")
    graph_config_hash: str | None = Field(None, max_length=64, description="config_hash of its workers' GraphConfig.")
    replicas: int = Field(0, ge=0, description="Desired replicas of this revision's Deployment.")
    ready_replicas: int = Field(0, ge=0, description="Pods whose graphs-ready gate is True.")
    degraded_replicas: int = Field(0, ge=0, description="Ready pods serving degraded.")
    coverage: float | None = Field(None, ge=0, le=1, description="Lowest coverage among reporting pods.")
    graph_memory_bytes: int | None = Field(None, ge=0, description="Largest per-pod graph memory (actual).")
    capture_seconds_p50: float | None = Field(None, ge=0, description="Median graph capture time of its pods (s).")
    capture_seconds_max: float | None = Field(None, ge=0, description="Longest graph capture time of its pods (s).")
    effective_capacity_tokens_per_second: float = Field(0.0, ge=0, description="Measured capacity of its live pods (tokens/s).")
    traffic_weight: int = Field(0, ge=0, le=100, description="Percent of traffic routed here.")
    canary_failures: int = Field(0, ge=0, description="Live pods whose graph canary failed.")


RolloutPhase = Literal["Idle", "Progressing", "Paused", "Complete", "DeadlineExceeded", "RolledBack"]


class RolloutStatus(ApiModel):
    """The rollout state machine's state: enough for a restarted operator to resume."""

    phase: RolloutPhase = Field("Idle", description="State of the rollout state machine; default Idle.")
    target_revision: str | None = Field(None, max_length=63, description="Revision being rolled out.")
    previous_revision: str | None = Field(None, max_length=63, description="Serving before this rollout.")
    baseline_capacity_tokens_per_second: float = Field(
        0.0, ge=0, description="Capacity measured when the rollout started; the floor is a fraction of it."
    )
    baseline_replicas: int = Field(
        0,
        ge=0,
        description="Ready pods the baseline was measured on. While spec.replicas is lower, the floor "
        "shrinks in proportion (the capacity of spec.replicas such pods); 0: unknown, never shrinks.",
    )
    started_at: dt.datetime | None = Field(None, description="When the rollout started (RFC 3339).")
    last_progress_at: dt.datetime | None = Field(None, description="When the rollout last advanced (RFC 3339).")
    progress_marker: str | None = Field(None, max_length=256, description="Changes whenever the rollout advances.")
    failed_revision: str | None = Field(
        None, max_length=63, description="Revision rolled back; not retried until its graph config changes."
    )
    failed_graph_config_hash: str | None = Field(
        None,
        max_length=64,
        description="Graph config (hash) the failed revision's canaries failed under; a spec with another "
        "graph config (canary thresholds, capture sizes, modes) retries the revision.",
    )
    message: str = Field("", max_length=1024, description="Human-readable state of the rollout.")


class Failure(ApiModel):
    """The last failure the operator saw."""

    reason: str = Field(..., max_length=256, description="CamelCase reason, as in its Warning event.")
    message: str = Field("", max_length=4096, description="Human-readable details.")
    revision: str | None = Field(None, max_length=63, description="Revision it concerns, if one.")
    time: dt.datetime = Field(..., description="When it was seen (RFC 3339).")


class GraphServingStatus(ApiModel):
    """Observed state of a GraphServing (written only by the operator)."""

    observed_generation: int | None = Field(None, ge=0, description="metadata.generation this status reflects.")
    replicas: int = Field(0, ge=0, description="Pods of all revisions (scale subresource).")
    ready_replicas: int = Field(0, ge=0, description="Pods of all revisions whose graphs-ready gate is True.")
    degraded_replicas: int = Field(0, ge=0, description="Ready pods serving degraded (eagerly).")
    updated_replicas: int = Field(0, ge=0, description="Ready pods of the current spec's revision.")
    selector: str = Field("", max_length=1024, description="Label selector of all worker pods (scale subresource).")
    ready: str = Field("0/0", max_length=32, description="ready/desired, for kubectl get.")
    url: str | None = Field(
        None, max_length=512,
        description="OpenAI API base URL inside the cluster, http://<service>.<namespace>.svc:<port>/v1 (the "
        "stable Service over every revision); unset until that Service is applied.",
    )
    address: str | None = Field(
        None, max_length=320,
        description="host:port of that Service (its cluster DNS name and port), for clients that take no URL.",
    )
    current_revision: str | None = Field(None, max_length=63, description="Revision of the current spec.")
    coverage: str | None = Field(None, max_length=16, description="Lowest coverage of the current revision, e.g. 100%.")
    graph_memory: str | None = Field(None, max_length=16, description="Graph memory per pod, e.g. 412Mi.")
    capacity: str | None = Field(None, max_length=32, description="Effective capacity, e.g. 1520 tok/s.")
    effective_capacity_tokens_per_second: float = Field(0.0, ge=0, description="Measured capacity of all live pods (tokens/s).")
    capture_sizes: list[int] | None = Field(None, max_length=MAX_CAPTURE_SIZES, description="Resolved (planner) list.")
    conditions: list[Condition] = Field(
        default_factory=list, max_length=16,
        description="Latest observations, one per type (a list-map keyed by type: server-side apply merges "
        "them by type).",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    revisions: list[RevisionStatus] = Field(
        default_factory=list, max_length=16, description="One per revision, the current spec's first."
    )
    rollout: RolloutStatus = Field(default_factory=RolloutStatus)
    last_failure: Failure | None = None

    @field_validator("conditions")
    @classmethod
    def _one_condition_per_type(cls, value: list[Condition]) -> list[Condition]:
        types = [c.type for c in value]
        repeated = sorted({t for t in types if types.count(t) > 1})
        if repeated:
            raise ValueError(f"conditions: type {repeated} appears more than once (a list-map keyed by type)")
        return value


class ObjectMeta(BaseModel):
    """The subset of metadata the operator reads."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    name: str = Field(..., max_length=MAX_NAME_LENGTH)
    namespace: str | None = None
    uid: str | None = None
    generation: int | None = None


class GraphServing(BaseModel):
    """A whole GraphServing object as read from the API."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    api_version: str = Field(API_VERSION, alias="apiVersion")
    kind: Literal["GraphServing"] = KIND
    metadata: ObjectMeta
    spec: GraphServingSpec
    status: GraphServingStatus | None = None

    @field_validator("status", mode="wrap")
    @classmethod
    def _status_or_none(cls, value: Any, handler: Any) -> GraphServingStatus | None:
        # A status this version cannot read (another operator version wrote it) is rebuilt from
        # observation rather than blocking the reconcile; the spec is never treated this way.
        try:
            return handler(value)
        except ValueError:
            return None


PRINTER_COLUMNS: list[dict[str, Any]] = [
    {"name": "Ready", "type": "string", "jsonPath": ".status.ready", "description": "Graphs-ready pods / desired."},
    {"name": "Revision", "type": "string", "jsonPath": ".status.currentRevision"},
    {"name": "Coverage", "type": "string", "jsonPath": ".status.coverage"},
    {"name": "GraphMem", "type": "string", "jsonPath": ".status.graphMemory"},
    {"name": "Capacity", "type": "string", "jsonPath": ".status.capacity"},
    {"name": "Degraded", "type": "integer", "jsonPath": ".status.degradedReplicas"},
    {"name": "URL", "type": "string", "jsonPath": ".status.url", "description": "OpenAI API base URL in the cluster."},
    {"name": "Rollout", "type": "string", "jsonPath": ".status.rollout.phase", "priority": 1},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]
