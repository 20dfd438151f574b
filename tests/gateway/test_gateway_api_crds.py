"""The Gateway API's own standard-channel CRDs on the dev cluster, and the operator's HTTPRoute under them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from graphserving.contract import graphserving_types as api
from graphserving.dev import gateway as gateway_mod
from graphserving.dev import gateway_api, resources
from graphserving.operator import children, routing

REPO = Path(__file__).resolve().parents[2]
CRD = {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition"}


def test_manifests_are_applied_crds_first_then_the_policy_that_guards_them(tmp_path):
    (tmp_path / "a_policy.yaml").write_text(
        "kind: ValidatingAdmissionPolicy\nmetadata: {name: p}\n---\n"
        "kind: ValidatingAdmissionPolicyBinding\nmetadata: {name: p}\n")
    (tmp_path / "b_routes.yaml").write_text(f"kind: {gateway_api.CRD_KIND}\nmetadata: {{name: httproutes}}\n")
    (tmp_path / "c_classes.yaml").write_text(f"kind: {gateway_api.CRD_KIND}\nmetadata: {{name: gatewayclasses}}\n")
    assert [(d["kind"], d["metadata"]["name"]) for d in gateway_api.documents(tmp_path)] == [
        (gateway_api.CRD_KIND, "httproutes"), (gateway_api.CRD_KIND, "gatewayclasses"),
        ("ValidatingAdmissionPolicy", "p"), ("ValidatingAdmissionPolicyBinding", "p")]


@pytest.fixture(scope="module")
def real_crds(cluster):
    """The release's CRDs, applied again: the operator tests' stand-in may have replaced them this session."""
    return gateway_api.install_cached(cluster)


def _get(cluster, obj: dict) -> dict:
    status, body = cluster.get(resources.resource_path(obj))
    assert status == 200, body
    return json.loads(body)


@pytest.mark.cluster
def test_the_cluster_serves_the_releases_standard_channel(cluster, real_crds):
    assert "httproutes.gateway.networking.k8s.io" in real_crds
    assert "gateways.gateway.networking.k8s.io" in real_crds
    crd = _get(cluster, {**CRD, "metadata": {"name": "httproutes.gateway.networking.k8s.io"}})
    annotations = crd["metadata"]["annotations"]
    assert annotations["gateway.networking.k8s.io/bundle-version"] == gateway_api.GATEWAY_API_VERSION
    assert annotations["gateway.networking.k8s.io/channel"] == "standard"
    assert [(v["name"], v["served"], v["storage"]) for v in crd["spec"]["versions"]] == [
        ("v1", True, True), ("v1beta1", True, False)]
    assert crd["spec"]["versions"][0]["subresources"] == {"status": {}}


@pytest.mark.cluster
def test_an_httproute_outside_the_schema_is_refused_naming_the_field(cluster, real_crds, namespace):
    route = {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
             "metadata": {"name": "bad", "namespace": namespace},
             "spec": {"parentRefs": [gateway_mod.parent_ref()],
                      "rules": [{"backendRefs": [{"name": "svc", "port": 8000, "weight": -1}]}]}}
    refusal = r"spec\.rules\[0\]\.backendRefs\[0\]\.weight.*greater than or equal to 0"
    with pytest.raises(resources.ApplyError, match=refusal):
        resources.apply(cluster, route)


@pytest.mark.cluster
def test_the_operators_weighted_httproute_is_valid_under_the_real_schema(cluster, real_crds, namespace):
    sample = yaml.safe_load((REPO / "manifests/samples/smollm2-cpu.yaml").read_text())
    sample["metadata"].update(namespace=namespace, uid="3f1c9a5e-0000-4000-8000-000000000001", generation=1)
    sample["spec"]["routing"] = {"parentRefs": [{**gateway_mod.parent_ref(), "sectionName": gateway_mod.LISTENER_NAME}],
                                 "hostnames": ["smollm2.example.test"]}
    gs = api.GraphServing.model_validate(sample)
    route = routing.http_route(gs, {"1a2b3c4d5e": 64, "6f7a8b9c0d": 36}, children.owner_reference(gs))

    stored = resources.apply(cluster, route, dry_run=True)
    rule = stored["spec"]["rules"][0]
    # the schema's defaults: Service backends, and a rule without matches matching every path
    assert rule["backendRefs"] == [
        {"group": "", "kind": "Service", "name": "smollm2-1a2b3c4d5e", "port": 8000, "weight": 64},
        {"group": "", "kind": "Service", "name": "smollm2-6f7a8b9c0d", "port": 8000, "weight": 36}]
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/"}}]
    assert stored["spec"]["parentRefs"] == [{"group": "gateway.networking.k8s.io", "kind": "Gateway",
                                             "name": "graphserving", "namespace": "graphserving-gateway",
                                             "sectionName": "http"}]
    assert stored["spec"]["hostnames"] == ["smollm2.example.test"]


@pytest.mark.cluster
def test_the_graphservings_routing_fields_take_the_httproutes_own_patterns(cluster, real_crds):
    """A hostname, listener or namespace the HTTPRoute would refuse is refused on the GraphServing."""
    crd = _get(cluster, {**CRD, "metadata": {"name": "httproutes.gateway.networking.k8s.io"}})
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    parent = spec["parentRefs"]["items"]["properties"]
    assert spec["hostnames"]["items"]["pattern"] == api.GATEWAY_HOSTNAME_PATTERN
    assert parent["sectionName"]["pattern"] == api.GATEWAY_SECTION_NAME_PATTERN
    assert parent["namespace"]["pattern"] == api.GATEWAY_NAMESPACE_PATTERN
    with pytest.raises(ValueError, match="hostnames.0"):
        api.RoutingSpec.model_validate({"parentRefs": [{"name": "gw"}], "hostnames": ["Bad_Host"]})
    with pytest.raises(ValueError, match="sectionName"):
        api.RoutingSpec.model_validate({"parentRefs": [{"name": "gw", "sectionName": "HTTP!"}]})
