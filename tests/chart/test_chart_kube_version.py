"""`helm template` renders without a cluster and without ``--kube-version``; the chart's
Kubernetes >= 1.30 requirement is checked against the cluster Helm knows (its discovery)."""

from __future__ import annotations

import yaml
from chart_helpers import CHART, run_helm


def _template(*args: str):
    return run_helm("template", "graphserving", str(CHART), "--namespace", "graphserving-system", *args, check=False)


def test_helm_template_renders_without_a_kube_version():
    proc = _template()
    assert proc.returncode == 0, proc.stderr
    kinds = {d["kind"] for d in yaml.safe_load_all(proc.stdout) if d}
    assert {"Deployment", "CustomResourceDefinition", "ValidatingAdmissionPolicy", "Pod"} <= kinds


def test_a_cluster_older_than_1_30_is_refused_by_name():
    # --api-versions with a kind stands in for discovery, as `helm install` gets it from a cluster.
    proc = _template("--api-versions", "v1/Pod", "--kube-version", "1.29.4")
    assert proc.returncode == 1
    assert ("this chart needs Kubernetes >= 1.30 (admissionregistration.k8s.io/v1 ValidatingAdmissionPolicy); "
            "the cluster runs v1.29.4") in proc.stderr


def test_a_cluster_of_1_30_or_later_renders():
    for version in ("1.30.0", "1.36.3"):
        proc = _template("--api-versions", "v1/Pod", "--kube-version", version)
        assert proc.returncode == 0, proc.stderr
