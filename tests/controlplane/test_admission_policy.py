"""A ValidatingAdmissionPolicy (CEL) is enforced by the real API server."""

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from graphserving.dev.pytest_fixtures import wait_for

pytestmark = pytest.mark.cluster


def test_a_config_map_violating_the_policy_is_denied_with_its_message(kube_api, core, namespace):
    admission = client.AdmissionregistrationV1Api(kube_api)
    policy = f"no-forbidden-{namespace}"
    admission.create_validating_admission_policy({
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": policy},
        "spec": {"failurePolicy": "Fail",
                 "matchConstraints": {"resourceRules": [{"apiGroups": [""], "apiVersions": ["v1"],
                                                         "operations": ["CREATE", "UPDATE"],
                                                         "resources": ["configmaps"]}]},
                 "validations": [{"expression": "!has(object.data) || !('forbidden' in object.data)",
                                  "message": "configmaps may not carry the key 'forbidden'"}]}})
    admission.create_validating_admission_policy_binding({
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": policy},
        "spec": {"policyName": policy, "validationActions": ["Deny"],
                 "matchResources": {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}}}}})
    try:
        attempt = iter(range(10_000))

        def denied():
            body = {"apiVersion": "v1", "kind": "ConfigMap",
                    "metadata": {"name": f"probe-{next(attempt)}"}, "data": {"forbidden": "x"}}
            try:
                core.create_namespaced_config_map(namespace, body)
            except ApiException as exc:
                return exc
            return None  # the policy is not active yet: its informer takes a moment

        rejection = wait_for(denied, message="the policy to deny the ConfigMap")
        assert rejection.status == 422
        assert "configmaps may not carry the key 'forbidden'" in rejection.body
        assert f"ValidatingAdmissionPolicy '{policy}'" in rejection.body

        allowed = core.create_namespaced_config_map(namespace, {"apiVersion": "v1", "kind": "ConfigMap",
                                                                "metadata": {"name": "fine"}, "data": {"ok": "1"}})
        assert allowed.metadata.name == "fine"
    finally:
        admission.delete_validating_admission_policy_binding(policy)
        admission.delete_validating_admission_policy(policy)
