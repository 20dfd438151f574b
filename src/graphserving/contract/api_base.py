"""The base of the GraphServing API's objects (pure pydantic): camelCase JSON, unknown fields
rejected, and the open fields that pass Kubernetes core types through verbatim.

:mod:`graphserving.contract.graphserving_types` and :mod:`graphserving.contract.pod_template`
build on it.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

CAMEL = ConfigDict(
    alias_generator=to_camel,
    validate_by_name=True,
    validate_by_alias=True,
    serialize_by_alias=True,
    extra="forbid",
)
"""camelCase aliases (accepted and written), unknown fields rejected."""


class ApiModel(BaseModel):
    """Base of every API object: camelCase JSON, unknown fields rejected."""

    model_config = CAMEL

    def to_api(self) -> dict[str, Any]:
        """The JSON form (camelCase keys, unset optional fields omitted)."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


def open_object(description: str) -> Any:
    """A field holding one Kubernetes object the API server does not check here (validated when
    the operator applies what it builds): ``x-kubernetes-preserve-unknown-fields``."""
    return Field(None, description=description, json_schema_extra={"x-kubernetes-preserve-unknown-fields": True})


def open_list(description: str) -> Any:
    """A list of such objects, at most 256."""
    return Field(None, description=description, max_length=256,
                 json_schema_extra={"items": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}})
