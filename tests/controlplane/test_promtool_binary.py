"""promtool, the Prometheus linter the metric-name tests run, built from its Go module like the
control-plane binaries."""

import subprocess

import pytest

from graphserving.dev import binaries


def test_a_prometheus_release_maps_to_its_module_proxy_version():
    assert binaries.prometheus_module_version("v3.16.0") == "v0.316.0"
    assert binaries.prometheus_module_version("v3.5.2") == "v0.305.2"
    with pytest.raises(ValueError, match="vX.Y.Z"):
        binaries.prometheus_module_version("3.16.0")


def test_promtool_is_go_installed_from_the_prometheus_module_with_its_version_stamped():
    target, ldflags = binaries.go_install_target("promtool")
    assert target == f"github.com/prometheus/prometheus/cmd/promtool@{binaries.prometheus_module_version(binaries.PROMETHEUS_VERSION)}"
    assert f"-X github.com/prometheus/common/version.Version={binaries.PROMETHEUS_VERSION[1:]}" in ldflags
    assert "promtool" in binaries.ALL_COMPONENTS and "promtool" in binaries.GO_INSTALL_COMPONENTS


def test_promtool_is_cached_by_version(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAPHSERVING_CACHE_DIR", str(tmp_path))
    assert binaries.cached_path("promtool") == tmp_path / "bin" / f"promtool-{binaries.PROMETHEUS_VERSION}" / "promtool"
    assert binaries.missing_components(["promtool"]) == ["promtool"]


def test_the_cached_promtool_reports_the_pinned_release():
    path = binaries.binary_path("promtool")
    if path is None:
        pytest.skip("promtool is not built (python -m graphserving.dev.binaries promtool)")
    out = subprocess.run([str(path), "--version"], capture_output=True, text=True, timeout=30)
    assert out.stdout.splitlines()[0].startswith(f"promtool, version {binaries.PROMETHEUS_VERSION[1:]} ")


def test_prometheus_is_go_installed_from_the_same_module_and_release_as_promtool():
    target, ldflags = binaries.go_install_target("prometheus")
    module_version = binaries.prometheus_module_version(binaries.PROMETHEUS_VERSION)
    assert target == f"github.com/prometheus/prometheus/cmd/prometheus@{module_version}"
    assert f"-X github.com/prometheus/common/version.Version={binaries.PROMETHEUS_VERSION[1:]}" in ldflags
    assert binaries.component_version("prometheus") == binaries.component_version("promtool")
