"""Fixtures for the gateway and Prometheus tests: the core API group on the session's cluster."""

import pytest
from kubernetes import client


@pytest.fixture
def core(kube_api):
    return client.CoreV1Api(kube_api)
