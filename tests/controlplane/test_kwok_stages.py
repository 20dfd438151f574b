"""Our kwok stages replace kwok's defaults and leave readiness-gate conditions alone."""

from graphserving.dev import kwok


def test_stages_cover_nodes_and_the_pod_lifecycle():
    names = {s["metadata"]["name"]: s["spec"]["resourceRef"]["kind"] for s in kwok.stages()}
    assert names == {"node-initialize": "Node", "node-heartbeat": "Node", "pod-running": "Pod",
                     "pod-gates-ready": "Pod", "pod-gates-unready": "Pod", "pod-delete": "Pod"}


def test_no_stage_writes_a_readiness_gate_condition():
    for stage in kwok.stages():
        for patch in stage["spec"]["next"].get("patches", []):
            assert "conditionType" not in patch["template"], stage["metadata"]["name"]


def test_status_patches_merge_so_conditions_written_by_others_survive():
    for stage in kwok.stages():
        for patch in stage["spec"]["next"].get("patches", []):
            assert (patch["subresource"], patch["type"]) == ("status", "strategic")


def test_fake_nodes_are_tainted_so_real_pods_stay_on_the_local_node():
    node = kwok.fake_node("f-1", gpus=8)
    assert node["metadata"]["annotations"] == {"kwok.x-k8s.io/node": "fake"}
    assert node["spec"]["taints"] == [kwok.FAKE_TAINT]
    assert node["status"]["capacity"]["nvidia.com/gpu"] == "8"
