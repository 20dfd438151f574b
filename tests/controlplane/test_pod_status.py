"""Pod Ready honours readiness gates; phases follow the kubelet's rules."""

from graphserving.dev import pod_status

GATE = [{"conditionType": "graphserving.io/graphs-ready"}]


def test_ready_needs_ready_containers():
    cond = pod_status.ready_condition(False, ["main"], [], [])
    assert (cond.status, cond.reason) == ("False", "ContainersNotReady")


def test_ready_with_a_missing_gate_condition_is_false_and_says_so():
    cond = pod_status.ready_condition(True, [], GATE, [{"type": "ContainersReady", "status": "True"}])
    assert (cond.status, cond.reason) == ("False", "ReadinessGatesNotReady")
    assert '"graphserving.io/graphs-ready" does not exist' in cond.message


def test_ready_with_a_false_gate_condition_is_false():
    cond = pod_status.ready_condition(True, [], GATE, [{"type": "graphserving.io/graphs-ready", "status": "False"}])
    assert cond.status == "False"
    assert "is not \"True\", but False" in cond.message


def test_ready_when_containers_ready_and_every_gate_true():
    cond = pod_status.ready_condition(True, [], GATE, [{"type": "graphserving.io/graphs-ready", "status": "True"}])
    assert cond.status == "True"


def test_agent_conditions_never_include_a_gate_condition():
    pod = {"spec": {"readinessGates": GATE}, "status": {"conditions": []}}
    types = [c.type for c in pod_status.agent_conditions(pod, True, True, {"main": True})]
    assert types == ["PodReadyToStartContainers", "Initialized", "ContainersReady", "Ready"]


def test_phase_pending_before_start_running_while_running():
    assert pod_status.pod_phase("Always", [{"waiting": {}}], True) == "Pending"
    assert pod_status.pod_phase("Always", [{"running": {}}], True) == "Running"
    assert pod_status.pod_phase("Always", [{"running": {}}], False) == "Pending"


def test_phase_after_termination_depends_on_restart_policy():
    done, failed = {"terminated": {"exitCode": 0}}, {"terminated": {"exitCode": 3}}
    assert pod_status.pod_phase("Never", [done], True) == "Succeeded"
    assert pod_status.pod_phase("Never", [done, failed], True) == "Failed"
    assert pod_status.pod_phase("OnFailure", [failed], True) == "Running"
    assert pod_status.pod_phase("Always", [done], True) == "Running"


def test_transition_time_is_kept_while_the_status_is_unchanged():
    previous = [{"type": "Ready", "status": "False", "lastTransitionTime": "T0"}]
    same = pod_status.with_transition_times([pod_status.Condition("Ready", "False")], previous, "T1")
    flipped = pod_status.with_transition_times([pod_status.Condition("Ready", "True")], previous, "T1")
    assert same[0]["lastTransitionTime"] == "T0"
    assert flipped[0]["lastTransitionTime"] == "T1"
