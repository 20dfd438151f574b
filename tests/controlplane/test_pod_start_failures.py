"""Containers that cannot start, or exit at once, get the kubelet's statuses; the pod's runner goes on."""

import sys

import pytest

from cp_helpers import read_pod
from graphserving.dev.pytest_fixtures import wait_for

pytestmark = pytest.mark.cluster


def container_state(core, name, namespace) -> dict:
    statuses = read_pod(core, name, namespace).get("status", {}).get("containerStatuses") or [{}]
    return statuses[0]


def test_a_missing_working_directory_is_a_run_container_error_and_is_retried(core, namespace, tmp_path):
    # Popen's chdir failed with FileNotFoundError, which ended the pod's runner thread: the Pod
    # stayed Pending without a container status, and creating the directory changed nothing.
    workdir = tmp_path / "later"
    core.create_namespaced_pod(namespace, {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "no-workdir"},
        "spec": {"restartPolicy": "Never", "containers": [{
            "name": "main", "image": "python:3.11", "workingDir": str(workdir),
            "command": [sys.executable, "-c", "import os; print(os.getcwd())"]}]}})
    waiting = wait_for(
        lambda: container_state(core, "no-workdir", namespace).get("state", {}).get("waiting", {}).get("reason")
        == "RunContainerError" and container_state(core, "no-workdir", namespace)["state"]["waiting"],
        timeout=60, message="a RunContainerError status")
    assert str(workdir) in waiting["message"] and "No such file or directory" in waiting["message"]
    workdir.mkdir()
    terminated = wait_for(
        lambda: container_state(core, "no-workdir", namespace).get("state", {}).get("terminated"),
        timeout=60, message="the retried container to run and exit")
    assert (terminated["exitCode"], terminated["reason"]) == (0, "Completed")
    assert read_pod(core, "no-workdir", namespace)["status"]["phase"] == "Succeeded"


def test_a_command_that_exits_at_once_fails_a_never_restarting_pod(core, namespace):
    core.create_namespaced_pod(namespace, {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "exits"},
        "spec": {"restartPolicy": "Never", "containers": [{
            "name": "main", "image": "python:3.11", "command": [sys.executable, "-c", "raise SystemExit(3)"]}]}})
    wait_for(lambda: read_pod(core, "exits", namespace)["status"].get("phase") == "Failed", timeout=60,
             message="the pod to fail")
    terminated = container_state(core, "exits", namespace)["state"]["terminated"]
    assert (terminated["exitCode"], terminated["reason"]) == (3, "Error")
