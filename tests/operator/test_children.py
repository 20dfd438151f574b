"""Children built from a GraphServing: names, hashes, the worker Pod template."""

from __future__ import annotations

import json

from op_helpers import spec_dict

from graphserving.contract import graphserving_types as api
from graphserving.contract.worker_config import WorkerConfig
from graphserving.operator import children, naming


def _gs(**overrides) -> api.GraphServing:
    return api.GraphServing.model_validate(
        {"metadata": {"name": "smol", "namespace": "ns", "uid": "u-1", "generation": 1}, "spec": spec_dict(**overrides)}
    )


def _worker_env(dep: dict) -> dict:
    return {e["name"]: e for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}


def test_revision_hash_changes_with_the_model_revision_and_dtype():
    base = naming.revision_hash(_gs().spec)
    assert naming.revision_hash(_gs(model={**spec_dict()["model"], "revision": "b" * 64}).spec) != base
    assert naming.revision_hash(_gs(model={**spec_dict()["model"], "dtype": "bfloat16"}).spec) != base


def test_revision_hash_ignores_graph_only_replica_and_rollout_changes():
    base = naming.revision_hash(_gs().spec)
    assert naming.revision_hash(_gs(graphs={"mode": "FULL", "captureSizes": [1, 8]}).spec) == base
    assert naming.revision_hash(_gs(replicas=5, rollout={"maxSurge": 3}).spec) == base


def test_the_deployment_is_named_after_the_revision_and_gated_on_graphs():
    gs = _gs()
    rev = naming.revision_hash(gs.spec)
    dep = children.deployment(gs, rev, 2, gs.spec.graphs.to_worker())
    pod = dep["spec"]["template"]
    assert dep["metadata"]["name"] == f"smol-{rev}"
    assert dep["spec"]["replicas"] == 2
    assert pod["spec"]["readinessGates"] == [{"conditionType": "graphserving.io/graphs-ready"}]
    assert pod["spec"]["serviceAccountName"] == "graphserving-worker"
    assert pod["metadata"]["labels"][naming.LABEL_REVISION] == rev
    assert dep["metadata"]["ownerReferences"][0] == {
        "apiVersion": "graphserving.io/v1alpha1", "kind": "GraphServing", "name": "smol", "uid": "u-1",
        "controller": True, "blockOwnerDeletion": True,
    }


def test_the_worker_gets_its_config_and_identity_through_env():
    gs = _gs()
    env = _worker_env(children.deployment(gs, "r", 1, gs.spec.graphs.to_worker()))
    config = WorkerConfig.model_validate(json.loads(env["GRAPHSERVING_WORKER_CONFIG"]["value"]))
    assert config.model_path == "/models/smollm2.gguf"
    assert config.revision == "a" * 64
    assert config.engine.max_num_seqs == 8
    assert config.graphs.capture_sizes == [1, 2, 4, 8]
    assert config.host == "$(POD_IP)" and config.device == "cpu"
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"


def test_the_startup_probe_budget_follows_the_measured_startup():
    gs = _gs()
    probe = lambda s: children.deployment(gs, "r", 1, gs.spec.graphs.to_worker(), s)[  # noqa: E731
        "spec"]["template"]["spec"]["containers"][0]["startupProbe"]
    assert probe(None)["failureThreshold"] == 360  # 1800 s / 5 s before anything was measured
    assert probe(100.0)["failureThreshold"] == 52  # (2 x 100 + 60) s / 5 s


def test_gpus_become_a_device_limit_and_a_pvc_source_a_read_only_mount():
    gs = _gs(
        model={"name": "m", "revision": "a" * 64, "source": {"pvc": {"claimName": "weights", "subPath": "m.gguf"}}},
        runtime={"gpus": 1},
    )
    spec = children.deployment(gs, "r", 1, gs.spec.graphs.to_worker())["spec"]["template"]["spec"]
    container = spec["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert spec["volumes"][0]["persistentVolumeClaim"] == {"claimName": "weights", "readOnly": True}
    assert container["volumeMounts"][0] == {"name": "model", "mountPath": "/models", "readOnly": True}
    config = json.loads(_worker_env({"spec": {"template": {"spec": spec}}})["GRAPHSERVING_WORKER_CONFIG"]["value"])
    assert config["model_path"] == "/models/m.gguf" and config["device"] == "cuda"


def test_services_select_all_revisions_or_one():
    gs = _gs()
    assert children.stable_service(gs)["spec"]["selector"] == naming.selector_labels("smol")
    assert children.revision_service(gs, "r1")["spec"]["selector"][naming.LABEL_REVISION] == "r1"
    assert children.revision_service(gs, "r1")["metadata"]["name"] == "smol-r1"


def test_the_disruption_budget_keeps_the_capacity_fraction_of_pods():
    gs = _gs(replicas=4, rollout={"minAvailableCapacity": 0.5})
    assert children.pod_disruption_budget(gs)["spec"]["minAvailable"] == 2
