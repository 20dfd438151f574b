"""The worker admission policy (manifests/policy/worker-own-pod.yaml) on the real API server: what a
worker's own token may change on its own Pod."""

from __future__ import annotations

import pytest
from kubernetes import client, config
from kubernetes.client.rest import ApiException

from graphserving.dev.pytest_fixtures import wait_for
from graphserving.operator import children, naming

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


@pytest.fixture
def worker_api(cluster, core, namespace, installed):
    """(CoreV1Api with the token of ServiceAccount graphserving-worker bound to Pod worker-a, the Pod)."""
    rbac = client.RbacAuthorizationV1Api(installed)
    for obj in children.worker_rbac(namespace):
        {"ServiceAccount": lambda o: core.create_namespaced_service_account(namespace, o),
         "Role": lambda o: rbac.create_namespaced_role(namespace, o),
         "RoleBinding": lambda o: rbac.create_namespaced_role_binding(namespace, o)}[obj["kind"]](obj)
    pod = core.create_namespaced_pod(namespace, {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "worker-a"},
        "spec": {"serviceAccountName": naming.WORKER_SERVICE_ACCOUNT, "nodeSelector": {"no-such-node": "x"},
                 "containers": [{"name": "c", "image": "none", "command": ["true"]}]}})
    token = core.create_namespaced_service_account_token(naming.WORKER_SERVICE_ACCOUNT, namespace, {
        "spec": {"expirationSeconds": 600, "boundObjectRef": {
            "apiVersion": "v1", "kind": "Pod", "name": "worker-a", "uid": pod.metadata.uid}}}).status.token
    cfg = client.Configuration()
    config.load_kube_config(config_file=str(cluster.kubeconfig), client_configuration=cfg)
    cfg.cert_file = cfg.key_file = None
    cfg.api_key = {"authorization": f"Bearer {token}"}
    return client.CoreV1Api(client.ApiClient(cfg)), pod


def _patch(api, namespace, metadata):
    return api.patch_namespaced_pod("worker-a", namespace, {"metadata": metadata},
                                    _content_type="application/merge-patch+json")


@pytest.mark.parametrize(
    "metadata",
    [
        {"finalizers": ["example.com/keep-me"]},
        {"ownerReferences": []},
    ],
    ids=["add-a-finalizer", "drop-owner-references"],
)
def test_a_worker_may_not_change_its_pods_finalizers_or_owners(worker_api, core, namespace, metadata):
    api, pod = worker_api
    if "ownerReferences" in metadata:  # give the Pod an owner to drop (as a ReplicaSet would)
        owner = core.create_namespaced_config_map(namespace, {"metadata": {"name": "owner"}})
        core.patch_namespaced_pod("worker-a", namespace, {"metadata": {"ownerReferences": [{
            "apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner.metadata.uid}]}})
    # The policy is active once the worker may not set another annotation (a new value each try: an
    # unchanged one is allowed).
    attempt = iter(range(10_000))

    def active():
        try:
            _patch(api, namespace, {"annotations": {naming.ANNOTATION_ACCEPTED_REPORT: f"x/{next(attempt)}"}})
        except ApiException as exc:
            return exc.status == 403
        return False

    wait_for(active, timeout=60, message="the worker admission policy enforced")
    _patch(api, namespace, {"annotations": {"graphserving.io/report": "{}"}})
    with pytest.raises(ApiException) as denied:
        _patch(api, namespace, metadata)
    assert denied.value.status == 403
    assert "may not change its Pod's labels, finalizers, owners or spec" in denied.value.body
    after = core.read_namespaced_pod("worker-a", namespace)
    assert not after.metadata.finalizers
    assert bool(after.metadata.owner_references) == ("ownerReferences" in metadata)
