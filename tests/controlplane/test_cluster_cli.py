"""`graphserving dev cluster up` leaves a working cluster, with the Gateway API CRDs, a gateway and
Prometheus; `down` leaves no process, namespace or veth behind."""

import json
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from graphserving.dev import binaries, cluster as cluster_mod, gateway_api, pod_network
from graphserving.dev.pytest_fixtures import require_binary, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def graphserving(*args, **kwargs):
    return subprocess.run([sys.executable, "-m", "graphserving.cli", *args], capture_output=True, text=True,
                          timeout=300, **kwargs)


def kubectl(state_dir, *args, stdin=None):
    return subprocess.run([str(binaries.binary_path("kubectl")), f"--kubeconfig={state_dir / 'admin.kubeconfig'}",
                           *args], capture_output=True, text=True, input=stdin, timeout=60)


POD = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "sleeper", "namespace": "default"},
       "spec": {"terminationGracePeriodSeconds": 30,
                "containers": [{"name": "main", "image": "python:3.11",
                                "command": [sys.executable, "-c", "import time; time.sleep(3600)"]}]}}


def _status(url):
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_up_serves_readyz_runs_pods_and_down_stops_every_process(tmp_path, cluster):
    # `cluster` only makes sure the binaries exist (and skips/fails like every cluster test).
    require_binary("traefik")
    require_binary("prometheus")
    state_dir = tmp_path / "cli-cluster"
    up = graphserving("dev", "cluster", "up", "--state-dir", str(state_dir))
    try:
        assert up.returncode == 0, up.stderr
        readyz = kubectl(state_dir, "get", "--raw", "/readyz")
        assert readyz.stdout.strip() == "ok", readyz.stderr
        version = json.loads(kubectl(state_dir, "get", "--raw", "/version").stdout)
        assert version["gitVersion"] == binaries.KUBERNETES_VERSION

        env = graphserving("dev", "cluster", "env", "--state-dir", str(state_dir))
        assert f"export KUBECONFIG={state_dir / 'admin.kubeconfig'}" in env.stdout
        assert str(binaries.binary_path("kubectl").parent) in env.stdout
        endpoints = cluster_mod.read_state(state_dir)["endpoints"]
        assert f"export GRAPHSERVING_GATEWAY_URL={endpoints['gateway']}" in env.stdout
        assert f"export GRAPHSERVING_PROMETHEUS_URL={endpoints['prometheus']}" in env.stdout
        crd = kubectl(state_dir, "get", "crd", "httproutes.gateway.networking.k8s.io",
                      "-o", "jsonpath={.metadata.annotations.gateway\\.networking\\.k8s\\.io/bundle-version}")
        assert crd.stdout == gateway_api.GATEWAY_API_VERSION, crd.stderr
        programmed = kubectl(state_dir, "get", "gateway", "graphserving", "-n", "graphserving-gateway", "-o",
                             "jsonpath={.status.conditions[?(@.type=='Programmed')].status}")
        assert programmed.stdout == "True", programmed.stderr
        assert _status(endpoints["gateway"] + "/") == 404  # Traefik answers; no route attached yet
        assert _status(endpoints["prometheus"] + "/-/ready") == 200

        created = kubectl(state_dir, "apply", "-f", "-", stdin=json.dumps(POD))
        assert created.returncode == 0, created.stderr
        wait_for(lambda: kubectl(state_dir, "get", "pod", "sleeper", "-o", "jsonpath={.status.phase}").stdout
                 == "Running", timeout=90, message="the sleeper pod to run")
        processes = cluster_mod.running_processes(state_dir)
        network = cluster_mod.read_state(state_dir)["pod_network"]
        names = sorted(r.name for r in processes)
        assert names == ["etcd", "gateway", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "main",
                         "node-agent", "prometheus"]
    finally:
        down = graphserving("dev", "cluster", "down", "--state-dir", str(state_dir))
    assert down.returncode == 0, down.stderr
    assert [r for r in processes if cluster_mod.process_alive(r.pid, r.start_time)] == []
    assert not state_dir.exists()
    if network["namespaced"]:
        assert not pod_network.netns_exists(network["netns"])
        assert not pod_network.interface_exists(network["interface"])
