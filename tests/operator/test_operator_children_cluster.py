"""The operator's children against the real control plane: refusals, removal and repair.

Workers are the stand-in worker process (tests/operator/standin_worker.py, a test fixture).
"""

from __future__ import annotations

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException
from op_cluster import create_gs, events_for, get_gs, gs_condition, patch_gs, standin_spec

from graphserving.dev.pytest_fixtures import wait_for
from graphserving.operator import naming, routing

pytestmark = pytest.mark.cluster



@pytest.mark.slow
def test_a_deployment_the_api_server_refuses_is_reported_in_status_and_an_event(
        custom, core, apps, namespace, operator, go_dir):
    spec = standin_spec(go_dir)
    # podTemplate.volumeMounts is a pass-through list (validated when the Deployment is applied): a
    # mount of a volume the Pod does not have. It follows the operator's scratch mount.
    spec["podTemplate"]["volumeMounts"] = [{"name": "missing", "mountPath": "/data"}]
    create_gs(custom, namespace, "refused", spec)

    gs = wait_for(lambda: (g := get_gs(custom, namespace, "refused")).get("status", {}).get("lastFailure") and g,
                  timeout=60, message=lambda: f"status.lastFailure; {operator.log()}")
    failure = gs["status"]["lastFailure"]
    rev = gs["status"]["currentRevision"]
    assert failure["reason"] == "DeploymentRejected" and failure["revision"] == rev
    assert failure["message"].startswith(f"Deployment refused-{rev}: 422 ")
    assert 'spec.template.spec.containers[0].volumeMounts[1].name: Not found: "missing"' in failure["message"]
    reconciled = gs_condition(gs, "Reconciled")
    assert (reconciled["status"], reconciled["reason"]) == ("False", "DeploymentRejected")
    assert gs["status"]["observedGeneration"] == gs["metadata"]["generation"]
    assert gs_condition(gs, "Ready")["status"] == "False"
    wait_for(lambda: "DeploymentRejected" in events_for(core, namespace, "refused"), timeout=30,
             message="a DeploymentRejected Event on the GraphServing")
    # The Services did not wait for the Deployment.
    core.read_namespaced_service("refused", namespace)

    # Fixing the spec clears the refusal; the Deployment of the fixed revision exists.
    patch_gs(custom, namespace, "refused", {"spec": {"podTemplate": {"volumeMounts": None}}})
    gs = wait_for(lambda: (g := get_gs(custom, namespace, "refused"))["status"].get("observedGeneration")
                  == g["metadata"]["generation"] and gs_condition(g, "Reconciled")["reason"] != "DeploymentRejected"
                  and g, timeout=60, message=lambda: f"the refusal cleared; {operator.log()}")
    fixed = gs["status"]["currentRevision"]
    assert fixed != rev
    assert gs_condition(gs, "Reconciled")["reason"] == "GraphModeWithoutGPU"
    apps.read_namespaced_deployment(f"refused-{fixed}", namespace)
    assert events_for(core, namespace, "refused").count("DeploymentRejected") == 1


def _current_revision(custom, namespace, name):
    """The GraphServing's status.currentRevision, once written: a reconcile applies the children
    (the HTTPRoute among them) before it writes the status, so the route can be seen first."""
    return wait_for(lambda: get_gs(custom, namespace, name).get("status", {}).get("currentRevision"), timeout=60,
                    message=f"{name}: status.currentRevision")


def _route(custom, namespace, name):
    try:
        return custom.get_namespaced_custom_object(routing.GROUP, routing.VERSION, namespace, routing.PLURAL, name)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


@pytest.mark.slow
def test_unsetting_routing_deletes_the_httproute_but_not_someone_elses(custom, namespace, operator, go_dir):
    create_gs(custom, namespace, "routed", standin_spec(go_dir, routing={"parentRefs": [{"name": "gw"}]}))
    route = wait_for(lambda: _route(custom, namespace, "routed"), timeout=60,
                     message=lambda: f"the HTTPRoute; {operator.log()}")
    rev = _current_revision(custom, namespace, "routed")
    # the real HTTPRoute schema defaults group and kind
    assert route["spec"]["rules"][0]["backendRefs"] == [
        {"group": "", "kind": "Service", "name": f"routed-{rev}", "port": 8000, "weight": 100}]
    # A route of the same name as a GraphServing without routing, made by someone else, stays.
    theirs = {"apiVersion": f"{routing.GROUP}/{routing.VERSION}", "kind": "HTTPRoute",
              "metadata": {"name": "unrouted"}, "spec": {"parentRefs": [{"name": "gw"}]}}
    theirs = custom.create_namespaced_custom_object(routing.GROUP, routing.VERSION, namespace, routing.PLURAL, theirs)
    create_gs(custom, namespace, "unrouted", standin_spec(go_dir))

    patch_gs(custom, namespace, "routed", {"spec": {"routing": None}})
    wait_for(lambda: _route(custom, namespace, "routed") is None, timeout=60,
             message=lambda: f"the HTTPRoute deleted; {operator.log()}")
    wait_for(lambda: (g := get_gs(custom, namespace, "unrouted")).get("status", {}).get("observedGeneration")
             == g["metadata"]["generation"], timeout=60, message="the second GraphServing reconciled")
    assert _route(custom, namespace, "unrouted")["spec"] == theirs["spec"]


@pytest.mark.slow
def test_children_deleted_or_edited_by_hand_are_restored(custom, core, namespace, operator, go_dir):
    create_gs(custom, namespace, "repair", standin_spec(go_dir, routing={"parentRefs": [{"name": "gw"}]}))
    policy = client.PolicyV1Api(core.api_client)
    wait_for(lambda: _route(custom, namespace, "repair"), timeout=60, message=lambda: f"the HTTPRoute; {operator.log()}")
    rev = _current_revision(custom, namespace, "repair")
    service = core.read_namespaced_service("repair", namespace)
    pdb = policy.read_namespaced_pod_disruption_budget("repair", namespace)

    core.delete_namespaced_service("repair", namespace)
    core.delete_namespaced_service(f"repair-{rev}", namespace)
    policy.delete_namespaced_pod_disruption_budget("repair", namespace)
    custom.patch_namespaced_custom_object(
        routing.GROUP, routing.VERSION, namespace, routing.PLURAL, "repair",
        {"spec": {"rules": [{"backendRefs": [{"name": "elsewhere", "port": 80, "weight": 100}]}]}},
        _content_type="application/merge-patch+json")

    def restored(read):
        try:
            return read()
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    again = wait_for(lambda: restored(lambda: core.read_namespaced_service("repair", namespace)), timeout=60,
                     message=lambda: f"the stable Service recreated; {operator.log()}")
    assert again.metadata.uid != service.metadata.uid
    assert again.spec.selector == naming.selector_labels("repair")
    wait_for(lambda: restored(lambda: core.read_namespaced_service(f"repair-{rev}", namespace)), timeout=60,
             message="the revision Service recreated")
    again = wait_for(lambda: restored(lambda: policy.read_namespaced_pod_disruption_budget("repair", namespace)),
                     timeout=60, message="the PodDisruptionBudget recreated")
    assert again.metadata.uid != pdb.metadata.uid and again.spec.min_available == 1
    wait_for(lambda: _route(custom, namespace, "repair")["spec"]["rules"][0]["backendRefs"]
             == [{"group": "", "kind": "Service", "name": f"repair-{rev}", "port": 8000, "weight": 100}], timeout=60,
             message="the HTTPRoute's weights written again")
