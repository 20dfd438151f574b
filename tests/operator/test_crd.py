"""The CRD is generated from the pydantic API models and checked in; it is a structural schema."""

from __future__ import annotations

from pathlib import Path

import yaml

from graphserving.contract import graphserving_types as api
from graphserving.operator import crd

REPO = Path(__file__).resolve().parents[2]


def _walk(node, path="$"):
    yield path, node
    if isinstance(node, dict):
        for key, value in node.get("properties", {}).items():
            yield from _walk(value, f"{path}.{key}")
        if "items" in node:
            yield from _walk(node["items"], f"{path}[]")
        if isinstance(node.get("additionalProperties"), dict):
            yield from _walk(node["additionalProperties"], f"{path}{{}}")


def _schema():
    return crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def test_checked_in_crd_matches_the_models():
    checked_in = (REPO / crd.CRD_PATH).read_text()
    assert checked_in == crd.render(), (
        f"{crd.CRD_PATH} drifted from graphserving_types; regenerate with "
        f"`graphserving operator crd > {crd.CRD_PATH}`"
    )


def test_every_schema_node_has_a_type_or_preserves_unknown_fields():
    for path, node in _walk(_schema()):
        assert "type" in node or node.get("x-kubernetes-preserve-unknown-fields"), path


def test_schema_has_no_constructs_that_structural_schemas_forbid():
    for path, node in _walk(_schema()):
        assert node.get("additionalProperties") is not False, path
        assert not {"anyOf", "oneOf", "allOf", "$ref", "const", "title", "nullable"} & set(node), path
        if "exclusiveMinimum" in node:
            assert node["exclusiveMinimum"] is True and "minimum" in node, path


def test_nested_objects_default_to_their_models_defaults():
    spec = _schema()["properties"]["spec"]["properties"]
    assert spec["runtime"]["default"]["engine"]["maxNumSeqs"] == 64
    assert spec["rollout"]["default"] == {"maxSurge": 1, "minAvailableCapacity": 1.0, "progressDeadlineSeconds": 1800,
                                          "paused": False, "autoRollback": True}
    assert spec["runtime"]["properties"]["engine"]["properties"]["maxNumSeqs"]["default"] == 64
    assert spec["graphs"]["properties"]["mode"]["default"] == "FULL_AND_PIECEWISE"


def test_capture_sizes_carry_set_semantics_and_an_ordering_rule():
    sizes = _schema()["properties"]["spec"]["properties"]["graphs"]["properties"]["captureSizes"]
    assert sizes["x-kubernetes-list-type"] == "set"
    assert sizes["items"] == {"type": "integer", "minimum": 1, "maximum": 1 << 20}
    assert [r["rule"] for r in sizes["x-kubernetes-validations"]] == ["self.isSorted()"]


def test_spec_has_cel_rules_bounding_capture_sizes_by_the_engine_maxima():
    rules = _schema()["properties"]["spec"]["x-kubernetes-validations"]
    assert {r["fieldPath"] for r in rules} >= {".graphs.captureSizes", ".graphs.piecewiseCaptureSizes"}
    assert any("self.runtime.engine.maxNumSeqs" in r["rule"] for r in rules)


def test_subresources_names_and_printer_columns():
    doc = crd.crd()
    version = doc["spec"]["versions"][0]
    assert doc["metadata"]["name"] == "graphservings.graphserving.io"
    assert doc["spec"]["names"]["shortNames"] == ["gs"]
    assert "graphserving" in doc["spec"]["names"]["categories"]
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    assert version["subresources"]["status"] == {}
    names = [c["name"] for c in version["additionalPrinterColumns"]]
    assert names[:6] == ["Ready", "Revision", "Coverage", "GraphMem", "Capacity", "Degraded"]
    assert names[-1] == "Age"


def test_conditions_are_a_list_map_keyed_by_type():
    conditions = _schema()["properties"]["status"]["properties"]["conditions"]
    assert (conditions["x-kubernetes-list-type"], conditions["x-kubernetes-list-map-keys"]) == ("map", ["type"])
    assert "type" in conditions["items"]["required"]


def test_every_list_of_conditions_in_the_schema_is_a_list_map():
    lists = [path for path, node in _walk(_schema()) if path.endswith(".conditions")]
    assert lists == ["$.status.conditions"]


def test_condition_types_name_states():
    assert api.CONDITION_TYPES == ("Ready", "Progressing", "Degraded", "GraphsCaptured", "CanaryPassed", "Reconciled")
    description = _schema()["properties"]["status"]["properties"]["conditions"]["items"]["properties"]["type"]
    assert "Warning" not in description["description"]


def test_the_url_printer_column_shows_status_url_by_default():
    columns = {c["name"]: c for c in crd.crd()["spec"]["versions"][0]["additionalPrinterColumns"]}
    assert columns["URL"]["jsonPath"] == ".status.url" and "priority" not in columns["URL"]
    status = _schema()["properties"]["status"]["properties"]
    assert status["url"]["type"] == status["address"]["type"] == "string"


def test_rendered_yaml_parses_back_to_the_same_object():
    assert yaml.safe_load(crd.render()) == crd.crd()
