"""pytest plugin: the local control plane as fixtures (``pytest_plugins = ["graphserving.dev.pytest_fixtures"]``).

Fixtures:

* ``cluster`` (session): a :class:`~graphserving.dev.cluster.LocalCluster` with etcd,
  kube-apiserver, controller-manager, scheduler and the development node agent, started once per
  session and stopped at its end (processes die with the test session too). Its state directory
  (logs of every component and pod) is removed when the session passes and kept, with its path
  printed, when a test failed.
* ``kube_api`` (session): a ``kubernetes.client.ApiClient`` with the admin kubeconfig.
* ``namespace`` (per test): a fresh namespace (with its ``default`` ServiceAccount), deleted after.
* ``kwok_cluster`` (session): kwok started against ``cluster`` for fake nodes (see
  :mod:`graphserving.dev.kwok`: its stages never set readiness-gate conditions).
* ``gateway`` (session): Traefik serving the Gateway ``graphserving-gateway/graphserving`` of
  ``cluster`` on a loopback port (:mod:`graphserving.dev.gateway`).
* ``prometheus`` (session): Prometheus discovering ``cluster``'s Pods, scraping every second
  (:mod:`graphserving.dev.prometheus`).

``cluster`` has the Gateway API's standard-channel CRDs installed (:mod:`graphserving.dev.gateway_api`).

Tests that use the control plane are marked ``@pytest.mark.cluster``. Without binaries they are
skipped with the reason, unless ``GRAPHSERVING_REQUIRE_CLUSTER`` is set (CI), where a missing
binary is an error. ``GRAPHSERVING_BUILD_CLUSTER=1`` builds missing binaries at session start;
``gateway`` and ``prometheus`` build theirs (traefik, prometheus) when either variable is set, and
skip naming the build command otherwise.
"""

from __future__ import annotations

import os
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from graphserving.dev import binaries
from graphserving.dev import cluster as cluster_mod

T = TypeVar("T")
CONTROL_PLANE = ("etcd", *binaries.KUBERNETES_COMPONENTS)


def _required() -> bool:
    return os.environ.get("GRAPHSERVING_REQUIRE_CLUSTER", "").lower() not in ("", "0", "false", "no")


def _missing_reason() -> str | None:
    missing = binaries.missing_components(CONTROL_PLANE)
    if not missing:
        return None
    return (f"control-plane binaries missing ({', '.join(missing)}) in {binaries.cache_dir() / 'bin'}: "
            "run `graphserving dev build` (or set KUBEBUILDER_ASSETS)")


def pytest_collection_modifyitems(config, items) -> None:
    if os.environ.get("GRAPHSERVING_BUILD_CLUSTER") or _required():
        return
    reason = _missing_reason()
    if reason:
        for item in items:
            if item.get_closest_marker("cluster"):
                item.add_marker(pytest.mark.skip(reason=reason))


def wait_for(predicate: Callable[[], T], timeout: float = 60.0, interval: float = 0.25,
             message: str | Callable[[], str] = "condition") -> T:
    """Poll ``predicate`` until it returns a truthy value and return that value.

    Exceptions from the predicate count as "not yet". Raises ``TimeoutError`` naming
    ``message`` (a string or a callable giving the current state) and the last exception.
    """
    deadline = time.monotonic() + timeout
    last_exc: BaseException | None = None
    while True:
        try:
            value = predicate()
            if value:
                return value
        except Exception as exc:  # noqa: BLE001
            last_exc = exc
        if time.monotonic() >= deadline:
            text = message() if callable(message) else message
            suffix = f"; last error: {type(last_exc).__name__}: {last_exc}" if last_exc else ""
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {text}{suffix}")
        time.sleep(interval)


def condition_status(obj: dict, condition_type: str) -> str | None:
    """The ``status`` of condition ``condition_type`` in ``obj['status']['conditions']`` (None if absent)."""
    for cond in (obj.get("status") or {}).get("conditions") or []:
        if cond.get("type") == condition_type:
            return cond.get("status")
    return None


@pytest.fixture(scope="session")
def cluster(request) -> Iterator[cluster_mod.LocalCluster]:
    """The session's local control plane with the development node agent."""
    reason = _missing_reason()
    if reason and os.environ.get("GRAPHSERVING_BUILD_CLUSTER"):
        binaries.ensure_binaries(CONTROL_PLANE)
        reason = _missing_reason()
    if reason:
        if _required():
            pytest.fail(f"GRAPHSERVING_REQUIRE_CLUSTER is set but {reason}", pytrace=False)
        pytest.skip(reason)
    state_dir = Path(tempfile.mkdtemp(prefix="graphserving-cluster-"))
    local = cluster_mod.LocalCluster(state_dir, die_with_parent=True)
    try:
        local.start()
    except cluster_mod.ClusterError as exc:
        local.stop()
        pytest.fail(f"the local control plane did not start (state in {state_dir}): {exc}", pytrace=False)
    try:
        yield local
    finally:
        failed = request.session.testsfailed > 0
        local.stop(remove=not failed)
        if failed:
            print(f"\ncontrol-plane logs kept in {state_dir}/logs, pod logs in {state_dir}/node/pods")


@pytest.fixture(scope="session")
def kube_api(cluster):
    """An admin ``kubernetes.client.ApiClient`` for the session's cluster."""
    from kubernetes import config

    api = config.new_client_from_config(config_file=str(cluster.kubeconfig))
    yield api
    api.close()


@pytest.fixture
def namespace(kube_api) -> Iterator[str]:
    """A fresh namespace for one test (its ``default`` ServiceAccount exists); deleted afterwards."""
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    core = client.CoreV1Api(kube_api)
    name = f"t-{uuid.uuid4().hex[:10]}"
    core.create_namespace({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    wait_for(lambda: core.read_namespaced_service_account("default", name), timeout=60,
             message=f"ServiceAccount default in namespace {name}")
    yield name
    try:
        core.delete_namespace(name)
    except ApiException as exc:
        if exc.status != 404:
            raise


@pytest.fixture(scope="session")
def kwok_cluster(cluster) -> Iterator[Any]:
    """kwok managing fake nodes in the session's cluster (create them with ``kwok.fake_node``)."""
    from graphserving.dev import kwok

    if binaries.binary_path("kwok") is None:
        if _required():
            pytest.fail("GRAPHSERVING_REQUIRE_CLUSTER is set but kwok is not built", pytrace=False)
        pytest.skip("kwok is not built: run `graphserving dev build kwok`")
    with kwok.Kwok(cluster) as controller:
        yield controller


def require_binary(component: str) -> None:
    """Build ``component`` when missing and a build is asked for (CI, GRAPHSERVING_BUILD_CLUSTER); else skip."""
    if binaries.binary_path(component) is not None:
        return
    if _required() or os.environ.get("GRAPHSERVING_BUILD_CLUSTER"):
        binaries.ensure_binaries([component])
        return
    pytest.skip(f"{component} is not built: run `graphserving dev build {component}` "
                "(or set GRAPHSERVING_BUILD_CLUSTER=1)")


@pytest.fixture(scope="session")
def gateway(cluster) -> Iterator[Any]:
    """Traefik serving the Gateway API Gateway ``graphserving-gateway/graphserving`` of ``cluster``."""
    from graphserving.dev import gateway as gateway_mod
    from graphserving.dev import gateway_api

    require_binary("traefik")
    gateway_api.install_cached(cluster)  # again: a test may have applied a stand-in over them
    with gateway_mod.Gateway(cluster) as running:
        yield running


@pytest.fixture(scope="session")
def prometheus(cluster) -> Iterator[Any]:
    """Prometheus discovering ``cluster``'s Pods, scraping every second."""
    from graphserving.dev import prometheus as prometheus_mod

    require_binary("prometheus")
    with prometheus_mod.Prometheus(cluster, scrape_interval="1s", scrape_timeout="1s") as running:
        yield running
