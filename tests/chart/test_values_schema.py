"""values.schema.json and values.yaml describe the same values, and helm enforces the schema."""

from __future__ import annotations

import json

import jsonschema
import pytest
import yaml
from chart_helpers import CHART, KUBE_VERSION, run_helm

SCHEMA = json.loads((CHART / "values.schema.json").read_text())
VALUES = yaml.safe_load((CHART / "values.yaml").read_text())


def _paths(node, prefix=""):
    """Dotted paths of every key in a values tree (objects only, not list items)."""
    for key, value in node.items():
        path = f"{prefix}{key}"
        yield path
        if isinstance(value, dict) and value:
            yield from _paths(value, path + ".")


def _schema_paths(node, prefix=""):
    """Dotted paths the schema declares with a closed object (additionalProperties false)."""
    for key, sub in (node.get("properties") or {}).items():
        path = f"{prefix}{key}"
        yield path, sub
        if sub.get("type") == "object" and sub.get("additionalProperties") is False:
            yield from _schema_paths(sub, path + ".")


def test_values_yaml_validates_against_the_schema():
    jsonschema.Draft7Validator.check_schema(SCHEMA)
    jsonschema.validate(VALUES, SCHEMA, cls=jsonschema.Draft7Validator)


def test_every_value_is_declared_and_every_declared_value_has_a_default():
    declared = dict(_schema_paths(SCHEMA))
    closed_parents = {""} | {p for p, s in declared.items() if s.get("additionalProperties") is False}
    values = set(_paths(VALUES))
    undeclared = {p for p in values if p.rpartition(".")[0] in closed_parents and p not in declared}
    assert not undeclared, f"values.yaml keys missing from values.schema.json: {sorted(undeclared)}"
    without_default = set(declared) - values - {"global"}
    assert not without_default, f"schema keys without a default in values.yaml: {sorted(without_default)}"


@pytest.mark.parametrize("setting, field", [
    ("operator.replicaCount=two", "/operator/replicaCount"),
    ("test.resolve=magic", "/test/resolve"),
    ("operator.logLevel=loud", "/operator/logLevel"),
    ("operator.replicas=3", "replicas"),
])
def test_helm_rejects_a_value_the_schema_forbids_naming_the_field(setting, field):
    proc = run_helm("template", "x", str(CHART), "--kube-version", KUBE_VERSION, "--set", setting, check=False)
    assert proc.returncode != 0
    assert field in proc.stderr


def test_helm_refuses_several_operator_replicas_without_leader_election():
    proc = run_helm("template", "x", str(CHART), "--kube-version", KUBE_VERSION,
                    "--set", "operator.leaderElection.enabled=false", check=False)
    assert proc.returncode != 0
    assert "operator.leaderElection.enabled=false with operator.replicaCount=2" in proc.stderr
    single = run_helm("template", "x", str(CHART), "--kube-version", KUBE_VERSION,
                      "--set", "operator.leaderElection.enabled=false", "--set", "operator.replicaCount=1")
    assert "--no-leader-election" in single.stdout
