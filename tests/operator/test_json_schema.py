"""The published JSON Schema of GraphServing manifests (``manifests/schema/graphserving_v1alpha1.json``,
for editors and kubeconform) accepts the shipped samples and names the field of an invalid one."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import jsonschema
import pytest
import yaml

from graphserving.operator import crd

REPO = Path(__file__).resolve().parents[2]
SAMPLES = sorted((REPO / "manifests" / "samples").glob("*.yaml"))


def _validator() -> jsonschema.Draft7Validator:
    return jsonschema.Draft7Validator(json.loads((REPO / crd.SCHEMA_PATH).read_text()))


def _errors(document: dict) -> list[tuple[str, str]]:
    return sorted((e.json_path, e.message) for e in _validator().iter_errors(document))


def _sample() -> dict:
    return yaml.safe_load((REPO / "manifests/samples/smollm2-cpu.yaml").read_text())


def test_the_schema_is_valid_draft_07():
    schema = json.loads((REPO / crd.SCHEMA_PATH).read_text())
    assert schema["$schema"] == "http://json-schema.org/draft-07/schema#"
    jsonschema.Draft7Validator.check_schema(schema)


def test_there_are_samples():
    assert [p.name for p in SAMPLES] == ["gpu.yaml", "rollout.yaml", "smollm2-cpu.yaml"]


@pytest.mark.parametrize("path", SAMPLES, ids=[p.stem for p in SAMPLES])
def test_every_shipped_sample_validates(path):
    for document in yaml.safe_load_all(path.read_text()):
        assert _errors(document) == []


@pytest.mark.parametrize("path", SAMPLES, ids=[p.stem for p in SAMPLES])
def test_every_sample_names_the_schema_for_yaml_language_servers(path):
    first = path.read_text().splitlines()[0]
    assert first == "# yaml-language-server: $schema=../schema/graphserving_v1alpha1.json"
    assert (path.parent / first.split("=", 1)[1]).resolve() == (REPO / crd.SCHEMA_PATH).resolve()


def test_a_misspelt_field_is_refused_naming_it():
    bad = _sample()
    bad["spec"]["runtime"]["engine"]["maxNumSeq"] = 8
    assert _errors(bad) == [("$.spec.runtime.engine", "Additional properties are not allowed ('maxNumSeq' was unexpected)")]


def test_a_value_above_its_maximum_is_refused_naming_the_field():
    bad = _sample()
    bad["spec"]["runtime"]["engine"]["maxNumSeqs"] = 100000
    assert _errors(bad) == [("$.spec.runtime.engine.maxNumSeqs", "100000 is greater than the maximum of 4096")]


def test_an_unknown_tool_call_parser_is_refused_naming_the_field():
    bad = _sample()
    bad["spec"]["runtime"]["engine"]["toolCallParser"] = "mistral"
    assert _errors(bad) == [("$.spec.runtime.engine.toolCallParser",
                             "'mistral' is not one of ['auto', 'hermes', 'llama3_json', 'none']")]


def test_open_pass_through_objects_stay_open():
    good = _sample()
    good["spec"]["podTemplate"] = {"containers": [{"name": "side", "image": "x", "anything": {"a": 1}}],
                                   "affinity": {"nodeAffinity": {}}}
    assert _errors(good) == []


def test_a_duplicate_in_a_set_list_and_a_strict_bound_are_checked():
    bad = _sample()
    bad["spec"]["graphs"]["captureSizes"] = [1, 1]
    bad["spec"]["runtime"]["engine"]["kvCacheMemoryFraction"] = 0
    assert _errors(bad) == [
        ("$.spec.graphs.captureSizes", "[1, 1] has non-unique elements"),
        ("$.spec.runtime.engine.kvCacheMemoryFraction", "0 is less than or equal to the minimum of 0"),
    ]


def test_api_version_and_kind_are_pinned():
    bad = copy.deepcopy(_sample())
    bad["apiVersion"] = "graphserving.io/v1"
    assert _errors(bad) == [("$.apiVersion", "'graphserving.io/v1' is not one of ['graphserving.io/v1alpha1']")]
