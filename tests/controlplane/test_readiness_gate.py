"""A pod with a readiness gate is Ready only once someone else sets the gate condition."""

import pytest

from cp_helpers import read_pod, sleeper_container
from graphserving.dev.pytest_fixtures import condition_status, wait_for

pytestmark = pytest.mark.cluster

GATE = "graphserving.io/graphs-ready"


def set_gate(core, name, namespace, status):
    core.patch_namespaced_pod_status(
        name, namespace, {"status": {"conditions": [{"type": GATE, "status": status, "reason": "Test"}]}},
        _content_type="application/strategic-merge-patch+json")


@pytest.fixture
def gated_pod(core, namespace):
    core.create_namespaced_pod(namespace, {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "gated"},
        "spec": {"readinessGates": [{"conditionType": GATE}], "containers": [sleeper_container()],
                 "terminationGracePeriodSeconds": 1}})
    return wait_for(lambda: (p := read_pod(core, "gated", namespace)) and
                    condition_status(p, "ContainersReady") == "True" and p,
                    message="the gated pod's containers to be ready")


def test_ready_stays_false_while_the_gate_condition_is_missing(gated_pod):
    ready = next(c for c in gated_pod["status"]["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "False"
    assert ready["reason"] == "ReadinessGatesNotReady"
    assert condition_status(gated_pod, GATE) is None


def test_ready_follows_the_gate_condition_set_by_the_test(core, namespace, gated_pod):
    set_gate(core, "gated", namespace, "True")
    wait_for(lambda: condition_status(read_pod(core, "gated", namespace), "Ready") == "True",
             message="Ready after the gate became True")
    set_gate(core, "gated", namespace, "False")
    pod = wait_for(lambda: (p := read_pod(core, "gated", namespace)) and
                   condition_status(p, "Ready") == "False" and p,
                   message="not Ready after the gate became False")
    assert condition_status(pod, GATE) == "False"
