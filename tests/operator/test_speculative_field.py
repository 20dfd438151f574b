"""``spec.runtime.engine.speculative`` (``ngram:K``, K in 1..8; unset: off): a string in the CRD schema
with a pattern, a CEL rule refusing it under a graph mode without FULL graphs (both naming the
field), rendered into the worker's configuration (``engine.speculative``, which its
``--speculative`` flag also sets, runtime/worker.py) only when set."""

from __future__ import annotations

import json

import pydantic
import pytest
from op_helpers import rendered_engine, spec_dict

from graphserving.contract import graphserving_types as api
from graphserving.operator import crd, naming

ENGINE = {"maxNumSeqs": 8, "maxNumBatchedTokens": 256}


def _gs(engine: dict, graphs: dict | None = None) -> api.GraphServing:
    spec = spec_dict(runtime={"engine": engine})
    if graphs:
        spec["graphs"] = {**spec.get("graphs", {}), **graphs}
    return api.GraphServing.model_validate({"metadata": {"name": "smol", "namespace": "ns", "uid": "u-1", "generation": 1},
                                            "spec": spec})


def test_the_crd_schema_has_an_optional_string_speculative_with_the_ngram_pattern():
    engine = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][
        "runtime"]["properties"]["engine"]["properties"]
    assert engine["speculative"]["type"] == "string" and "default" not in engine["speculative"]
    assert engine["speculative"]["pattern"] == "^ngram:[1-8]$" and "Unset: off" in engine["speculative"]["description"]


def test_the_worker_gets_speculative_only_when_the_spec_sets_it():
    assert "speculative" not in rendered_engine(_gs(ENGINE))
    assert rendered_engine(_gs({**ENGINE, "speculative": "ngram:4"}))["speculative"] == "ngram:4"


def test_unset_it_leaves_the_revision_as_before_and_setting_it_is_a_new_revision():
    assert "speculative" not in _gs(ENGINE).spec.runtime.to_api()["engine"]
    base = naming.revision_hash(_gs(ENGINE).spec)
    assert naming.revision_hash(_gs({**ENGINE, "speculative": "ngram:2"}).spec) != base


def test_the_model_refuses_a_mode_without_full_graphs_naming_the_field():
    with pytest.raises(pydantic.ValidationError, match="runtime.engine.speculative needs a graphs.mode that captures "
                                                       "FULL graphs.*graphs.mode is PIECEWISE"):
        _gs({**ENGINE, "speculative": "ngram:2"}, {"mode": "PIECEWISE"})


@pytest.mark.cluster
def test_the_api_server_refuses_a_bad_value_and_a_mode_without_full_graphs_naming_the_field(custom, namespace, tmp_path):
    from kubernetes.client.rest import ApiException
    from op_cluster import create_gs, get_gs, standin_spec

    spec = standin_spec(tmp_path)
    for value in ("ngram:9", "ngram:0", "eagle:2"):
        spec["runtime"]["engine"] = {**ENGINE, "speculative": value}
        with pytest.raises(ApiException) as info:
            create_gs(custom, namespace, "bad-speculative", spec)
        message = json.loads(info.value.body)["message"]
        assert info.value.status == 422
        assert "spec.runtime.engine.speculative: Invalid value" in message and "^ngram:[1-8]$" in message
    spec["runtime"]["engine"] = {**ENGINE, "speculative": "ngram:3"}
    with pytest.raises(ApiException) as info:
        create_gs(custom, namespace, "spec-piecewise", {**spec, "graphs": {**spec.get("graphs", {}), "mode": "PIECEWISE"}})
    message = json.loads(info.value.body)["message"]
    assert info.value.status == 422
    assert "spec.runtime.engine.speculative: Invalid value" in message
    assert "runtime.engine.speculative needs a graphs.mode that captures FULL graphs" in message
    create_gs(custom, namespace, "speculative-on", spec)
    assert get_gs(custom, namespace, "speculative-on")["spec"]["runtime"]["engine"]["speculative"] == "ngram:3"
