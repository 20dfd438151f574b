"""Fixtures for the control-plane tests: typed API groups on the session's cluster."""

import pytest
from kubernetes import client


@pytest.fixture
def core(kube_api):
    return client.CoreV1Api(kube_api)


@pytest.fixture
def apps(kube_api):
    return client.AppsV1Api(kube_api)
