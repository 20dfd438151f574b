"""``spec.runtime`` of the GraphServing API: how the worker process runs.

The image, its command and port, GPUs and resources, the scheduler and KV-cache limits (the
worker's :class:`~graphserving.contract.worker_config.EngineLimits`, camelCase), the tool-call
parser and the Secret holding the API key. The operator renders them into the worker container
(``graphserving.operator.children``): the limits into the ``GRAPHSERVING_WORKER_CONFIG`` JSON, the
tool-call parser into the argument ``--tool-call-parser``, the key into the environment variable
``GRAPHSERVING_API_KEY`` from the Secret (runtime/worker.py reads both).

A module of its own (re-exported by :mod:`graphserving.contract.graphserving_types`) so that the
API module stays within the size limit of docs/architecture.md; it builds on
:mod:`graphserving.contract.api_base`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from graphserving.contract import worker_config as wc
from graphserving.contract.api_base import CAMEL, ApiModel
from graphserving.contract.pod_template import DNS_SUBDOMAIN

#: Values of the worker's ``--tool-call-parser`` flag (runtime/worker.py): ``auto`` picks the parser
#: from the model's chat template, ``hermes`` and ``llama3_json`` name a model family's format,
#: ``none`` refuses requests with ``tools``.
ToolCallParser = Literal["auto", "hermes", "llama3_json", "none"]
#: A Secret's data key, as Kubernetes validates it (``IsConfigMapKey``).
SECRET_KEY = r"^[-._a-zA-Z0-9]+$"
#: The environment variable the worker reads its API key from (runtime/worker.py ``API_KEY_ENV``).
API_KEY_ENV = "GRAPHSERVING_API_KEY"
#: The worker flag that selects its tool-call parser (runtime/worker.py).
TOOL_CALL_PARSER_FLAG = "--tool-call-parser"


class Engine(wc.EngineLimits):
    """Scheduler and KV-cache limits (the worker's :class:`EngineLimits`, camelCase), and the
    worker's tool-call parser."""

    model_config = ConfigDict(
        **CAMEL,
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "self.maxNumBatchedTokens >= self.maxNumSeqs",
                    "message": "maxNumBatchedTokens must be >= maxNumSeqs: a decode step of maxNumSeqs "
                    "requests needs one token row each",
                    "fieldPath": ".maxNumBatchedTokens",
                    "reason": "FieldValueInvalid",
                }
            ]
        },
    )

    tool_call_parser: ToolCallParser | None = Field(
        None,
        description="How the worker parses tool calls out of the model's output (its --tool-call-parser "
        "flag): auto (from the chat template), hermes, llama3_json, or none (requests with tools are "
        "refused). Unset: the worker's default, auto.",
    )

    def to_worker(self) -> wc.EngineLimits:
        """The worker's EngineLimits (the tool-call parser is a flag of its own: not among them)."""
        return wc.EngineLimits(**self.model_dump(by_alias=False, exclude={"tool_call_parser"}))


class ResourceRequirements(ApiModel):
    """Container resources (Kubernetes quantities as strings, e.g. ``"2"``, ``"8Gi"``)."""

    requests: dict[str, str] | None = Field(None, max_length=32, description="Resources reserved per worker container.")
    limits: dict[str, str] | None = Field(
        None, max_length=32, description="Most resources per worker container; nvidia.com/gpu is set from runtime.gpus."
    )


class SecretKeySelector(ApiModel):
    """One key of a Secret in the GraphServing's namespace (core/v1 SecretKeySelector)."""

    name: str = Field(
        ..., min_length=1, max_length=253, pattern=DNS_SUBDOMAIN,
        description="Name of the Secret (a DNS subdomain) in the GraphServing's namespace.",
    )
    key: str = Field(
        "api-key", min_length=1, max_length=253, pattern=SECRET_KEY,
        description="Key of the Secret's data holding the value; default api-key.",
    )


class RuntimeSpec(ApiModel):
    """How the worker process runs."""

    image: str = Field(
        "ghcr.io/graphserving/worker:0.1.0", min_length=1, max_length=1024, description="Worker container image."
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        "IfNotPresent", description="When the kubelet pulls the worker image; default IfNotPresent."
    )
    command: list[str] | None = Field(
        None,
        max_length=64,
        description="Entrypoint override; default ['graphserving-worker']. The configuration is "
        "always passed in the GRAPHSERVING_WORKER_CONFIG environment variable.",
    )
    port: int = Field(8000, ge=1, le=65535, description="Container port of the worker's HTTP server; default 8000.")
    gpus: int = Field(0, ge=0, le=16, description="nvidia.com/gpu per worker; 0: CPU worker; above 1: the "
                      "model is split over them, one tensor-parallel rank (process) per GPU.")
    resources: ResourceRequirements = Field(default_factory=ResourceRequirements)
    engine: Engine = Field(default_factory=Engine)
    api_key_secret_ref: SecretKeySelector | None = Field(
        None,
        description=f"Secret key holding the API key clients must send (Authorization: Bearer <key>); the "
        f"worker reads it from the environment variable {API_KEY_ENV}. The probes, /metrics and the worker "
        "report (GET /v1/graphs) stay open, so Kubernetes and Prometheus need no key. Unset: no key needed.",
    )
