"""A Deployment's pods run as real processes on the local node and serve through their Service."""

import ipaddress
import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from kubernetes import client

from cp_helpers import as_dict
from graphserving.dev import cluster as cluster_mod
from graphserving.dev import pod_network
from graphserving.dev.pytest_fixtures import condition_status, wait_for

pytestmark = pytest.mark.cluster


def web_deployment(name: str) -> dict:
    container = {
        "name": "web", "image": "python:3.11",
        "command": [sys.executable, "-m", "http.server", "--bind", "$(POD_IP)", "8080"],
        "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
        "ports": [{"name": "http", "containerPort": 8080}],
        "readinessProbe": {"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 1},
    }
    return {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"app": name}},
                 "template": {"metadata": {"labels": {"app": name}},
                              "spec": {"containers": [container], "terminationGracePeriodSeconds": 5}}},
    }


@pytest.fixture
def rolled_out(kube_api, core, apps, namespace):
    apps.create_namespaced_deployment(namespace, web_deployment("web"))
    core.create_namespaced_service(namespace, {
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": "web"},
        "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": "http"}]}})

    def available():
        dep = as_dict(apps.read_namespaced_deployment("web", namespace, _preload_content=False))
        return dep if condition_status(dep, "Available") == "True" and dep["status"].get("readyReplicas") == 1 else None
    wait_for(available, timeout=120, message="Deployment web to become available")
    pods = as_dict(core.list_namespaced_pod(namespace, label_selector="app=web", _preload_content=False))["items"]
    assert len(pods) == 1
    return pods[0]


def test_the_pod_is_running_and_ready_on_the_local_node(cluster, rolled_out):
    pod = rolled_out
    assert pod["spec"]["nodeName"] == cluster_mod.DEFAULT_NODE_NAME
    assert pod["status"]["phase"] == "Running"
    assert condition_status(pod, "Ready") == "True"
    assert ipaddress.ip_address(pod["status"]["podIP"]) in ipaddress.ip_network(cluster.pod_network["subnet"])


def test_a_real_process_serves_on_the_pod_ip(rolled_out):
    pod = rolled_out
    status = pod["status"]["containerStatuses"][0]
    pid = int(status["containerID"].removeprefix("graphserving://"))
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    assert b"http.server" in cmdline and pod["status"]["podIP"].encode() in cmdline
    with urllib.request.urlopen(f"http://{pod['status']['podIP']}:8080/", timeout=5) as resp:
        assert resp.status == 200


def test_the_process_runs_in_the_nodes_network_namespace(cluster, rolled_out):
    if not cluster.pod_network["namespaced"]:
        pytest.skip(f"no pod network namespace: {cluster.pod_network['warning']}")
    pid = int(rolled_out["status"]["containerStatuses"][0]["containerID"].removeprefix("graphserving://"))
    pod_netns = os.stat(f"/proc/{pid}/ns/net").st_ino
    assert pod_netns == os.stat(pod_network.NETNS_DIR / cluster.pod_network["netns"]).st_ino
    assert pod_netns != os.stat("/proc/self/ns/net").st_ino


def test_this_machine_reaches_the_pod_ip_through_the_veth_not_a_local_route(cluster, rolled_out):
    if not cluster.pod_network["namespaced"]:
        pytest.skip(f"no pod network namespace: {cluster.pod_network['warning']}")
    route = subprocess.run(["ip", "-4", "route", "get", rolled_out["status"]["podIP"]],
                           capture_output=True, text=True, check=True).stdout.split()
    assert route[:3] == [rolled_out["status"]["podIP"], "dev", cluster.pod_network["interface"]]
    assert route[route.index("src") + 1] == cluster.pod_network["gateway"]


def test_the_services_endpoint_slice_points_at_the_pod_ip(cluster, kube_api, namespace, rolled_out):
    if not cluster.pod_network["routed"] and not os.environ.get("GRAPHSERVING_REQUIRE_CLUSTER"):
        pytest.skip(f"pods have loopback IPs, which EndpointSlices refuse: {cluster.pod_network['warning']}")
    discovery = client.DiscoveryV1Api(kube_api)

    def ready_endpoints():
        slices = json.loads(discovery.list_namespaced_endpoint_slice(
            namespace, label_selector="kubernetes.io/service-name=web", _preload_content=False).data)["items"]
        return [(addr, s["ports"][0]["port"]) for s in slices for ep in s.get("endpoints") or []
                if ep["conditions"].get("ready") for addr in ep["addresses"]]
    endpoints = wait_for(ready_endpoints, message="a ready endpoint in the Service's EndpointSlice")
    assert endpoints == [(rolled_out["status"]["podIP"], 8080)]
    address, port = endpoints[0]
    with urllib.request.urlopen(f"http://{address}:{port}/", timeout=5) as resp:
        assert resp.status == 200
