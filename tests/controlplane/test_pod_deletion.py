"""Deleting a pod stops its process gracefully (SIGTERM first), then the Pod object goes away."""

import sys

import pytest
from kubernetes.client.rest import ApiException

from cp_helpers import read_pod
from graphserving.dev.cluster import process_alive
from graphserving.dev.pytest_fixtures import wait_for

pytestmark = pytest.mark.cluster

SCRIPT = """
import pathlib, signal, sys, time
marker = pathlib.Path(sys.argv[1])
def on_term(*_):
    marker.write_text("SIGTERM")
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
print("ready", flush=True)
while True:
    time.sleep(0.1)
"""


def gone(core, name, namespace):
    try:
        read_pod(core, name, namespace)
    except ApiException as exc:
        return exc.status == 404
    return False


def test_the_process_gets_sigterm_and_the_pod_is_removed(core, namespace, tmp_path):
    marker = tmp_path / "terminated"
    core.create_namespaced_pod(namespace, {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "graceful"},
        "spec": {"terminationGracePeriodSeconds": 20, "containers": [{
            "name": "main", "image": "python:3.11", "command": [sys.executable, "-c", SCRIPT, str(marker)]}]}})
    pod = wait_for(lambda: (p := read_pod(core, "graceful", namespace))["status"].get("phase") == "Running" and p,
                   message="the pod to run")
    pid = int(pod["status"]["containerStatuses"][0]["containerID"].removeprefix("graphserving://"))

    core.delete_namespaced_pod("graceful", namespace)
    wait_for(lambda: gone(core, "graceful", namespace), timeout=60, message="the pod to be removed")
    assert marker.read_text() == "SIGTERM"
    assert not process_alive(pid, None)
