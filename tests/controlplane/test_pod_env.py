"""The node agent computes a container's env as the kubelet does."""

import base64

import pytest

from graphserving.dev import pod_env

POD = {
    "metadata": {"name": "w-0", "namespace": "ns1", "uid": "u-1", "labels": {"app": "w"}},
    "spec": {"nodeName": "node-a", "serviceAccountName": "worker",
             "containers": [{"name": "main", "resources": {"limits": {"memory": "2Gi"}}}]},
    "status": {"podIP": "127.1.0.2", "podIPs": [{"ip": "127.1.0.2"}]},
}


def env_of(container, config_maps=None, secrets=None):
    return pod_env.resolve_env(POD, container, {"cpu": "8", "memory": "16Gi"},
                               lambda n: (config_maps or {}).get(n), lambda n: (secrets or {}).get(n))


def test_dollar_paren_references_expand_and_double_dollar_escapes():
    assert pod_env.expand("$(A)-$(B)-$$(A)", {"A": "1"}) == "1-$(B)-$(A)"


def test_downward_api_fields_resolve_from_the_pod():
    container = {"name": "main", "env": [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        {"name": "SA", "valueFrom": {"fieldRef": {"fieldPath": "spec.serviceAccountName"}}},
        {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
        {"name": "URL", "value": "http://$(POD_IP):8080"},
    ]}
    assert env_of(container) == {"POD_NAME": "w-0", "POD_NAMESPACE": "ns1", "POD_IP": "127.1.0.2",
                                 "NODE": "node-a", "SA": "worker", "APP": "w", "URL": "http://127.1.0.2:8080"}


def test_resource_field_ref_divides_and_defaults_to_node_allocatable():
    container = {"name": "main", "resources": {"limits": {"memory": "2Gi"}}, "env": [
        {"name": "MEM_MI", "valueFrom": {"resourceFieldRef": {"resource": "limits.memory", "divisor": "1Mi"}}},
        {"name": "CPUS", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu"}}},
    ]}
    assert env_of(container) == {"MEM_MI": "2048", "CPUS": "8"}


def test_config_map_and_secret_references_and_env_from():
    container = {"name": "main", "envFrom": [{"configMapRef": {"name": "cm"}, "prefix": "CM_"}], "env": [
        {"name": "PASSWORD", "valueFrom": {"secretKeyRef": {"name": "s", "key": "pw"}}},
    ]}
    env = env_of(container, {"cm": {"MODE": "fast"}}, {"s": {"pw": base64.b64encode(b"hunter2").decode()}})
    assert env == {"CM_MODE": "fast", "PASSWORD": "hunter2"}


def test_a_missing_required_key_names_the_variable():
    container = {"name": "main", "env": [
        {"name": "X", "valueFrom": {"configMapKeyRef": {"name": "nope", "key": "k"}}}]}
    with pytest.raises(pod_env.EnvError, match="env X: configmap 'nope' key 'k' not found"):
        env_of(container)


def test_a_container_without_command_is_refused_with_the_reason():
    with pytest.raises(pod_env.EnvError, match="no command"):
        pod_env.command_line({"name": "main", "image": "nginx"}, {})


def test_command_and_args_expand_env_references():
    container = {"name": "m", "command": ["python3", "-m", "http.server"], "args": ["--bind", "$(POD_IP)", "8080"]}
    assert pod_env.command_line(container, {"POD_IP": "127.1.0.9"}) == [
        "python3", "-m", "http.server", "--bind", "127.1.0.9", "8080"]
