"""``spec.runtime.engine.prefixCaching`` (unset: on): an optional boolean in the CRD schema, validated
by the API server, rendered into the worker's configuration (``engine.prefix_caching``, which its
``--no-prefix-caching`` flag also sets, runtime/worker.py) only when set, so that GraphServings
without it keep their worker configuration and revision across an operator upgrade."""

from __future__ import annotations

import json

import pytest
from op_helpers import rendered_engine, spec_dict

from graphserving.contract import graphserving_types as api
from graphserving.operator import crd, naming

ENGINE = {"maxNumSeqs": 8, "maxNumBatchedTokens": 256}


def _gs(engine: dict) -> api.GraphServing:
    return api.GraphServing.model_validate({"metadata": {"name": "smol", "namespace": "ns", "uid": "u-1", "generation": 1},
                                            "spec": spec_dict(runtime={"engine": engine})})


def test_the_crd_schema_has_an_optional_boolean_prefix_caching_documented_as_on_when_unset():
    engine = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][
        "runtime"]["properties"]["engine"]["properties"]
    assert engine["prefixCaching"]["type"] == "boolean" and "default" not in engine["prefixCaching"]
    assert "Unset: on" in engine["prefixCaching"]["description"]


def test_the_worker_gets_prefix_caching_only_when_the_spec_sets_it():
    assert "prefix_caching" not in rendered_engine(_gs(ENGINE))
    assert rendered_engine(_gs({**ENGINE, "prefixCaching": False}))["prefix_caching"] is False
    assert rendered_engine(_gs({**ENGINE, "prefixCaching": True}))["prefix_caching"] is True


def test_unset_it_leaves_the_revision_as_before_and_setting_it_is_a_new_revision():
    assert "prefixCaching" not in _gs(ENGINE).spec.runtime.to_api()["engine"]
    base = naming.revision_hash(_gs(ENGINE).spec)
    assert naming.revision_hash(_gs({**ENGINE, "prefixCaching": False}).spec) != base


@pytest.mark.cluster
def test_the_api_server_refuses_a_non_boolean_naming_the_field(custom, namespace, tmp_path):
    from kubernetes.client.rest import ApiException
    from op_cluster import create_gs, get_gs, standin_spec

    spec = standin_spec(tmp_path)
    spec["runtime"]["engine"] = {**ENGINE, "prefixCaching": "no"}
    with pytest.raises(ApiException) as info:
        create_gs(custom, namespace, "bad-prefix-caching", spec)
    message = json.loads(info.value.body)["message"]
    assert info.value.status == 422
    assert "spec.runtime.engine.prefixCaching: Invalid value" in message and "must be of type boolean" in message
    spec["runtime"]["engine"] = {**ENGINE, "prefixCaching": False}
    create_gs(custom, namespace, "caching-off", spec)
    assert get_gs(custom, namespace, "caching-off")["spec"]["runtime"]["engine"]["prefixCaching"] is False
