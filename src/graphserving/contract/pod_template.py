"""``spec.podTemplate`` of the GraphServing API: what users add to the worker Pods.

Kubernetes core types are passed through verbatim as open objects
(``x-kubernetes-preserve-unknown-fields``); the API server validates them when the operator applies
the Deployment, and the operator reports that failure. Extra containers are typed just enough (a
``name``, the list keyed by it) for the API server to reject a duplicate or a clash with the worker
container when the GraphServing is written. ``securityContext`` and ``containerSecurityContext``
are merged over the operator's restricted defaults (``graphserving.operator.children``), key by
key, the user's keys winning.

A module of its own (re-exported by :mod:`graphserving.contract.graphserving_types`) so that the
API module stays within the size limit of docs/architecture.md; both build on
:mod:`graphserving.contract.api_base`.
"""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic.alias_generators import to_camel

from graphserving.contract.api_base import ApiModel as _Model
from graphserving.contract.api_base import open_list as _open_list
from graphserving.contract.api_base import open_object as _open_object

#: The operator's container in every worker Pod; ``podTemplate`` containers must be named otherwise.
WORKER_CONTAINER = "worker"
#: RFC 1123 subdomain, as Kubernetes validates object names (RuntimeClass).
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"


def _named_items(max_name: int, name_description: str) -> dict:
    """The schema of an open core/v1 object that has (at least) a ``name``, typed just enough for
    list-map keys and CEL rules to read it."""
    return {
        "type": "object",
        "required": ["name"],
        "properties": {"name": {"type": "string", "minLength": 1, "maxLength": max_name,
                                "description": name_description}},
        "x-kubernetes-preserve-unknown-fields": True,
    }


def _container_list(description: str) -> Any:
    """Open core/v1 Container objects in a list-map keyed by ``name``: the API server rejects a
    duplicate name, and (CEL) the worker container's name."""
    return Field(
        None,
        description=description,
        max_length=16,
        json_schema_extra={
            "items": _named_items(63, "Container name, unique in the Pod."),
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["name"],
            "x-kubernetes-validations": [{
                "rule": f"self.all(c, c.name != '{WORKER_CONTAINER}')",
                "message": f"'{WORKER_CONTAINER}' is the operator's worker container: name the container otherwise",
            }],
        },
    )


def _env_list(description: str) -> Any:
    """Open core/v1 EnvVar objects, typed just enough (a ``name``) for CEL rules to read their names."""
    return Field(None, description=description, max_length=256,
                 json_schema_extra={"items": _named_items(256, "Name of the environment variable.")})


class LocalObjectReference(_Model):
    """An object of the same namespace, by name (core/v1 LocalObjectReference)."""

    name: str = Field(..., min_length=1, max_length=253, description="Name of the object (a Secret here).")


class PodTemplateOverrides(_Model):
    """Pass-through fields for the worker Pods (Kubernetes core types, validated on apply)."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [{
                "rule": "!has(self.containers) || !has(self.initContainers) || "
                "self.containers.all(c, !self.initContainers.exists(i, i.name == c.name))",
                "message": "containers and initContainers share a name: container names are unique in a Pod",
            }]
        }
    )

    node_selector: dict[str, str] | None = Field(None, max_length=64, description="Node labels the worker Pods must match.")
    tolerations: list[dict[str, Any]] | None = _open_list("core/v1 Toleration objects.")
    affinity: dict[str, Any] | None = _open_object("core/v1 Affinity.")
    env: list[dict[str, Any]] | None = _env_list("core/v1 EnvVar objects added to the worker.")
    volumes: list[dict[str, Any]] | None = _open_list("core/v1 Volume objects.")
    volume_mounts: list[dict[str, Any]] | None = _open_list("core/v1 VolumeMount objects of the worker.")
    labels: dict[str, str] | None = Field(None, max_length=64, description="Labels added to the worker Pods; the operator's own labels win.")
    annotations: dict[str, str] | None = Field(None, max_length=64, description="Annotations added to the worker Pods; the operator's own win.")
    priority_class_name: str | None = Field(None, max_length=253, description="PriorityClass of the worker Pods.")
    image_pull_secrets: list[LocalObjectReference] | None = Field(
        None, max_length=64, description="Secrets with registry credentials for the images of the worker Pods."
    )
    runtime_class_name: str | None = Field(
        None, min_length=1, max_length=253, pattern=DNS_SUBDOMAIN,
        description="RuntimeClass of the worker Pods (GPU clusters select the NVIDIA container runtime this way).",
    )
    topology_spread_constraints: list[dict[str, Any]] | None = _open_list(
        "core/v1 TopologySpreadConstraint objects of the worker Pods."
    )
    security_context: dict[str, Any] | None = _open_object(
        "core/v1 PodSecurityContext, merged key by key over the operator's restricted default "
        "(non-root 65532, RuntimeDefault seccomp); the keys given here win."
    )
    container_security_context: dict[str, Any] | None = _open_object(
        "core/v1 SecurityContext of the worker container, merged key by key over the operator's restricted "
        "default (no privilege escalation, all capabilities dropped, read-only root filesystem); the keys "
        "given here win."
    )
    containers: list[dict[str, Any]] | None = _container_list(
        "core/v1 Container objects run beside the worker container (sidecars), passed through as given: "
        "in a namespace enforcing the restricted Pod Security Standard they need their own securityContext."
    )
    init_containers: list[dict[str, Any]] | None = _container_list(
        "core/v1 Container objects run before the worker container (with restartPolicy Always: native "
        "sidecars), passed through as given."
    )

    @field_validator("containers", "init_containers")
    @classmethod
    def _containers_are_named(cls, value: list[dict[str, Any]] | None, info: ValidationInfo) -> list[dict[str, Any]] | None:
        field = to_camel(info.field_name or "")
        seen: set[str] = set()
        for i, container in enumerate(value or []):
            name = container.get("name")
            if not isinstance(name, str) or not name:
                raise ValueError(f"{field}[{i}].name: a container needs a name, got {name!r}")
            if name == WORKER_CONTAINER:
                raise ValueError(f"{field}[{i}].name: {name!r} is the operator's worker container; name it otherwise")
            if name in seen:
                raise ValueError(f"{field}[{i}].name: {name!r} is used twice; container names are unique in a Pod")
            seen.add(name)
        return value

    @model_validator(mode="after")
    def _container_names_are_unique_in_the_pod(self) -> PodTemplateOverrides:
        shared = {c["name"] for c in self.containers or []} & {c["name"] for c in self.init_containers or []}
        if shared:
            raise ValueError(
                f"containers and initContainers both name {sorted(shared)}: container names are unique in a Pod"
            )
        return self
