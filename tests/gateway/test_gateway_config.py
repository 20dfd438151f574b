"""What the dev cluster writes for its gateway and Prometheus (pure: no processes)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from graphserving.dev import cli, gateway, prometheus, resources


@pytest.mark.parametrize(("kind", "plural"), [
    ("GatewayClass", "gatewayclasses"), ("HTTPRoute", "httproutes"),
    ("ValidatingAdmissionPolicy", "validatingadmissionpolicies"), ("Namespace", "namespaces"),
    ("CustomResourceDefinition", "customresourcedefinitions"), ("Policy", "policies"), ("Gateway", "gateways"),
])
def test_resource_names_follow_the_api_conventions(kind, plural):
    assert resources.plural(kind) == plural


def test_resource_paths_are_namespaced_exactly_when_the_object_names_a_namespace():
    assert resources.resource_path({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "gw"}}) == \
        "/api/v1/namespaces/gw"
    assert resources.resource_path({"apiVersion": "gateway.networking.k8s.io/v1", "kind": "Gateway",
                                    "metadata": {"name": "g", "namespace": "gw"}}) == \
        "/apis/gateway.networking.k8s.io/v1/namespaces/gw/gateways/g"
    with pytest.raises(resources.ApplyError, match="metadata.name"):
        resources.resource_path({"apiVersion": "v1", "kind": "Pod", "metadata": {}})


def test_traefik_listens_on_loopback_only_and_never_phones_home():
    config = gateway.static_config(port=30080, admin_port=30081)
    assert {name: ep["address"] for name, ep in config["entryPoints"].items()} == {
        "web": "127.0.0.1:30080", "traefik": "127.0.0.1:30081"}
    assert config["global"] == {"checkNewVersion": False, "sendAnonymousUsage": False}
    assert set(config["providers"]) == {"kubernetesGateway"}
    # docs/gateway.md, "Streaming requests through Traefik's default proxy": it cuts some streams
    assert config["experimental"] == {"fastProxy": {"debug": False}}


def test_the_gateways_listener_port_is_the_entry_points_so_traefik_can_match_them():
    namespace, gateway_class, gw = gateway.gateway_objects(30080)
    assert gateway_class["spec"]["controllerName"] == "traefik.io/gateway-controller"
    assert gw["spec"]["gatewayClassName"] == gateway_class["metadata"]["name"]
    assert gw["metadata"]["namespace"] == namespace["metadata"]["name"] == gateway.parent_ref()["namespace"]
    assert gw["spec"]["listeners"] == [{"name": "http", "protocol": "HTTP", "port": 30080,
                                        "allowedRoutes": {"namespaces": {"from": "All"}}}]


def test_the_gateways_permissions_are_read_plus_status_writes():
    role = next(d for d in gateway.rbac() if d["kind"] == "ClusterRole")
    writes = [r for r in role["rules"] if set(r["verbs"]) - {"get", "list", "watch"}]
    assert writes and all(r["verbs"] == ["update"] and all(x.endswith("/status") for x in r["resources"])
                          for r in writes)


def test_prometheus_discovers_pods_through_the_given_kubeconfig_with_the_charts_selectors(tmp_path):
    config = prometheus.config(tmp_path / "p.kubeconfig", "2s", "1s", gateway_metrics="127.0.0.1:30081")
    assert config["global"]["scrape_interval"] == "2s" and config["global"]["scrape_timeout"] == "1s"
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    assert list(jobs) == ["graphserving-workers", "graphserving-operator", "gateway"]
    for name in ("graphserving-workers", "graphserving-operator"):
        assert jobs[name]["kubernetes_sd_configs"] == [
            {"role": "pod", "kubeconfig_file": str(tmp_path / "p.kubeconfig")}]
    keep = [r for r in jobs["graphserving-workers"]["relabel_configs"] if r.get("action") == "keep"]
    # the chart's PodMonitor: matchLabels managed-by/component and port "http"
    assert [r["regex"] for r in keep] == ["graphserving-operator;worker", "http"]
    assert jobs["gateway"]["static_configs"] == [{"targets": ["127.0.0.1:30081"]}]
    assert jobs["graphserving-operator"]["honor_labels"] is True


def test_cluster_up_starts_the_gateway_and_prometheus_unless_told_not_to():
    flags = argparse.Namespace(no_gateway=False, no_prometheus=False)
    assert cli.up_components(flags)[-2:] == ["traefik", "prometheus"]
    flags = argparse.Namespace(no_gateway=True, no_prometheus=True)
    assert "traefik" not in cli.up_components(flags) and "prometheus" not in cli.up_components(flags)


def test_cluster_env_exports_the_gateway_and_prometheus_urls(tmp_path: Path):
    (tmp_path / "state.json").write_text(json.dumps(
        {"endpoints": {"gateway": "http://127.0.0.1:30080", "prometheus": "http://127.0.0.1:30090"}}))
    lines = cli.env_lines(tmp_path)
    assert "export GRAPHSERVING_GATEWAY_URL=http://127.0.0.1:30080" in lines
    assert "export GRAPHSERVING_PROMETHEUS_URL=http://127.0.0.1:30090" in lines
