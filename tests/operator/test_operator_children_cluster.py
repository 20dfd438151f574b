"""The operator's children against the real control plane: refusals, removal and repair.

Workers are the stand-in worker process (tests/operator/standin_worker.py, a test fixture).
"""

from __future__ import annotations

import pytest
from op_cluster import create_gs, events_for, get_gs, gs_condition, patch_gs, standin_spec

from graphserving.dev.pytest_fixtures import wait_for

pytestmark = pytest.mark.cluster


@pytest.fixture
def go_dir(tmp_path):
    d = tmp_path / "go"
    d.mkdir()
    return d


@pytest.mark.slow
def test_a_deployment_the_api_server_refuses_is_reported_in_status_and_an_event(
        custom, core, apps, namespace, operator, go_dir):
    spec = standin_spec(go_dir)
    good_env = list(spec["podTemplate"]["env"])
    # podTemplate.env is a pass-through list (validated when the Deployment is applied): no name.
    # It follows the operator's 4 entries (POD_NAME, POD_NAMESPACE, POD_IP, the worker config).
    spec["podTemplate"]["env"] = [*good_env, {"value": "orphan"}]
    create_gs(custom, namespace, "refused", spec)

    gs = wait_for(lambda: (g := get_gs(custom, namespace, "refused")).get("status", {}).get("lastFailure") and g,
                  timeout=60, message=lambda: f"status.lastFailure; {operator.log()}")
    failure = gs["status"]["lastFailure"]
    rev = gs["status"]["currentRevision"]
    assert failure["reason"] == "DeploymentRejected" and failure["revision"] == rev
    assert failure["message"].startswith(f"Deployment refused-{rev}: 422 ")
    assert f"spec.template.spec.containers[0].env[{len(good_env) + 4}].name: Required value" in failure["message"]
    warning = gs_condition(gs, "Warning")
    assert (warning["status"], warning["reason"]) == ("True", "DeploymentRejected")
    assert gs["status"]["observedGeneration"] == gs["metadata"]["generation"]
    assert gs_condition(gs, "Ready")["status"] == "False"
    wait_for(lambda: "DeploymentRejected" in events_for(core, namespace, "refused"), timeout=30,
             message="a DeploymentRejected Event on the GraphServing")
    # The Services did not wait for the Deployment.
    core.read_namespaced_service("refused", namespace)

    # Fixing the spec clears the Warning condition; the Deployment of the fixed revision exists.
    patch_gs(custom, namespace, "refused", {"spec": {"podTemplate": {"env": good_env}}})
    gs = wait_for(lambda: (g := get_gs(custom, namespace, "refused"))["status"].get("observedGeneration")
                  == g["metadata"]["generation"] and gs_condition(g, "Warning")["reason"] != "DeploymentRejected" and g,
                  timeout=60, message=lambda: f"the Warning condition cleared; {operator.log()}")
    fixed = gs["status"]["currentRevision"]
    assert fixed != rev
    assert gs_condition(gs, "Warning")["reason"] == "GraphModeWithoutGPU"
    apps.read_namespaced_deployment(f"refused-{fixed}", namespace)
    assert events_for(core, namespace, "refused").count("DeploymentRejected") == 1
