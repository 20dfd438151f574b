"""``spec.runtime.gpus`` above 1 is tensor parallelism: the worker's ``tensor_parallel_size`` (one
rank per GPU, runtime/lifecycle/ranks.py), a memory-backed /dev/shm for NCCL between the ranks, and
speculative decoding refused by the model and by the API server, naming the field. A single-GPU or
CPU worker's configuration JSON is what it was before the field existed (no rolling restart)."""

from __future__ import annotations

import json

import pydantic
import pytest
from op_helpers import spec_dict

from graphserving.contract import graphserving_types as api
from graphserving.contract.worker_config import WorkerConfig
from graphserving.operator import children

ENGINE = {"maxNumSeqs": 8, "maxNumBatchedTokens": 256}


def _gs(gpus: int, **engine) -> api.GraphServing:
    spec = spec_dict(runtime={"gpus": gpus, "engine": {**ENGINE, **engine}})
    return api.GraphServing.model_validate({"metadata": {"name": "smol", "namespace": "ns", "uid": "u-1", "generation": 1},
                                            "spec": spec})


def _pod(gs: api.GraphServing) -> tuple[dict, dict]:
    """(the worker Pod spec, its rendered WorkerConfig JSON) of ``gs``'s Deployment."""
    pod = children.deployment(gs, "r", 1, gs.spec.graphs.to_worker())["spec"]["template"]["spec"]
    env = {e["name"]: e for e in pod["containers"][0]["env"]}
    return pod, json.loads(env["GRAPHSERVING_WORKER_CONFIG"]["value"])


def test_gpus_above_one_become_the_tensor_parallel_size_with_a_shared_memory_volume():
    pod, config = _pod(_gs(4))
    assert config["tensor_parallel_size"] == 4 and config["device"] == "cuda"
    assert WorkerConfig.model_validate(config).tensor_parallel_size == 4
    container = pod["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "4"
    assert {"name": children.SHM_VOLUME, "emptyDir": {"medium": "Memory"}} in pod["volumes"]
    assert {"name": children.SHM_VOLUME, "mountPath": "/dev/shm"} in container["volumeMounts"]


def test_a_pod_template_that_mounts_its_own_shared_memory_keeps_it():
    gs = _gs(2)
    own = {"name": "my-shm", "mountPath": "/dev/shm"}
    gs = gs.model_copy(update={"spec": gs.spec.model_copy(update={"pod_template": gs.spec.pod_template.model_copy(
        update={"volume_mounts": [own], "volumes": [{"name": "my-shm", "emptyDir": {"medium": "Memory"}}]})})})
    pod, _ = _pod(gs)
    mounts = [m for m in pod["containers"][0]["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    assert mounts == [own] and all(v["name"] != children.SHM_VOLUME for v in pod["volumes"])


@pytest.mark.parametrize("gpus", [0, 1])
def test_a_single_gpu_or_cpu_worker_gets_no_new_field_and_no_shared_memory_volume(gpus):
    pod, config = _pod(_gs(gpus))
    assert "tensor_parallel_size" not in config
    assert WorkerConfig.model_validate(config).tensor_parallel_size == 1
    assert all(v["name"] != children.SHM_VOLUME for v in pod["volumes"])


def test_the_model_refuses_speculative_decoding_over_several_gpus_naming_the_field():
    with pytest.raises(pydantic.ValidationError, match="runtime.engine.speculative is not supported with runtime.gpus "
                                                       "above 1"):
        _gs(2, speculative="ngram:4")
    assert _gs(1, speculative="ngram:4").spec.runtime.engine.speculative == "ngram:4"


@pytest.mark.cluster
def test_the_api_server_refuses_speculative_decoding_over_several_gpus_naming_the_field(custom, namespace, tmp_path):
    from kubernetes.client.rest import ApiException
    from op_cluster import create_gs, get_gs, standin_spec

    spec = standin_spec(tmp_path)
    spec["runtime"] = {**spec["runtime"], "gpus": 2, "engine": {**ENGINE, "speculative": "ngram:2"}}
    with pytest.raises(ApiException) as info:
        create_gs(custom, namespace, "tp-speculative", spec)
    message = json.loads(info.value.body)["message"]
    assert info.value.status == 422
    assert "spec.runtime.engine.speculative: Invalid value" in message
    assert "not supported with runtime.gpus above 1 (tensor parallelism) yet" in message
    spec["runtime"]["engine"] = ENGINE
    create_gs(custom, namespace, "tp-two", spec)
    assert get_gs(custom, namespace, "tp-two")["spec"]["runtime"]["gpus"] == 2
