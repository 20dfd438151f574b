"""A pod's process gets a TokenRequest token bound to its Pod, through KUBECONFIG."""

import json
import sys

import pytest
from kubernetes import client

from cp_helpers import read_pod
from graphserving.dev import cli
from graphserving.dev import cluster as cluster_mod
from graphserving.dev.pytest_fixtures import wait_for

pytestmark = pytest.mark.cluster

SCRIPT = """
import json, os
from kubernetes import client, config
config.load_config()
api = client.ApiClient()
me = client.CoreV1Api(api).read_namespaced_pod(os.environ["POD_NAME"], os.environ["POD_NAMESPACE"],
                                               _preload_content=False)
review = client.AuthenticationV1Api(api).create_self_subject_review(
    {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}, _preload_content=False)
print("RESULT " + json.dumps({"uid": json.loads(me.data)["metadata"]["uid"],
                              "user": json.loads(review.data)["status"]["userInfo"],
                              "server": api.configuration.host,
                              "service": [os.environ["KUBERNETES_SERVICE_HOST"],
                                          os.environ["KUBERNETES_SERVICE_PORT"]]}),
      flush=True)
"""


@pytest.fixture
def whoami(kube_api, core, namespace, cluster):
    """A finished pod that read its own Pod through its credentials: (pod, what it printed)."""
    rbac = client.RbacAuthorizationV1Api(kube_api)
    rbac.create_namespaced_role(namespace, {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": "read-pods"},
        "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]}]})
    rbac.create_namespaced_role_binding(namespace, {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": {"name": "read-pods"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "read-pods"},
        "subjects": [{"kind": "ServiceAccount", "name": "default", "namespace": namespace}]})
    core.create_namespaced_pod(namespace, {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "whoami"},
        "spec": {"restartPolicy": "Never", "containers": [{
            "name": "main", "image": "python:3.11", "command": [sys.executable, "-c", SCRIPT],
            "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                    {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}]}]}})
    pod = wait_for(lambda: (p := read_pod(core, "whoami", namespace))["status"].get("phase") in ("Succeeded", "Failed") and p,
                   timeout=90, message="the whoami pod to finish")
    log = cli.pod_log_path(cluster.state_dir, "whoami", namespace, "main").read_text()
    assert pod["status"]["phase"] == "Succeeded", log
    return pod, json.loads(next(line for line in log.splitlines() if line.startswith("RESULT "))[len("RESULT "):])


def test_the_process_reads_its_own_pod_as_its_service_account(whoami, namespace):
    pod, result = whoami
    assert result["uid"] == pod["metadata"]["uid"]
    assert result["user"]["username"] == f"system:serviceaccount:{namespace}:default"
    assert result["user"]["extra"]["authentication.kubernetes.io/pod-name"] == ["whoami"]
    assert result["user"]["extra"]["authentication.kubernetes.io/pod-uid"] == [pod["metadata"]["uid"]]


def test_pods_reach_the_api_server_at_the_kubernetes_service_ip(cluster, whoami):
    if not cluster.pod_network["namespaced"]:
        pytest.skip(f"no pod network namespace: {cluster.pod_network['warning']}")
    _, result = whoami
    # The `kubernetes` Service's ClusterIP inside the pod's namespace, where the node agent's
    # forwarder relays to the API server; the serving certificate names that address.
    assert result["server"] == f"https://{cluster_mod.KUBERNETES_SERVICE_IP}:443"
    assert result["service"] == [cluster_mod.KUBERNETES_SERVICE_IP, "443"]
