"""kwok fake nodes run pods without processes, and leave readiness gates to their owner."""

import ipaddress

import pytest

from cp_helpers import as_dict, read_pod
from graphserving.dev import kwok, pod_network
from graphserving.dev.pytest_fixtures import condition_status, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

GATE = "graphserving.io/graphs-ready"


def test_a_gated_pod_on_a_fake_node_waits_for_its_gate(kwok_cluster, core, namespace):
    names = [f"fake-{namespace}-{i}" for i in range(3)]
    for name in names:
        core.create_node(kwok.fake_node(name))
    try:
        for name in names:
            wait_for(lambda n=name: condition_status(as_dict(core.read_node(n, _preload_content=False)),
                                                     "Ready") == "True",
                     message=f"fake node {name} to be Ready")
        core.create_namespaced_pod(namespace, {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "fake-gated"},
            "spec": {"nodeSelector": {"type": "kwok"}, "tolerations": [kwok.FAKE_TOLERATION],
                     "readinessGates": [{"conditionType": GATE}],
                     "containers": [{"name": "main", "image": "registry.invalid/worker:1"}]}})
        pod = wait_for(lambda: (p := read_pod(core, "fake-gated", namespace)) and
                       condition_status(p, "ContainersReady") == "True" and p, timeout=90,
                       message="the pod on a fake node to run")
        assert pod["spec"]["nodeName"] in names
        # Outside every node agent's subnet, and unreachable from this machine while an agent runs.
        fake_pods = ipaddress.ip_network(pod_network.fake_pod_subnet(kwok_cluster.cluster.pod_range))
        assert ipaddress.ip_address(pod["status"]["podIP"]) in fake_pods
        assert condition_status(pod, "Ready") == "False"
        assert condition_status(pod, GATE) is None

        core.patch_namespaced_pod_status("fake-gated", namespace, {"status": {"conditions": [
            {"type": GATE, "status": "True"}]}}, _content_type="application/strategic-merge-patch+json")
        wait_for(lambda: condition_status(read_pod(core, "fake-gated", namespace), "Ready") == "True",
                 message="Ready after the gate became True")
    finally:
        core.delete_collection_namespaced_pod(namespace, grace_period_seconds=0)
        for name in names:
            core.delete_node(name)
