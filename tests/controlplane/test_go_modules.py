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


TRAEFIK_UPSTREAM = """\
module github.com/traefik/traefik/v3

go 1.25.0

require github.com/abbot/go-http-auth v0.0.0-00010101000000-000000000000

// Containous forks
replace (
\tgithub.com/abbot/go-http-auth => github.com/containous/go-http-auth v0.4.1-0.20200324110947-a37a7636d23e // auth
\tgithub.com/gorilla/mux => github.com/containous/mux v0.0.0-20250523120546-41b6ec3aed59
)

replace github.com/mailgun/minheap => github.com/containous/minheap v0.0.0-20190809180810-6e71eb837595

exclude github.com/tencentcloud/tencentcloud-sdk-go v3.0.83+incompatible
"""


def test_go_mod_directives_reads_blocks_and_single_lines_without_comments():
    assert binaries.go_mod_directives(TRAEFIK_UPSTREAM, "replace") == [
        "github.com/abbot/go-http-auth => github.com/containous/go-http-auth v0.4.1-0.20200324110947-a37a7636d23e",
        "github.com/gorilla/mux => github.com/containous/mux v0.0.0-20250523120546-41b6ec3aed59",
        "github.com/mailgun/minheap => github.com/containous/minheap v0.0.0-20190809180810-6e71eb837595",
    ]
    assert binaries.go_mod_directives(TRAEFIK_UPSTREAM, "exclude") == [
        "github.com/tencentcloud/tencentcloud-sdk-go v3.0.83+incompatible"]


def test_the_traefik_module_repeats_the_releases_forks_and_excludes():
    text = binaries.traefik_module_go_mod("v3.6.12", TRAEFIK_UPSTREAM)
    assert "require github.com/traefik/traefik/v3 v3.6.12" in text
    assert "go 1.25.0" in text
    assert "\tgithub.com/gorilla/mux => github.com/containous/mux v0.0.0-20250523120546-41b6ec3aed59" in text
    assert "\tgithub.com/mailgun/minheap => github.com/containous/minheap v0.0.0-20190809180810-6e71eb837595" in text
    assert "exclude github.com/tencentcloud/tencentcloud-sdk-go v3.0.83+incompatible" in text
    assert "tool github.com/traefik/traefik/v3/cmd/traefik" in text


def test_a_traefik_release_with_a_local_replace_cannot_be_built_from_the_proxy():
    upstream = TRAEFIK_UPSTREAM + "\nreplace github.com/traefik/traefik/dynamic/ext => ./pkg/config/dynamic/ext\n"
    with pytest.raises(binaries.BinaryError, match=r"dynamic/ext => \./pkg/config/dynamic/ext"):
        binaries.traefik_module_go_mod("v3.7.13", upstream)


def test_traefik_and_prometheus_are_components_cached_by_version(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAPHSERVING_CACHE_DIR", str(tmp_path))
    assert binaries.cached_path("traefik") == tmp_path / "bin" / f"traefik-{binaries.TRAEFIK_VERSION}" / "traefik"
    assert binaries.cached_path("prometheus") == (
        tmp_path / "bin" / f"prometheus-{binaries.PROMETHEUS_VERSION}" / "prometheus")
    assert binaries.missing_components(["traefik", "prometheus"]) == ["traefik", "prometheus"]
    assert {"traefik", "prometheus"} <= set(binaries.ALL_COMPONENTS)
