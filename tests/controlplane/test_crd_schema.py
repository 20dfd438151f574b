"""A CRD's structural schema is enforced by the real API server."""

import json

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from graphserving.dev.pytest_fixtures import condition_status, wait_for

pytestmark = pytest.mark.cluster

CRD = {
    "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
    "metadata": {"name": "widgets.schema.test.graphserving.io"},
    "spec": {
        "group": "schema.test.graphserving.io", "scope": "Namespaced",
        "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
        "versions": [{"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": {
            "type": "object",
            "properties": {"spec": {"type": "object", "required": ["replicas"], "properties": {
                "replicas": {"type": "integer", "minimum": 1},
                "mode": {"type": "string", "enum": ["FULL", "PIECEWISE"]},
            }}},
        }}}],
    },
}


@pytest.fixture(scope="module")
def widget_crd(kube_api):
    ext = client.ApiextensionsV1Api(kube_api)
    ext.create_custom_resource_definition(CRD)
    wait_for(lambda: condition_status(json.loads(ext.read_custom_resource_definition(
        CRD["metadata"]["name"], _preload_content=False).data), "Established") == "True",
        message="the CRD to be Established")
    yield
    ext.delete_custom_resource_definition(CRD["metadata"]["name"])


def create_widget(kube_api, namespace, spec):
    api = client.CustomObjectsApi(kube_api)
    body = {"apiVersion": "schema.test.graphserving.io/v1", "kind": "Widget",
            "metadata": {"name": "w"}, "spec": spec}
    return wait_for(lambda: _create_or_error(api, namespace, body), message="the Widget API to be served")


def _create_or_error(api, namespace, body):
    try:
        return api.create_namespaced_custom_object("schema.test.graphserving.io", "v1", namespace, "widgets", body)
    except ApiException as exc:
        if exc.status == 404:  # discovery of a fresh CRD can lag a moment behind Established
            raise
        return exc


def test_an_invalid_object_is_rejected_naming_the_field(kube_api, namespace, widget_crd):
    result = create_widget(kube_api, namespace, {"replicas": 0, "mode": "SOMETIMES"})
    assert isinstance(result, ApiException) and result.status == 422
    body = json.loads(result.body)
    fields = sorted(cause["field"] for cause in body["details"]["causes"])
    assert fields == ["spec.mode", "spec.replicas"]
    assert "spec.replicas: Invalid value: 0: spec.replicas in body should be greater than or equal to 1" in body["message"]


def test_a_valid_object_is_stored(kube_api, namespace, widget_crd):
    result = create_widget(kube_api, namespace, {"replicas": 2, "mode": "FULL"})
    assert not isinstance(result, ApiException)
    assert result["spec"] == {"replicas": 2, "mode": "FULL"}
