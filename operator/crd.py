"""Generate the GraphServing CustomResourceDefinition from the pydantic API models.

The pydantic JSON schema (draft 2020-12) is rewritten into a Kubernetes *structural* OpenAPI v3
schema: ``$ref`` inlined, ``Optional`` unions collapsed (an unset field is omitted, never null),
``const`` turned into ``enum``, numeric ``exclusiveMinimum`` into the boolean OpenAPI 3.0 form,
``additionalProperties: false`` dropped (structural schemas prune unknown fields; ``kubectl``'s
default strict field validation turns them into errors), open objects marked
``x-kubernetes-preserve-unknown-fields``, and nested objects with defaults given their full default
object (the API server checks CEL rules against a default as written).

The same schema is published as a JSON Schema (draft-07) of a GraphServing manifest for editors and
kubeconform (:func:`json_schema`, ``manifests/schema/graphserving_v1alpha1.json``, kubeconform's
``{kind}_{version}.json`` layout; docs/crd.md shows how to use it).

Regenerate the checked-in files (with the chart's copy) with::

    python charts/sync_generated.py

(``graphserving operator crd [--json-schema]`` prints either one); ``tests/operator/test_crd.py``
and ``tests/chart/test_generated_copies.py`` fail when they drift.
"""

from __future__ import annotations

import copy
import json
import sys
from typing import Any

import yaml
from pydantic import BaseModel
from pydantic.json_schema import GenerateJsonSchema
from pydantic_core import core_schema

from graphserving.contract import graphserving_types as api

CRD_NAME = f"{api.PLURAL}.{api.GROUP}"
CRD_PATH = "manifests/crd/graphserving.io_graphservings.yaml"
#: kubeconform's layout: ``{{ .ResourceKind }}_{{ .ResourceAPIVersion }}.json``, both lower case.
SCHEMA_PATH = f"manifests/schema/{api.KIND.lower()}_{api.VERSION}.json"
JSON_SCHEMA_DRAFT = "http://json-schema.org/draft-07/schema#"

_DROP = {"title", "$defs", "additionalProperties"}
#: The descriptions Kubernetes gives every object's apiVersion and kind (metav1.TypeMeta).
_API_VERSION_DOC = f"Versioned schema of this representation of an object: {api.API_VERSION}."
_KIND_DOC = f"REST resource this object represents: {api.KIND}."


class SchemaUnsupported(ValueError):
    """A pydantic construct that has no structural-schema equivalent."""


class _KubeJsonSchema(GenerateJsonSchema):
    """Pydantic's generator, plus the full default object for fields with a model default factory."""

    def default_schema(self, schema: core_schema.WithDefaultSchema) -> dict[str, Any]:
        json_schema = super().default_schema(schema)
        factory = schema.get("default_factory")
        if factory is not None and not schema.get("default_factory_takes_data"):
            value = factory()
            if isinstance(value, BaseModel):
                # The full default object, not {}: the API server checks CEL rules against a
                # default as written, before nested defaults would fill it.
                json_schema = dict(json_schema)
                json_schema["default"] = value.model_dump(mode="json", by_alias=True, exclude_none=True)
            elif value == [] or value == {}:
                json_schema = dict(json_schema)
                json_schema["default"] = value
        return json_schema


def _structural(node: Any, defs: dict[str, Any], path: str) -> Any:
    if not isinstance(node, dict):
        return node
    node = dict(node)
    if "$ref" in node:
        ref = node.pop("$ref").rsplit("/", 1)[-1]
        merged = copy.deepcopy(defs[ref])
        merged.update(node)  # field-level description/default/extra win over the model's
        node = merged
    if "anyOf" in node:
        options = [o for o in node.pop("anyOf") if o.get("type") != "null"]
        if len(options) != 1:
            raise SchemaUnsupported(f"{path}: unions other than Optional[X] are not structural: {options}")
        inner = options[0]
        if "$ref" in inner:
            inner = _structural(inner, defs, path)
        merged = dict(inner)
        merged.update({k: v for k, v in node.items() if k != "default" or v is not None})
        node = merged
        if "$ref" in node:
            return _structural(node, defs, path)
    if node.get("default", "absent") is None:
        del node["default"]
    if "const" in node:
        node["enum"] = [node.pop("const")]
        node.setdefault("type", "string" if isinstance(node["enum"][0], str) else "integer")
    if isinstance(node.get("exclusiveMinimum"), (int, float)) and not isinstance(node["exclusiveMinimum"], bool):
        node["minimum"] = node["exclusiveMinimum"]
        node["exclusiveMinimum"] = True
    if isinstance(node.get("exclusiveMaximum"), (int, float)) and not isinstance(node["exclusiveMaximum"], bool):
        node["maximum"] = node["exclusiveMaximum"]
        node["exclusiveMaximum"] = True
    if "enum" in node and "type" not in node:
        node["type"] = "string"
    additional = node.get("additionalProperties")
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROP:
            continue
        if key == "properties":
            out[key] = {name: _structural(sub, defs, f"{path}.{name}") for name, sub in value.items()}
        elif key == "items":
            out[key] = _structural(value, defs, f"{path}[]")
        else:
            out[key] = value
    if isinstance(additional, dict) and additional:
        out["additionalProperties"] = _structural(additional, defs, f"{path}{{}}")
    elif (additional is True or additional == {}) and "properties" not in node:
        out["x-kubernetes-preserve-unknown-fields"] = True
    if out.get("type") == "object" and "properties" not in out and "additionalProperties" not in out:
        out["x-kubernetes-preserve-unknown-fields"] = True
    if "type" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
        raise SchemaUnsupported(f"{path}: no type in {sorted(out)}")
    if out.get("type") == "array" and "items" not in out:
        raise SchemaUnsupported(f"{path}: array without items")
    return out


def structural_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The structural OpenAPI v3 schema of ``model`` (camelCase field names)."""
    schema = model.model_json_schema(by_alias=True, mode="validation", schema_generator=_KubeJsonSchema)
    defs = schema.get("$defs", {})
    return _structural(schema, defs, model.__name__)




def crd() -> dict[str, Any]:
    """The CustomResourceDefinition object (apiextensions.k8s.io/v1) as a dict."""
    spec_schema = structural_schema(api.GraphServingSpec)
    status_schema = structural_schema(api.GraphServingStatus)
    spec_schema["description"] = api.GraphServingSpec.__doc__.strip().splitlines()[0]
    status_schema["description"] = api.GraphServingStatus.__doc__.strip().splitlines()[0]
    root = {
        "type": "object",
        "description": "GraphServing serves an LLM from CUDA-graph decode workers.",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string", "description": _API_VERSION_DOC},
            "kind": {"type": "string", "description": _KIND_DOC},
            # The API server forbids anything but type here; kubectl explain shows ObjectMeta's own docs.
            "metadata": {"type": "object"},
            "spec": spec_schema,
            "status": status_schema,
        },
        "x-kubernetes-validations": [
            {
                "rule": f"size(self.metadata.name) <= {api.MAX_NAME_LENGTH}",
                "message": f"metadata.name must be at most {api.MAX_NAME_LENGTH} characters "
                "(<name>-<revision hash> names a Service)",
            }
        ],
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": CRD_NAME,
            "labels": {
                "app.kubernetes.io/name": "graphserving",
                "app.kubernetes.io/part-of": "graphserving",
                "app.kubernetes.io/component": "crd",
            },
        },
        "spec": {
            "group": api.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": api.KIND,
                "listKind": f"{api.KIND}List",
                "plural": api.PLURAL,
                "singular": api.SINGULAR,
                "shortNames": list(api.SHORT_NAMES),
                "categories": list(api.CATEGORIES),
            },
            "versions": [
                {
                    "name": api.VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": root},
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.replicas",
                            "statusReplicasPath": ".status.replicas",
                            "labelSelectorPath": ".status.selector",
                        },
                    },
                    "additionalPrinterColumns": list(api.PRINTER_COLUMNS),
                }
            ],
        },
    }


def _closed(node: Any) -> Any:
    """``node`` (a structural schema) as draft-07 JSON Schema: objects with ``properties`` closed
    (``additionalProperties: false``, what the API server's pruning and kubectl's strict field
    validation make of an unknown field) unless they preserve unknown fields, OpenAPI 3.0's boolean
    ``exclusiveMinimum``/``exclusiveMaximum`` as the bound itself, ``set`` lists ``uniqueItems``."""
    if not isinstance(node, dict):
        return node
    out = {k: _closed(v) if k in ("items", "additionalProperties") else v for k, v in node.items()}
    if "properties" in node:
        out["properties"] = {name: _closed(sub) for name, sub in node["properties"].items()}
        if not node.get("x-kubernetes-preserve-unknown-fields") and "additionalProperties" not in node:
            out["additionalProperties"] = False
    for bound, strict in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
        if out.get(strict) is True:
            out[strict] = out.pop(bound)
    if node.get("x-kubernetes-list-type") == "set":
        out["uniqueItems"] = True
    return out


def json_schema() -> dict[str, Any]:
    """The JSON Schema (draft-07) of a GraphServing manifest: the CRD's ``openAPIV3Schema`` through
    :func:`_closed`, with ``apiVersion`` and ``kind`` pinned and required. Editors (a YAML language
    server) and kubeconform validate against it offline; the API server's CEL rules
    (``x-kubernetes-validations``) stay in it as annotations that JSON Schema does not check."""
    root = _closed(crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
    root["properties"]["apiVersion"]["enum"] = [api.API_VERSION]
    root["properties"]["kind"]["enum"] = [api.KIND]
    root["required"] = ["apiVersion", "kind", "spec"]
    return {
        "$schema": JSON_SCHEMA_DRAFT,
        "$comment": "Generated by `graphserving operator crd --json-schema` from graphserving.contract."
        "graphserving_types (the CRD's generator); do not edit by hand.",
        "title": f"{api.KIND} ({api.API_VERSION})",
        **root,
    }


def render_json_schema() -> str:
    """The checked-in text of :func:`json_schema` (:data:`SCHEMA_PATH`)."""
    return json.dumps(json_schema(), indent=2) + "\n"


HEADER = (
    "# Generated by `graphserving operator crd` from graphserving.contract.graphserving_types.\n"
    "# Do not edit by hand: change the pydantic models and regenerate.\n"
)


def render() -> str:
    """The checked-in YAML text of the CRD."""
    return HEADER + yaml.safe_dump(crd(), sort_keys=False, width=100)


def main(argv: list[str] | None = None) -> int:
    """Print the CRD (YAML), or with ``--json-schema`` the manifests' JSON Schema."""
    args = sys.argv[1:] if argv is None else argv
    sys.stdout.write(render_json_schema() if "--json-schema" in args else render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
