"""Pod status decisions of the development node agent, as pure functions.

They follow the kubelet's rules (``pkg/kubelet/status/generate.go`` and ``kubelet_pods.go``):

* ``ContainersReady`` is True when every container is ready.
* ``Ready`` is True only when the containers are ready AND every ``spec.readinessGates`` condition
  is present in ``status.conditions`` with status ``"True"``. The gate conditions are written by
  someone else (an operator); the node agent only reads them.
* The phase is ``Pending`` until a container has started, ``Running`` while any runs or will be
  restarted, and ``Succeeded``/``Failed`` once all have terminated for good.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

#: Pod condition types the node agent owns (PodScheduled belongs to the scheduler, gates to others).
AGENT_CONDITIONS = ("PodReadyToStartContainers", "Initialized", "ContainersReady", "Ready")


@dataclasses.dataclass(frozen=True)
class Condition:
    """A pod condition as computed now (without its transition time)."""

    type: str
    status: str
    reason: str = ""
    message: str = ""


def readiness_gate_problems(readiness_gates: Sequence[Mapping], conditions: Sequence[Mapping]) -> list[str]:
    """Messages for each readiness gate whose condition is missing or not ``"True"`` (empty if all hold)."""
    by_type = {c.get("type"): c for c in conditions}
    problems = []
    for gate in readiness_gates:
        gate_type = gate["conditionType"]
        cond = by_type.get(gate_type)
        if cond is None:
            problems.append(f'corresponding condition of pod readiness gate "{gate_type}" does not exist.')
        elif cond.get("status") != "True":
            problems.append(f'the status of pod readiness gate "{gate_type}" is not "True", but {cond.get("status")}')
    return problems


def ready_condition(containers_ready: bool, not_ready_containers: Sequence[str],
                    readiness_gates: Sequence[Mapping], conditions: Sequence[Mapping]) -> Condition:
    """The pod ``Ready`` condition: containers ready and every readiness gate True."""
    if not containers_ready:
        return Condition("Ready", "False", "ContainersNotReady",
                         f"containers with unready status: [{' '.join(not_ready_containers)}]")
    problems = readiness_gate_problems(readiness_gates, conditions)
    if problems:
        return Condition("Ready", "False", "ReadinessGatesNotReady", ", ".join(problems))
    return Condition("Ready", "True")


def pod_phase(restart_policy: str, states: Sequence[Mapping], initialized: bool) -> str:
    """The pod phase from the containers' ``state`` dicts (``running``/``waiting``/``terminated``)."""
    if not initialized or not states:
        return "Pending"
    running = sum(1 for s in states if "running" in s)
    terminated = [s["terminated"] for s in states if "terminated" in s]
    waiting = len(states) - running - len(terminated)
    if running:
        return "Running"
    if waiting:
        # A container waiting to restart keeps a started pod Running; before any start it is Pending.
        return "Running" if terminated else "Pending"
    failed = any(t.get("exitCode", 0) != 0 for t in terminated)
    if restart_policy == "Always" or (restart_policy == "OnFailure" and failed):
        return "Running"
    return "Failed" if failed else "Succeeded"


def agent_conditions(pod: Mapping, initialized: bool, started: bool,
                     container_ready: Mapping[str, bool]) -> list[Condition]:
    """The conditions the agent owns, computed from its view of the containers and the pod's gates."""
    not_ready = [name for name, ready in container_ready.items() if not ready]
    containers_ready = initialized and bool(container_ready) and not not_ready
    cready = (Condition("ContainersReady", "True") if containers_ready else
              Condition("ContainersReady", "False", "ContainersNotReady",
                        f"containers with unready status: [{' '.join(not_ready)}]"))
    ready = ready_condition(containers_ready, not_ready, pod.get("spec", {}).get("readinessGates") or [],
                            pod.get("status", {}).get("conditions") or [])
    return [
        Condition("PodReadyToStartContainers", "True" if started else "False"),
        Condition("Initialized", "True") if initialized else
        Condition("Initialized", "False", "ContainersNotInitialized", "init containers have not completed"),
        cready,
        ready,
    ]


def with_transition_times(conditions: Sequence[Condition], previous: Sequence[Mapping], now: str) -> list[dict]:
    """Condition dicts with ``lastTransitionTime`` kept from ``previous`` when the status did not change."""
    before = {c.get("type"): c for c in previous}
    out = []
    for cond in conditions:
        prior = before.get(cond.type)
        changed = prior is None or prior.get("status") != cond.status
        entry = {"type": cond.type, "status": cond.status,
                 "lastProbeTime": None,
                 "lastTransitionTime": now if changed else prior.get("lastTransitionTime", now)}
        # None (not absent) so that a strategic-merge patch clears a stale reason or message.
        entry["reason"] = cond.reason or None
        entry["message"] = cond.message or None
        out.append(entry)
    return out
