"""Every field of the GraphServing CRD has a ``kubectl explain`` description.

``kubectl explain graphserving.spec.<field>`` prints the schema's ``description``; the descriptions
come from the pydantic models (``Field(description=...)``, or the class docstring of an object
field) through :mod:`graphserving.operator.crd`.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from graphserving.operator import crd

REPO = Path(__file__).resolve().parents[2]
#: The API server rejects a CRD whose ``metadata`` schema holds more than ``type`` (ObjectMeta is
#: implicit; kubectl explain shows its built-in documentation).
IMPLICIT = {".metadata"}


def _undocumented(node: dict, path: str) -> list[str]:
    """Field paths under ``node`` (its ``properties``, and its array items' ``properties``, at any
    depth) whose ``description`` is missing or blank. An open pass-through object
    (``x-kubernetes-preserve-unknown-fields``) is a field of its own: only its own description counts."""
    missing = []
    for name, sub in node.get("properties", {}).items():
        sub_path = f"{path}.{name}"
        if sub_path not in IMPLICIT and not str(sub.get("description", "")).strip():
            missing.append(sub_path)
        missing += _undocumented(sub, sub_path)
        items = sub.get("items")
        while isinstance(items, dict):
            missing += _undocumented(items, f"{sub_path}[]")
            items = items.get("items")
    return missing


def _checked_in_schema() -> dict:
    document = yaml.safe_load((REPO / crd.CRD_PATH).read_text())
    return document["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def test_every_crd_field_has_a_description():
    missing = _undocumented(_checked_in_schema(), "")
    assert missing == [], f"{len(missing)} CRD fields have no description (kubectl explain): {missing}"


def test_the_walk_reaches_nested_objects_and_array_items():
    schema = {
        "properties": {
            "spec": {
                "description": "d",
                "properties": {
                    "a": {"type": "integer"},
                    "list": {"description": "d", "items": {"properties": {"b": {"description": " "}}}},
                },
            },
            "open": {"description": "d", "x-kubernetes-preserve-unknown-fields": True},
        }
    }
    assert _undocumented(schema, "") == [".spec.a", ".spec.list[].b"]


def test_a_field_without_description_fails():
    schema = _checked_in_schema()
    del schema["properties"]["spec"]["properties"]["runtime"]["properties"]["engine"]["description"]
    assert _undocumented(schema, "") == [".spec.runtime.engine"]
