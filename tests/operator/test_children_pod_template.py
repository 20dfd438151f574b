"""The worker Pod template: restricted security defaults, scratch for a read-only root filesystem,
and the ``spec.podTemplate`` fields merged or passed through (the built Deployment, pure)."""

from __future__ import annotations

import pydantic
import pytest
from op_helpers import spec_dict

from graphserving.contract import graphserving_types as api
from graphserving.operator import children

SIDECAR = {"name": "log-shipper", "image": "fluent/fluent-bit:3.2.4",
           "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}}
SPREAD = {"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "ScheduleAnyway",
          "labelSelector": {"matchLabels": {"graphserving.io/name": "smol"}}}


def _pod_spec(**pod_template) -> dict:
    gs = api.GraphServing.model_validate({
        "metadata": {"name": "smol", "namespace": "ns", "uid": "u-1", "generation": 1},
        "spec": spec_dict(podTemplate=pod_template),
    })
    return children.deployment(gs, "r", 1, gs.spec.graphs.to_worker())["spec"]["template"]["spec"]


def _env(container: dict) -> list[tuple[str, str | None]]:
    return [(e["name"], e.get("value")) for e in container["env"]]


def test_the_worker_pod_runs_as_the_images_non_root_user_with_runtime_default_seccomp():
    assert _pod_spec()["securityContext"] == {
        "runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532, "fsGroup": 65532,
        "fsGroupChangePolicy": "OnRootMismatch", "seccompProfile": {"type": "RuntimeDefault"},
    }


def test_the_worker_container_drops_every_capability_and_has_a_read_only_root_filesystem():
    (worker,) = _pod_spec()["containers"]
    assert worker["securityContext"] == {
        "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]},
    }


def test_what_the_worker_writes_goes_to_an_empty_dir_at_tmp():
    spec = _pod_spec()
    (worker,) = spec["containers"]
    assert {"name": "worker-tmp", "emptyDir": {"sizeLimit": "4Gi"}} in spec["volumes"]
    assert {"name": "worker-tmp", "mountPath": "/tmp"} in worker["volumeMounts"]
    assert _env(worker)[5:] == [
        ("GRAPHSERVING_CACHE_DIR", "/tmp/graphserving"),
        ("TRITON_CACHE_DIR", "/tmp/triton"),
        ("TORCHINDUCTOR_CACHE_DIR", "/tmp/torchinductor"),
        ("CUDA_CACHE_PATH", "/tmp/nv-compute-cache"),
        ("XDG_CACHE_HOME", "/tmp/cache"),
    ]


def test_a_cache_variable_set_in_pod_template_env_replaces_the_default_once():
    (worker,) = _pod_spec(env=[{"name": "TRITON_CACHE_DIR", "value": "/cache/triton"}])["containers"]
    assert [v for n, v in _env(worker) if n == "TRITON_CACHE_DIR"] == ["/cache/triton"]


def test_the_users_security_context_keys_win_over_the_defaults():
    spec = _pod_spec(
        securityContext={"runAsUser": 1000, "seccompProfile": {"type": "Localhost", "localhostProfile": "w.json"}},
        containerSecurityContext={"readOnlyRootFilesystem": False},
    )
    assert spec["securityContext"] == {
        "runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 65532, "fsGroup": 65532,
        "fsGroupChangePolicy": "OnRootMismatch", "seccompProfile": {"type": "Localhost", "localhostProfile": "w.json"},
    }
    assert spec["containers"][0]["securityContext"] == {
        "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": False, "capabilities": {"drop": ["ALL"]},
    }


def test_image_pull_secrets_runtime_class_and_topology_spread_pass_through():
    spec = _pod_spec(imagePullSecrets=[{"name": "registry"}], runtimeClassName="nvidia",
                     topologySpreadConstraints=[SPREAD])
    assert spec["imagePullSecrets"] == [{"name": "registry"}]
    assert spec["runtimeClassName"] == "nvidia"
    assert spec["topologySpreadConstraints"] == [SPREAD]


def test_unset_pass_through_fields_are_left_out_of_the_pod_spec():
    spec = _pod_spec()
    assert not {"imagePullSecrets", "runtimeClassName", "topologySpreadConstraints", "initContainers"} & set(spec)


def test_extra_containers_run_beside_the_worker_and_init_containers_before_it():
    init = {"name": "fetch", "image": "busybox:1.37", "restartPolicy": "Always"}
    spec = _pod_spec(containers=[SIDECAR], initContainers=[init])
    assert [c["name"] for c in spec["containers"]] == ["worker", "log-shipper"]
    assert spec["containers"][1] == SIDECAR  # as given: not merged with the worker's defaults
    assert spec["initContainers"] == [init]


@pytest.mark.parametrize("pod_template, message", [
    ({"containers": [{"name": "worker", "image": "x"}]},
     "containers[0].name: 'worker' is the operator's worker container; name it otherwise"),
    ({"initContainers": [{"image": "x"}]}, "initContainers[0].name: a container needs a name, got None"),
    ({"containers": [{"name": "a"}, {"name": "a"}]}, "containers[1].name: 'a' is used twice"),
    ({"containers": [{"name": "a"}], "initContainers": [{"name": "a"}]},
     "containers and initContainers both name ['a']: container names are unique in a Pod"),
    ({"runtimeClassName": "NVIDIA_runtime"}, "String should match pattern"),
])
def test_bad_pod_template_containers_are_refused_naming_the_field(pod_template, message):
    with pytest.raises(pydantic.ValidationError) as err:
        api.GraphServingSpec.model_validate(spec_dict(podTemplate=pod_template))
    assert message in str(err.value)
    assert "podTemplate" in str(err.value)
