"""``spec.runtime.apiKeySecretRef`` and ``spec.runtime.engine.toolCallParser``: what the worker
container gets from them (issue 18, items 7 and 1), and that unset they change nothing."""

from __future__ import annotations

import json
from typing import get_args

import pydantic
import pytest
from op_helpers import spec_dict
from reconcile_scenarios import World

from graphserving.contract import graphserving_types as api
from graphserving.contract.runtime_spec import API_KEY_ENV, ToolCallParser
from graphserving.operator import children, naming

ENGINE = {"maxNumSeqs": 8, "maxNumBatchedTokens": 256}


def _gs(**runtime) -> api.GraphServing:
    spec = spec_dict(runtime={"engine": ENGINE, **runtime})
    return api.GraphServing.model_validate({"metadata": {"name": "smol", "namespace": "ns", "uid": "u"}, "spec": spec})


def _container(gs: api.GraphServing) -> dict:
    dep = children.deployment(gs, naming.revision_hash(gs.spec), 1, gs.spec.graphs.to_worker())
    return dep["spec"]["template"]["spec"]["containers"][0]


def _error(**runtime) -> str:
    with pytest.raises(pydantic.ValidationError) as info:
        _gs(**runtime)
    return str(info.value)


def test_the_api_key_comes_from_the_secret_through_a_secret_key_ref():
    env = _container(_gs(apiKeySecretRef={"name": "smol-key", "key": "token"}))["env"]
    assert env[-1] == {"name": "GRAPHSERVING_API_KEY",
                       "valueFrom": {"secretKeyRef": {"name": "smol-key", "key": "token"}}}
    assert [e["name"] for e in env].count("GRAPHSERVING_API_KEY") == 1


def test_the_secret_key_defaults_to_api_key():
    env = _container(_gs(apiKeySecretRef={"name": "smol-key"}))["env"]
    assert env[-1]["valueFrom"]["secretKeyRef"] == {"name": "smol-key", "key": "api-key"}


def test_the_probes_stay_on_the_open_endpoints_with_an_api_key():
    container = _container(_gs(apiKeySecretRef={"name": "smol-key"}))
    assert [container[p]["httpGet"]["path"] for p in ("startupProbe", "livenessProbe", "readinessProbe")] == [
        "/healthz", "/healthz", "/readyz"]


def test_the_tool_call_parser_becomes_the_workers_flag():
    container = _container(_gs(engine={**ENGINE, "toolCallParser": "llama3_json"}))
    assert container["command"] == ["graphserving-worker"]
    assert container["args"] == ["--tool-call-parser", "llama3_json"]


def test_the_tool_call_parser_is_not_part_of_the_worker_config():
    env = {e["name"]: e for e in _container(_gs(engine={**ENGINE, "toolCallParser": "hermes"}))["env"]}
    config = json.loads(env["GRAPHSERVING_WORKER_CONFIG"]["value"])
    assert config["engine"] == {"max_num_seqs": 8, "max_num_batched_tokens": 256, "block_size": 16,
                                "kv_cache_memory_fraction": 0.85, "num_scheduler_steps": 8}


def test_unset_they_leave_the_container_and_the_revision_hash_material_as_before():
    gs = _gs()
    container = _container(gs)
    assert "args" not in container
    assert "GRAPHSERVING_API_KEY" not in [e["name"] for e in container["env"]]
    # The revision hash covers runtime.to_api(): without the new fields it is what it was, so an
    # operator upgrade rolls no running revision.
    assert gs.spec.runtime.to_api() == {
        "image": "ghcr.io/graphserving/worker:0.1.0", "imagePullPolicy": "IfNotPresent", "port": 8000, "gpus": 0,
        "resources": {}, "engine": {"maxNumSeqs": 8, "maxNumBatchedTokens": 256, "blockSize": 16,
                                    "kvCacheMemoryFraction": 0.85, "numSchedulerSteps": 8},
    }


def test_setting_either_is_a_new_revision():
    base = naming.revision_hash(_gs().spec)
    assert naming.revision_hash(_gs(apiKeySecretRef={"name": "k"}).spec) != base
    assert naming.revision_hash(_gs(engine={**ENGINE, "toolCallParser": "none"}).spec) != base


def test_the_crd_offers_exactly_the_workers_parsers_and_names_its_key_variable():
    worker = pytest.importorskip("graphserving.runtime.worker")
    assert get_args(ToolCallParser) == worker.TOOL_CALL_PARSERS
    assert API_KEY_ENV == worker.API_KEY_ENV


def test_an_unknown_tool_call_parser_is_refused_naming_the_field():
    message = _error(engine={**ENGINE, "toolCallParser": "mistral"})
    assert "runtime.engine.toolCallParser\n  Input should be 'auto', 'hermes', 'llama3_json' or 'none'" in message


def test_a_secret_name_that_is_no_dns_subdomain_is_refused_naming_the_field():
    assert "runtime.apiKeySecretRef.name\n  String should match pattern" in _error(apiKeySecretRef={"name": "Key_1"})


def test_a_secret_key_with_other_characters_is_refused_naming_the_field():
    message = _error(apiKeySecretRef={"name": "k", "key": "api key"})
    assert "runtime.apiKeySecretRef.key\n  String should match pattern '^[-._a-zA-Z0-9]+$'" in message


def test_the_api_key_set_twice_is_refused():
    with pytest.raises(pydantic.ValidationError) as info:
        api.GraphServingSpec.model_validate(spec_dict(
            runtime={"engine": ENGINE, "apiKeySecretRef": {"name": "k"}},
            podTemplate={"env": [{"name": "GRAPHSERVING_API_KEY", "value": "plain"}]}))
    assert ("podTemplate.env sets GRAPHSERVING_API_KEY and runtime.apiKeySecretRef names the Secret holding the "
            "API key: set only one of them") in str(info.value)


def _recapture_world(**runtime) -> World:
    world = World.new()
    world.create(replicas=2, runtime={"engine": ENGINE, **runtime})
    world.settle(3)
    world.edit(graphs={"mode": "FULL", "captureSizes": [1, 2, 4]})
    world.reconcile()
    return world


def test_workers_behind_an_api_key_are_asked_to_recapture_through_their_pod_only():
    # POST /v1/graphs/recapture needs the key, which the operator does not read: the Pod
    # annotation (polled by the worker) is the trigger.
    world = _recapture_world(apiKeySecretRef={"name": "k"})
    assert world.recaptures == []
    assert [e[1] for e in world.kube.events()].count("RecaptureRequested") == 2
    assert all("graphserving.io/recapture" in p["metadata"]["annotations"] for p in world.kube.of_kind("Pod"))


def test_workers_without_an_api_key_also_get_the_post():
    assert len(_recapture_world().recaptures) == 2
