"""The API server validates the new ``spec.podTemplate`` fields of the CRD (its CEL rules and
list-map keys), naming the field, before the operator sees the object."""

from __future__ import annotations

import json

import pytest
from kubernetes.client.rest import ApiException
from op_cluster import create_gs
from op_helpers import spec_dict

pytestmark = pytest.mark.cluster


def _refusal(custom, namespace, pod_template) -> str:
    with pytest.raises(ApiException) as err:
        create_gs(custom, namespace, "bad", spec_dict(podTemplate=pod_template))
    assert err.value.status == 422
    return json.loads(err.value.body)["message"]


def test_a_sidecar_named_worker_is_refused_naming_the_field(custom, namespace):
    message = _refusal(custom, namespace, {"containers": [{"name": "worker", "image": "x"}]})
    assert "spec.podTemplate.containers" in message
    assert "'worker' is the operator's worker container: name the container otherwise" in message


def test_a_duplicate_container_name_is_refused(custom, namespace):
    message = _refusal(custom, namespace, {"containers": [{"name": "a", "image": "x"}, {"name": "a", "image": "y"}]})
    assert 'spec.podTemplate.containers[1]: Duplicate value: {"name":"a"}' in message


def test_a_name_shared_by_containers_and_init_containers_is_refused(custom, namespace):
    message = _refusal(custom, namespace, {"containers": [{"name": "a"}], "initContainers": [{"name": "a"}]})
    assert "spec.podTemplate: Invalid value" in message and "container names are unique in a Pod" in message


def test_the_new_fields_are_stored_as_given(custom, namespace):
    pod_template = {"imagePullSecrets": [{"name": "registry"}], "runtimeClassName": "nvidia",
                    "securityContext": {"runAsUser": 1000}, "containerSecurityContext": {"readOnlyRootFilesystem": False},
                    "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable": "DoNotSchedule"}],
                    "containers": [{"name": "side", "image": "x", "args": ["--a"]}],
                    "initContainers": [{"name": "init", "image": "y", "restartPolicy": "Always"}]}
    created = create_gs(custom, namespace, "good", spec_dict(podTemplate=pod_template))
    assert created["spec"]["podTemplate"] == pod_template
