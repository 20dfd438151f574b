"""The GraphServing API on the real API server (issue 18, items 7 and 11): conditions are a list-map
keyed by type, ``status.url``/``status.address`` name the stable Service, ``apiKeySecretRef`` and
``toolCallParser`` reach the worker container, and bad values are refused naming the field."""

from __future__ import annotations

import json

import pytest
from kubernetes.client.rest import ApiException
from op_cluster import APPLY, create_gs, get_gs, standin_spec
from op_helpers import spec_dict

from graphserving.contract import graphserving_types as api
from graphserving.dev.pytest_fixtures import wait_for
from graphserving.operator import naming

pytestmark = pytest.mark.cluster
T = "2025-01-01T00:00:00Z"


def _get(api_client, path: str, accept: str = "application/json") -> dict:
    """``GET path`` on the API server, the JSON body."""
    method, url, headers, _, _ = api_client.param_serialize("GET", path, header_params={"Accept": accept},
                                                            auth_settings=["BearerToken"])
    response = api_client.call_api(method, url, header_params=headers)
    response.read()
    return json.loads(response.data)


def _refusal(custom, namespace, spec) -> str:
    with pytest.raises(ApiException) as err:
        create_gs(custom, namespace, "bad", spec)
    assert err.value.status == 422
    return json.loads(err.value.body)["message"]


def _apply_condition(custom, namespace: str, name: str, manager: str, type_: str) -> None:
    body = {"apiVersion": api.API_VERSION, "kind": api.KIND, "metadata": {"name": name},
            "status": {"conditions": [{"type": type_, "status": "True", "reason": "Seen", "message": manager,
                                       "lastTransitionTime": T}]}}
    custom.patch_namespaced_custom_object_status(api.GROUP, api.VERSION, namespace, api.PLURAL, name, body,
                                                 field_manager=manager, force=True, _content_type=APPLY)


def test_server_side_apply_of_one_condition_keeps_the_others(custom, namespace):
    create_gs(custom, namespace, "conds", spec_dict())
    _apply_condition(custom, namespace, "conds", "first", "Ready")
    _apply_condition(custom, namespace, "conds", "second", "Progressing")
    _apply_condition(custom, namespace, "conds", "second", "Progressing")  # applied again: still one
    conditions = get_gs(custom, namespace, "conds")["status"]["conditions"]
    assert [(c["type"], c["message"]) for c in conditions] == [("Ready", "first"), ("Progressing", "second")]


def test_two_conditions_of_one_type_are_refused(custom, namespace):
    create_gs(custom, namespace, "twice", spec_dict())
    condition = {"type": "Ready", "status": "True", "reason": "Seen", "lastTransitionTime": T}
    with pytest.raises(ApiException) as err:
        custom.patch_namespaced_custom_object_status(
            api.GROUP, api.VERSION, namespace, api.PLURAL, "twice", {"status": {"conditions": [condition, condition]}},
            _content_type="application/merge-patch+json")
    assert err.value.status == 422
    assert 'status.conditions[1]: Duplicate value: {"type":"Ready"}' in json.loads(
        err.value.body)["message"]


def test_the_served_openapi_carries_the_list_map_markers(installed):
    schemas = _get(installed, f"/openapi/v3/apis/{api.GROUP}/{api.VERSION}")["components"]["schemas"]
    conditions = schemas[f"io.graphserving.{api.VERSION}.{api.KIND}"]["properties"]["status"]["properties"][
        "conditions"]
    assert (conditions["x-kubernetes-list-type"], conditions["x-kubernetes-list-map-keys"]) == ("map", ["type"])


def test_an_unknown_tool_call_parser_is_refused_naming_the_field(custom, namespace):
    message = _refusal(custom, namespace, spec_dict(
        runtime={"engine": {"maxNumSeqs": 8, "maxNumBatchedTokens": 256, "toolCallParser": "mistral"}}))
    assert 'spec.runtime.engine.toolCallParser: Unsupported value: "mistral"' in message
    assert '"auto", "hermes", "llama3_json", "none"' in message


@pytest.mark.parametrize(
    ("ref", "field"),
    [({"name": "Key_1"}, "spec.runtime.apiKeySecretRef.name"),
     ({"name": "key", "key": "api key"}, "spec.runtime.apiKeySecretRef.key"),
     ({"key": "api-key"}, "spec.runtime.apiKeySecretRef.name")],
    ids=["name-not-a-dns-subdomain", "key-with-a-space", "no-name"],
)
def test_a_bad_api_key_secret_ref_is_refused_naming_the_field(custom, namespace, ref, field):
    message = _refusal(custom, namespace, spec_dict(
        runtime={"engine": {"maxNumSeqs": 8, "maxNumBatchedTokens": 256}, "apiKeySecretRef": ref}))
    assert f"{field}: " in message and ("should match" in message or "Required value" in message)


def test_an_api_key_set_in_env_and_by_secret_ref_is_refused_naming_env(custom, namespace):
    message = _refusal(custom, namespace, spec_dict(
        runtime={"engine": {"maxNumSeqs": 8, "maxNumBatchedTokens": 256}, "apiKeySecretRef": {"name": "key"}},
        podTemplate={"env": [{"name": "GRAPHSERVING_API_KEY", "value": "plain"}]}))
    assert "spec.podTemplate.env: Invalid value" in message
    assert "podTemplate.env sets GRAPHSERVING_API_KEY and runtime.apiKeySecretRef names the Secret" in message


def test_an_env_var_without_a_name_is_refused_naming_the_field(custom, namespace):
    message = _refusal(custom, namespace, spec_dict(podTemplate={"env": [{"value": "orphan"}]}))
    assert "spec.podTemplate.env[0].name: Required value" in message


@pytest.mark.slow
def test_the_operator_renders_the_key_and_the_parser_and_publishes_where_to_send_requests(
        custom, core, apps, namespace, operator, go_dir):
    core.create_namespaced_secret(namespace, {"metadata": {"name": "smol-key"}, "stringData": {"token": "s3cret"}})
    spec = standin_spec(go_dir)
    spec["runtime"]["engine"]["toolCallParser"] = "hermes"
    spec["runtime"]["apiKeySecretRef"] = {"name": "smol-key", "key": "token"}
    create_gs(custom, namespace, "smol", spec)
    gs = wait_for(lambda: (g := get_gs(custom, namespace, "smol")).get("status", {}).get("url") and g, timeout=60,
                  message=lambda: f"status.url; {operator.log()}")
    assert gs["status"]["url"] == f"http://smol.{namespace}.svc:8000/v1"
    assert gs["status"]["address"] == f"smol.{namespace}.svc:8000"
    assert core.read_namespaced_service("smol", namespace).spec.ports[0].port == 8000

    dep = apps.read_namespaced_deployment(naming.revision_name("smol", gs["status"]["currentRevision"]), namespace)
    (worker,) = [c for c in dep.spec.template.spec.containers if c.name == "worker"]
    assert worker.args == ["--tool-call-parser", "hermes"]
    (key,) = [e for e in worker.env if e.name == "GRAPHSERVING_API_KEY"]
    assert (key.value, key.value_from.secret_key_ref.name, key.value_from.secret_key_ref.key) == (
        None, "smol-key", "token")
    # kubectl get gs shows the URL column (the server-side Table kubectl asks for).
    rendered = _get(custom.api_client, f"/apis/{api.GROUP}/{api.VERSION}/namespaces/{namespace}/{api.PLURAL}/smol",
                    accept="application/json;as=Table;v=v1;g=meta.k8s.io")
    names = [c["name"] for c in rendered["columnDefinitions"]]
    assert rendered["rows"][0]["cells"][names.index("URL")] == f"http://smol.{namespace}.svc:8000/v1"
