"""Worker Pods in a namespace that enforces the ``restricted`` Pod Security Standard.

The admission is the API server's own PodSecurity plugin (on by default; the local control plane,
src/graphserving/dev/cluster.py, adds plugins on top of the defaults), which checks Pods when they
are created: a Pod the ReplicaSet controller cannot create shows up as a FailedCreate Event only.
"""

from __future__ import annotations

import copy
import json
import time
import uuid

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException
from op_cluster import create_gs, pods, standin_spec
from op_helpers import spec_dict

from graphserving.contract import graphserving_types as api
from graphserving.dev.pytest_fixtures import wait_for
from graphserving.operator import children

pytestmark = pytest.mark.cluster

RESTRICTED = {"pod-security.kubernetes.io/enforce": "restricted", "pod-security.kubernetes.io/enforce-version": "latest"}
SIDECAR = {"name": "sidecar", "image": "busybox:1.37", "command": ["sleep", "infinity"],
           "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}}


def _pod_from(deployment: dict, namespace: str) -> dict:
    template = copy.deepcopy(deployment["spec"]["template"])
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {**template["metadata"], "name": f"probe-{uuid.uuid4().hex[:8]}", "namespace": namespace},
            "spec": template["spec"]}


def _without_security_contexts(pod: dict) -> dict:
    pod = copy.deepcopy(pod)
    pod["spec"].pop("securityContext", None)
    for container in pod["spec"]["containers"]:
        container.pop("securityContext", None)
    return pod


def _refusal(core: client.CoreV1Api, pod: dict) -> str | None:
    """The API server's message when it refuses ``pod`` (server-side dry run), None when admitted."""
    try:
        core.create_namespaced_pod(pod["metadata"]["namespace"], pod, dry_run="All")
    except ApiException as exc:
        return f"{exc.status} {json.loads(exc.body)['message']}"
    return None


def _restrict(core: client.CoreV1Api, namespace: str, probe: dict) -> None:
    """Label ``namespace`` restricted and wait until the admission enforces it (it reads namespace
    labels through an informer): ``probe``, a Pod without security contexts, is refused."""
    core.patch_namespace(namespace, {"metadata": {"labels": RESTRICTED}})
    wait_for(lambda: _refusal(core, _without_security_contexts(probe)), timeout=30,
             message=f"PodSecurity enforcing restricted in {namespace}")


def _worker_deployment(namespace: str, **pod_template) -> dict:
    gs = api.GraphServing.model_validate({
        "metadata": {"name": "smol", "namespace": namespace, "uid": "u-1", "generation": 1},
        "spec": spec_dict(model={**spec_dict()["model"], "source": {"pvc": {"claimName": "weights"}}},
                          podTemplate=pod_template),
    })
    return children.deployment(gs, "r", 1, gs.spec.graphs.to_worker())


def test_the_worker_pod_is_admitted_by_a_restricted_namespace_and_refused_without_its_security_context(
        core, namespace):
    for obj in children.worker_rbac(namespace)[:1]:  # the Pod's ServiceAccount must exist to admit it
        core.create_namespaced_service_account(namespace, obj)
    pod = _pod_from(_worker_deployment(namespace, containers=[SIDECAR]), namespace)
    _restrict(core, namespace, pod)

    assert _refusal(core, pod) is None
    refusal = _refusal(core, _without_security_contexts(pod))
    assert refusal.startswith('403 pods "probe-') and 'violates PodSecurity "restricted:latest"' in refusal
    for broken in ("allowPrivilegeEscalation != false", "unrestricted capabilities", "runAsNonRoot != true",
                   "seccompProfile"):
        assert broken in refusal, refusal


def test_a_sidecar_without_its_own_security_context_is_refused_by_a_restricted_namespace(core, namespace):
    for obj in children.worker_rbac(namespace)[:1]:
        core.create_namespaced_service_account(namespace, obj)
    bare = {"name": "sidecar", "image": "busybox:1.37"}
    pod = _pod_from(_worker_deployment(namespace, containers=[bare]), namespace)
    _restrict(core, namespace, _pod_from(_worker_deployment(namespace), namespace))
    refusal = _refusal(core, pod)
    assert refusal is not None and 'container "sidecar" must set securityContext.allowPrivilegeEscalation=false' in refusal


@pytest.mark.slow
def test_the_operator_creates_admitted_worker_pods_in_a_restricted_namespace(core, apps, custom, namespace,
                                                                             operator, tmp_path):
    for obj in children.worker_rbac(namespace)[:1]:  # for the probe only; the operator applies it too
        core.create_namespaced_service_account(namespace, obj)
    _restrict(core, namespace, _pod_from(_worker_deployment(namespace), namespace))
    go_dir = tmp_path / "go"
    go_dir.mkdir()
    create_gs(custom, namespace, "locked", standin_spec(go_dir, replicas=2))

    created = wait_for(lambda: len(p := pods(core, namespace, "locked")) == 2 and p, timeout=90,
                       message=lambda: f"two worker Pods; events: {_warnings(core, namespace)}; {operator.log()}")
    for pod in created:
        assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
        assert pod["spec"]["containers"][0]["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    time.sleep(2)  # the controllers' Events are posted asynchronously
    assert _warnings(core, namespace) == []


def _warnings(core: client.CoreV1Api, namespace: str) -> list[str]:
    return [f"{e.involved_object.kind}/{e.involved_object.name} {e.reason}: {e.message}"
            for e in core.list_namespaced_event(namespace).items
            if e.type == "Warning" and e.reason == "FailedCreate"]
