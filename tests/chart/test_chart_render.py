"""The chart renders the operator, its RBAC, the API and the optional extras as documented."""

from __future__ import annotations

import json

import pytest
import yaml
from chart_helpers import CHART, KUBE_VERSION, REPO, find, one, render, run_helm

from graphserving.operator import children, crd

CRD_NAME = "graphservings.graphserving.io"
ALL_FLAGS = ("serviceMonitor.enabled=true", "podMonitor.enabled=true", "dashboards.enabled=true")


def _manifest_docs(path: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((REPO / path).read_text()) if d]


def _rules(objects: list[dict], kind: str) -> list[dict]:
    return [rule for o in find(objects, kind) for rule in o["rules"]]


def test_helm_lint_passes_with_defaults_and_with_every_optional_part_on():
    assert "0 chart(s) failed" in run_helm("lint", str(CHART), "--kube-version", KUBE_VERSION).stdout
    args = [f"--set={s}" for s in (*ALL_FLAGS, "test.resolve=endpointslices", "operator.watchNamespaces={a,b}")]
    assert "0 chart(s) failed" in run_helm("lint", str(CHART), "--kube-version", KUBE_VERSION, *args).stdout


def test_default_render_holds_the_operator_its_api_and_its_test():
    kinds = sorted(o["kind"] for o in render())
    assert kinds == sorted([
        "CustomResourceDefinition", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding",
        "Deployment", "Service", "PodDisruptionBudget", "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding", "Pod",
    ])


def test_the_crd_is_the_generated_one_annotated_to_be_kept():
    rendered = one(render(), "CustomResourceDefinition")
    expected = crd.crd()
    expected["metadata"]["annotations"] = {"helm.sh/resource-policy": "keep"}
    assert rendered == expected


def test_the_crd_can_be_left_out_or_left_unkept():
    assert find(render("crds.install=false"), "CustomResourceDefinition") == []
    assert "annotations" not in one(render("crds.keep=false"), "CustomResourceDefinition")["metadata"]


def test_the_operator_runs_its_console_script_with_leader_election_on_the_pod_ip():
    objects = render()
    deployment = one(objects, "Deployment", "graphserving-operator")
    assert deployment["spec"]["replicas"] == 2
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["graphserving-operator"]
    assert container["args"] == [
        "run", "--metrics-host=$(POD_IP)", "--metrics-port=8080", "--workers=4", "--log-level=info",
        "--leader-election", "--lease-name=graphserving-operator", "--lease-namespace=$(POD_NAMESPACE)",
    ]
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in container["env"]}
    assert env == {"POD_NAME": "metadata.name", "POD_NAMESPACE": "metadata.namespace", "POD_IP": "status.podIP"}
    leader_role = one(objects, "Role", "graphserving-operator-leader-election")
    assert leader_role["rules"][1]["resourceNames"] == ["graphserving-operator"]


def test_replicas_and_leader_election_follow_the_values():
    objects = render("operator.replicaCount=1", "operator.leaderElection.enabled=false")
    container = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert one(objects, "Deployment")["spec"]["replicas"] == 1
    assert "--no-leader-election" in container["args"] and "--leader-election" not in container["args"]
    assert find(objects, "Role") == [] and find(objects, "PodDisruptionBudget") == []


def test_the_operator_runs_non_root_with_a_read_only_root_filesystem():
    pod = one(render(), "Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    container = pod["containers"][0]
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]},
    }
    assert container["resources"]["requests"] == {"cpu": "100m", "memory": "128Mi"}
    assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]


def test_cluster_wide_rbac_is_the_plain_manifests_rbac():
    manifest = _manifest_docs("manifests/rbac/operator.yaml")
    chart = render()
    assert _rules(chart, "ClusterRole") == _rules(manifest, "ClusterRole")
    assert _rules(chart, "Role") == _rules(manifest, "Role")
    assert not any(r for r in _rules(chart, "ClusterRole") if "secrets" in r["resources"])


def test_watching_namespaces_replaces_the_cluster_role_by_a_role_in_each():
    objects = render("operator.watchNamespaces={team-a,team-b}")
    roles = {o["metadata"]["namespace"]: o for o in find(objects, "Role", "graphserving-operator")}
    assert sorted(roles) == ["team-a", "team-b"]
    cluster_role = one(objects, "ClusterRole")
    assert cluster_role["metadata"]["name"] == "graphserving-operator-discovery"
    assert {r for rule in cluster_role["rules"] for r in rule["resources"]} == {"customresourcedefinitions", "namespaces"}
    assert _rules(_manifest_docs("manifests/rbac/operator.yaml"), "ClusterRole") == roles["team-a"]["rules"] + cluster_role["rules"]
    args = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[-2:] == ["--namespace=team-a", "--namespace=team-b"]


def test_the_admission_policy_is_the_plain_manifests_policy_with_chart_labels():
    chart = render()
    for manifest in _manifest_docs("manifests/policy/worker-own-pod.yaml"):
        rendered = one(chart, manifest["kind"], manifest["metadata"]["name"])
        assert rendered["spec"] == manifest["spec"]
        assert rendered["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm"
        assert rendered["metadata"]["labels"]["app.kubernetes.io/component"] == manifest["metadata"]["labels"]["app.kubernetes.io/component"]


def test_pre_created_worker_identity_is_what_the_operator_applies():
    objects = render("workers.serviceAccountNamespaces={serving}")
    for expected in children.worker_rbac("serving"):
        rendered = one([o for o in objects if o["metadata"].get("namespace") == "serving"], expected["kind"], expected["metadata"]["name"])
        for field in ("rules", "roleRef", "subjects"):
            assert rendered.get(field) == expected.get(field)


def test_monitors_and_dashboards_render_only_when_enabled():
    default = render()
    assert not find(default, "ServiceMonitor") and not find(default, "PodMonitor") and not find(default, "ConfigMap")
    objects = render(*ALL_FLAGS)
    monitor = one(objects, "ServiceMonitor")
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics" and monitor["spec"]["endpoints"][0]["honorLabels"] is True
    pod_monitor = one(objects, "PodMonitor")
    assert pod_monitor["spec"]["selector"]["matchLabels"] == {
        "app.kubernetes.io/managed-by": "graphserving-operator", "app.kubernetes.io/component": "worker"}
    assert pod_monitor["spec"]["namespaceSelector"] == {"any": True}
    targets = {r["targetLabel"] for r in pod_monitor["spec"]["podMetricsEndpoints"][0]["relabelings"]}
    assert targets == {"graphserving", "revision", "namespace", "pod"}


def test_dashboards_are_configmaps_with_the_configured_sidecar_label():
    objects = render("dashboards.enabled=true", "dashboards.sidecarLabel=my_dashboards",
                     "dashboards.sidecarLabelValue=yes", "dashboards.namespace=monitoring")
    maps = find(objects, "ConfigMap")
    assert sorted(m["metadata"]["name"] for m in maps) == [
        "graphserving-dashboard-capacity", "graphserving-dashboard-graphs", "graphserving-dashboard-serving"]
    for m in maps:
        assert m["metadata"]["labels"]["my_dashboards"] == "yes"
        assert m["metadata"]["namespace"] == "monitoring"
        assert m["metadata"]["annotations"] == {"grafana_folder": "GraphServing"}
        (filename, text), = m["data"].items()
        assert json.loads(text) == json.loads((CHART / "dashboards" / filename).read_text())


def test_extra_objects_are_rendered_through_tpl(tmp_path):
    values = {"extraObjects": [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "{{ .Release.Name }}-extra"}, "data": {"a": "b"}},
        "apiVersion: v1\nkind: Secret\nmetadata:\n  name: {{ .Release.Name }}-pull\n",
    ]}
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    objects = render(values=path, release="demo")
    assert one(objects, "ConfigMap", "demo-extra")["data"] == {"a": "b"}
    assert one(objects, "Secret", "demo-pull")


def test_the_test_hook_sends_a_canary_prompt_to_the_configured_service():
    pod = one(render("test.graphServing.name=chat", "test.graphServing.namespace=llm", "test.graphServing.port=9000"), "Pod")
    assert pod["metadata"]["namespace"] == "llm"
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    container = pod["spec"]["containers"][0]
    assert container["command"] == ["graphserving"]
    assert container["args"][:5] == ["canary-prompt", "--service=chat", "--namespace=llm", "--port=9000", "--resolve=dns"]
    assert pod["spec"]["automountServiceAccountToken"] is False


def test_the_test_pod_takes_the_workers_api_key_from_its_secret():
    assert "env" not in one(render(), "Pod")["spec"]["containers"][0]
    container = one(render("test.apiKeySecretRef.name=llm-key"), "Pod")["spec"]["containers"][0]
    assert container["env"] == [{"name": "GRAPHSERVING_API_KEY",
                                 "valueFrom": {"secretKeyRef": {"name": "llm-key", "key": "api-key"}}}]


def test_endpointslice_resolution_gives_the_test_pod_read_access_to_endpointslices_only():
    objects = render("test.resolve=endpointslices", "test.graphServing.namespace=llm")
    role = one(objects, "Role", "graphserving-test-canary")
    assert role["metadata"]["namespace"] == "llm"
    assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list"]}]
    assert one(objects, "Pod")["spec"]["serviceAccountName"] == "graphserving-test-canary"
    for o in (role, one(objects, "RoleBinding", "graphserving-test-canary"), one(objects, "ServiceAccount", "graphserving-test-canary")):
        assert o["metadata"]["annotations"]["helm.sh/hook-delete-policy"] == "before-hook-creation,hook-succeeded"
    # The Pod outlives a passed test: `helm test --logs` reads its log afterwards.
    assert one(objects, "Pod")["metadata"]["annotations"]["helm.sh/hook-delete-policy"] == "before-hook-creation"


@pytest.mark.parametrize("flags", [(), ALL_FLAGS])
def test_every_object_carries_the_recommended_labels(flags):
    for o in render(*flags, "workers.serviceAccountNamespaces={x}"):
        labels = o["metadata"].get("labels") or {}
        missing = {"app.kubernetes.io/name", "app.kubernetes.io/part-of"} - set(labels)
        if o["kind"] != "CustomResourceDefinition":
            missing |= {"app.kubernetes.io/instance", "app.kubernetes.io/managed-by", "app.kubernetes.io/version",
                        "helm.sh/chart"} - set(labels)
        assert not missing, f"{o['kind']} {o['metadata']['name']} lacks {sorted(missing)}"


def test_an_image_digest_wins_over_the_tag():
    digest = "sha256:" + "ab" * 32
    container = one(render(f"operator.image.digest={digest}"), "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == f"ghcr.io/graphserving/operator@{digest}"
