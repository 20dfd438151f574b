"""The throwaway Go modules that build the pinned binaries from the module proxy."""

import pytest

from graphserving.dev import binaries

UPSTREAM = """\
module k8s.io/kubernetes

go 1.26.0

require (
\tk8s.io/api v0.0.0
\tk8s.io/client-go v0.0.0
)

replace (
\tk8s.io/api => ./staging/src/k8s.io/api
\tk8s.io/client-go => ./staging/src/k8s.io/client-go
\tk8s.io/streaming => ./staging/src/k8s.io/streaming
)

replace example.com/other => example.com/other v1.2.3
"""


def test_staging_modules_are_read_from_the_release_go_mod():
    assert binaries.staging_modules(UPSTREAM) == ["k8s.io/api", "k8s.io/client-go", "k8s.io/streaming"]


def test_a_go_mod_without_staging_replaces_is_an_error():
    with pytest.raises(binaries.BinaryError, match="staging"):
        binaries.staging_modules("module x\n\ngo 1.26.0\n")


def test_staging_modules_are_replaced_by_their_published_v0_tag():
    text = binaries.kubernetes_module_go_mod("v1.36.3", UPSTREAM)
    assert "require k8s.io/kubernetes v1.36.3" in text
    assert "\tk8s.io/client-go => k8s.io/client-go v0.36.3" in text
    assert "\tk8s.io/streaming => k8s.io/streaming v0.36.3" in text
    assert "go 1.26.0" in text
    assert "tool k8s.io/kubernetes/cmd/kube-apiserver" in text


def test_kubernetes_version_is_stamped_in_both_version_packages():
    flags = binaries.kubernetes_ldflags("v1.36.3", "2026-01-01T00:00:00Z")
    for package in ("k8s.io/client-go/pkg/version", "k8s.io/component-base/version"):
        assert f"-X {package}.gitVersion=v1.36.3" in flags
        assert f"-X {package}.gitMajor=1" in flags
        assert f"-X {package}.gitMinor=36" in flags


def test_binaries_are_cached_by_component_and_version(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAPHSERVING_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("KUBEBUILDER_ASSETS", raising=False)
    assert binaries.cached_path("kubectl") == tmp_path / "bin" / f"kubectl-{binaries.KUBERNETES_VERSION}" / "kubectl"
    assert binaries.missing_components(["etcd"]) == ["etcd"]


def test_kubebuilder_assets_replace_the_build_of_etcd_apiserver_and_kubectl(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAPHSERVING_CACHE_DIR", str(tmp_path / "cache"))
    assets = tmp_path / "assets"
    assets.mkdir()
    for name in ("etcd", "kube-apiserver", "kubectl"):
        (assets / name).write_text("#!/bin/sh\n")
        (assets / name).chmod(0o755)
    monkeypatch.setenv("KUBEBUILDER_ASSETS", str(assets))
    assert binaries.binary_path("kube-apiserver") == assets / "kube-apiserver"
    assert binaries.missing_components(["etcd", "kube-apiserver", "kubectl", "kube-scheduler"]) == ["kube-scheduler"]


def test_missing_go_toolchain_is_reported_clearly(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(binaries.BinaryError, match="Go toolchain is not on PATH"):
        binaries._find_go()
