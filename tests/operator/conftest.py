"""Fixtures for the operator tests: the installed API, clients, and the operator as a process."""

import pytest
from op_helpers import make_report


@pytest.fixture(scope="session")
def installed(kube_api):
    """The GraphServing CRD and the worker admission policy, once per session (the local cluster
    installs the Gateway API's own CRDs)."""
    from op_cluster import install_api

    install_api(kube_api)
    return kube_api


@pytest.fixture
def go_dir(tmp_path):
    """A scratch folder per test for the stand-in workers (``op_cluster.standin_spec``)."""
    d = tmp_path / "go"
    d.mkdir()
    return d


@pytest.fixture
def custom(installed):
    from kubernetes import client

    return client.CustomObjectsApi(installed)


@pytest.fixture
def core(installed):
    from kubernetes import client

    return client.CoreV1Api(installed)


@pytest.fixture
def apps(installed):
    from kubernetes import client

    return client.AppsV1Api(installed)


@pytest.fixture
def operator(cluster, namespace, installed, tmp_path):
    """The operator as a subprocess watching the test's namespace; its log is printed afterwards."""
    from op_cluster import OperatorProcess

    proc = OperatorProcess(cluster.kubeconfig, namespace, tmp_path / "operator.log").start()
    yield proc
    proc.stop()
    print(f"\n--- operator log ({namespace}) ---\n{proc.log()}")


@pytest.fixture
def report_factory():
    return make_report
