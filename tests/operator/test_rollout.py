"""The rollout state machine, driven through simulated rollouts.

The simulator plays the Kubernetes side adversarially: a ReplicaSet asked for fewer Pods deletes
not-ready Pods first and then the *highest*-capacity ready ones; new Pods become graphs-ready a few
steps after they are created.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import typing

from hypothesis import given, settings
from hypothesis import strategies as st

from graphserving.contract import graphserving_types as api
from graphserving.contract.graphserving_types import RolloutSpec, RolloutStatus
from graphserving.operator.rollout import (
    Decision, PodCapacity, RevisionState, RolloutPhase, capacity_floor, step,
)

T0 = dt.datetime(2025, 1, 1, tzinfo=dt.timezone.utc)


@dataclasses.dataclass
class SimPod:
    name: str
    capacity: float
    steps_to_ready: int
    canary_failed: bool = False

    @property
    def ready(self) -> bool:
        return self.steps_to_ready <= 0 and not self.canary_failed


class Sim:
    def __init__(self, revisions: dict[str, tuple[int, float]], startup: int = 2, failing: set[str] = frozenset()):
        self.replicas: dict[str, int] = {}
        self.pods: dict[str, list[SimPod]] = {}
        self.capacity = {r: c for r, (_, c) in revisions.items()}
        self.startup = startup
        self.failing = set(failing)
        self.counter = 0
        for rev, (n, _) in revisions.items():
            self.replicas[rev] = n
            self.pods[rev] = [self._new_pod(rev, ready=True) for _ in range(n)]

    def _new_pod(self, rev: str, ready: bool = False) -> SimPod:
        self.counter += 1
        return SimPod(f"{rev}-{self.counter}", self.capacity[rev], 0 if ready else self.startup, rev in self.failing)

    def add_revision(self, rev: str, capacity: float, failing: bool = False) -> None:
        self.capacity[rev] = capacity
        if failing:
            self.failing.add(rev)

    def observe(self) -> dict[str, RevisionState]:
        return {
            rev: RevisionState(rev, self.replicas[rev], tuple(
                PodCapacity(p.name, p.ready, p.capacity, p.canary_failed) for p in self.pods[rev]))
            for rev in self.replicas
        }

    def serving(self) -> float:
        return sum(p.capacity for pods in self.pods.values() for p in pods if p.ready)

    def apply(self, replicas: dict[str, int], delete: frozenset[str]) -> None:
        """The ReplicaSet, adversarially: deletes not-ready Pods first, then the largest capacity."""
        for rev, n in replicas.items():
            self.replicas[rev] = n
            pods = self.pods.setdefault(rev, [])
            while len(pods) > n:
                not_ready = [p for p in pods if not p.ready]
                pods.remove(not_ready[0] if not_ready else max(pods, key=lambda p: p.capacity))
            while len(pods) < n:
                pods.append(self._new_pod(rev))
        for rev in delete:
            assert not self.pods.get(rev), f"deleting revision {rev} with pods"
            self.replicas.pop(rev, None)
            self.pods.pop(rev, None)

    def tick(self) -> None:
        for pods in self.pods.values():
            for p in pods:
                p.steps_to_ready -= 1


def advance(sim: Sim, target: str, n: int, spec: RolloutSpec, state: RolloutStatus, steps: int,
            graph_config_hash: str | None = None) -> RolloutStatus:
    """Exactly ``steps`` reconcile steps (a rollout caught in the middle); returns the state."""
    for _ in range(steps):
        d = step(target, sim.observe(), n, spec, state, T0, graph_config_hash)
        state = d.state
        sim.apply(d.replicas, d.delete)
        sim.tick()
    return state


def run(sim: Sim, target: str, n: int, spec: RolloutSpec, state: RolloutStatus, steps: int = 200,
        graph_config_hash: str | None = None):
    """Drive the rollout; returns (final state, lowest capacity seen after any scale-down, floor)."""
    lowest = float("inf")
    floor = None
    now = T0
    for _ in range(steps):
        decision = step(target, sim.observe(), n, spec, state, now, graph_config_hash)
        state = decision.state
        if floor is None:
            floor = capacity_floor(spec, state, n)
        sim.apply(decision.replicas, decision.delete)
        lowest = min(lowest, sim.serving())
        others = [r for r in sim.replicas if r != decision.serving_target]
        if state.phase in ("Complete", "RolledBack") and not others:
            break
        sim.tick()
        now += dt.timedelta(seconds=10)
    return state, lowest, floor


def test_a_surge_rollout_replaces_every_pod_without_losing_capacity():
    sim = Sim({"old": (4, 100.0)})
    sim.add_revision("new", 100.0)
    state, lowest, floor = run(sim, "new", 4, RolloutSpec(max_surge=1, min_available_capacity=1.0),
                               RolloutStatus(target_revision="old", phase="Complete"))
    assert state.phase == "Complete"
    assert floor == 400.0 and lowest >= 400.0
    assert "old" not in sim.pods and len(sim.pods["new"]) == 4


def test_without_surge_old_pods_go_first_within_the_capacity_floor():
    sim = Sim({"old": (4, 100.0)})
    sim.add_revision("new", 100.0)
    state, lowest, _ = run(sim, "new", 4, RolloutSpec(max_surge=0, min_available_capacity=0.75),
                           RolloutStatus(target_revision="old", phase="Complete"))
    assert state.phase == "Complete" and lowest == 300.0


def test_the_first_step_surges_only_within_max_surge():
    sim = Sim({"old": (4, 100.0)})
    decision = step("new", sim.observe(), 4, RolloutSpec(max_surge=2), RolloutStatus(target_revision="old"), T0)
    assert decision.replicas == {"old": 4, "new": 2}
    assert decision.state.phase == "Progressing" and decision.state.previous_revision == "old"
    assert decision.state.baseline_capacity_tokens_per_second == 400.0
    assert [e.reason for e in decision.events] == ["RolloutStarted"]


def test_degraded_new_pods_count_at_their_measured_capacity():
    # New pods serve at a quarter of the old capacity: the last old pods may not go.
    sim = Sim({"old": (2, 100.0)})
    sim.add_revision("new", 25.0)
    state, lowest, floor = run(sim, "new", 2, RolloutSpec(max_surge=1, min_available_capacity=1.0),
                               RolloutStatus(target_revision="old", phase="Complete"), steps=40)
    assert state.phase == "Progressing" or state.phase == "DeadlineExceeded"
    assert lowest >= floor == 200.0
    assert len(sim.pods["old"]) >= 1
    # the status says what holds it: the floor, what one old pod fewer would leave, what the new pods measure
    assert "held by the capacity floor of 200.0 tokens/s" in state.message, state.message
    assert "one old pod fewer projects 125.0 tokens/s" in state.message, state.message
    assert "the target's 1 ready pod(s) measure 25.0" in state.message, state.message


def test_a_rollout_waiting_on_new_pods_is_not_reported_as_held_by_the_floor():
    sim = Sim({"old": (2, 100.0)})
    sim.add_revision("new", 25.0)
    state = advance(sim, "new", 2, RolloutSpec(max_surge=1, min_available_capacity=1.0),
                    RolloutStatus(target_revision="old", phase="Complete"), steps=1)
    assert state.phase == "Progressing" and "floor" not in state.message, state.message


def test_no_progress_past_the_deadline_sets_deadline_exceeded():
    sim = Sim({"old": (1, 100.0)})
    sim.add_revision("new", 100.0)
    sim.startup = 10**6  # new pods never become ready
    spec = RolloutSpec(progress_deadline_seconds=60)
    d = step("new", sim.observe(), 1, spec, RolloutStatus(target_revision="old"), T0)
    sim.apply(d.replicas, d.delete)
    d = step("new", sim.observe(), 1, spec, d.state, T0 + dt.timedelta(seconds=61))
    assert d.state.phase == "DeadlineExceeded"
    assert [e.reason for e in d.events] == ["ProgressDeadlineExceeded"]
    assert d.progressing_condition[:2] == ("False", "ProgressDeadlineExceeded")


def test_pause_freezes_replicas_and_resume_continues():
    sim = Sim({"old": (2, 100.0)})
    d = step("new", sim.observe(), 2, RolloutSpec(paused=True), RolloutStatus(target_revision="old"), T0)
    assert d.replicas == {"old": 2, "new": 0}
    assert d.state.phase == "Paused"
    d = step("new", sim.observe(), 2, RolloutSpec(), d.state, T0)
    assert d.state.phase == "Progressing" and d.replicas["new"] == 1
    assert "RolloutResumed" in [e.reason for e in d.events]


def test_canary_failures_roll_back_to_the_previous_revision():
    sim = Sim({"old": (2, 100.0)})
    sim.add_revision("new", 100.0, failing=True)
    state, lowest, _ = run(sim, "new", 2, RolloutSpec(max_surge=1), RolloutStatus(target_revision="old", phase="Complete"), steps=20)
    assert state.phase == "RolledBack" and state.failed_revision == "new"
    assert lowest >= 200.0
    assert not sim.pods.get("new") and len(sim.pods["old"]) == 2


def test_a_spec_changed_again_mid_rollout_rolls_back_to_what_serves_not_to_the_unproven_revision():
    sim = Sim({"a": (4, 100.0)}, startup=10**6)  # b's pods never become ready
    sim.add_revision("b", 100.0)
    spec = RolloutSpec(max_surge=1)
    state = advance(sim, "b", 4, spec, RolloutStatus(target_revision="a", phase="Complete"), steps=3)
    assert state.phase == "Progressing" and state.target_revision == "b" and len(sim.pods["b"]) == 1

    sim.startup = 2
    sim.add_revision("c", 100.0, failing=True)
    state, lowest, _ = run(sim, "c", 4, spec, state, steps=30)
    assert state.previous_revision == "a" and state.phase == "RolledBack" and state.failed_revision == "c"
    assert lowest >= 400.0 and len(sim.pods["a"]) == 4 and not sim.pods.get("c")


def test_a_rolled_back_revision_is_retried_under_another_graph_config_only():
    sim = Sim({"old": (2, 100.0)})
    sim.add_revision("new", 100.0, failing=True)
    spec = RolloutSpec(max_surge=1)
    state = advance(sim, "new", 2, spec, RolloutStatus(target_revision="old", phase="Complete"), 10, "g1")
    assert state.phase == "RolledBack" and (state.failed_revision, state.failed_graph_config_hash) == ("new", "g1")

    same = step("new", sim.observe(), 2, spec, state, T0, graph_config_hash="g1")
    assert same.state.phase == "RolledBack" and same.replicas["old"] == 2 and not same.events

    sim.failing.clear()  # the graph-only fix (say, a looser canary threshold) works
    retry = step("new", sim.observe(), 2, spec, state, T0, graph_config_hash="g2")
    assert retry.state.phase == "Progressing" and retry.state.previous_revision == "old"
    assert retry.state.failed_revision is None and retry.state.baseline_capacity_tokens_per_second == 200.0
    assert [e.reason for e in retry.events] == ["RolloutRetried"] and "g1" in retry.events[0].message
    assert retry.replicas == {"old": 2, "new": 1}
    state, lowest, _ = run(sim, "new", 2, spec, retry.state, steps=20, graph_config_hash="g2")
    assert state.phase == "Complete" and len(sim.pods["new"]) == 2 and not sim.pods.get("old") and lowest >= 200.0


def test_a_rollback_recorded_without_its_graph_config_is_not_retried():
    # status written before failedGraphConfigHash existed: keep the rollback rather than guess
    sim = Sim({"old": (2, 100.0)})
    state = RolloutStatus(target_revision="new", previous_revision="old", phase="RolledBack", failed_revision="new")
    d = step("new", sim.observe(), 2, RolloutSpec(), state, T0, graph_config_hash="g2")
    assert d.state.phase == "RolledBack" and d.replicas == {"old": 2} and not d.events


def test_lowering_replicas_with_a_new_revision_completes_within_the_scaled_floor():
    # One edit: 4 -> 1 replicas and a new revision. The floor is the capacity of 1 baseline pod.
    sim = Sim({"old": (4, 100.0)})
    sim.add_revision("new", 100.0)
    state, lowest, floor = run(sim, "new", 1, RolloutSpec(max_surge=1, min_available_capacity=1.0),
                               RolloutStatus(target_revision="old", phase="Complete"), steps=40)
    assert state.phase == "Complete"
    assert (state.baseline_capacity_tokens_per_second, state.baseline_replicas) == (400.0, 4)
    assert floor == 100.0 and lowest >= 100.0
    assert "old" not in sim.pods and len(sim.pods["new"]) == 1


def test_scaling_down_during_a_rollout_lowers_the_floor_and_completes():
    sim = Sim({"old": (4, 100.0)}, startup=10**6)  # the first new pods never become ready
    sim.add_revision("new", 100.0)
    spec = RolloutSpec(max_surge=1, min_available_capacity=1.0)
    state = RolloutStatus(target_revision="old", phase="Complete")
    for _ in range(3):
        d = step("new", sim.observe(), 4, spec, state, T0)
        state = d.state
        sim.apply(d.replicas, d.delete)
        sim.tick()
    assert d.replicas == {"old": 4, "new": 1} and state.baseline_replicas == 4
    sim.startup = 2
    sim.pods["new"] = [sim._new_pod("new")]
    final, lowest, floor = run(sim, "new", 2, spec, state)
    assert final.phase == "Complete" and floor == 200.0 and lowest >= 200.0
    assert "old" not in sim.pods and len(sim.pods["new"]) == 2


def test_a_restarted_operator_resumes_from_status():
    sim = Sim({"old": (3, 100.0)})
    sim.add_revision("new", 100.0)
    spec = RolloutSpec(max_surge=1)
    state = advance(sim, "new", 3, spec, RolloutStatus(target_revision="old", phase="Complete"), steps=4)
    # A new operator only has the status it reads back (round trip through JSON).
    restored = RolloutStatus.model_validate(state.to_api())
    final, lowest, _ = run(sim, "new", 3, spec, restored)
    assert final.phase == "Complete" and final.baseline_capacity_tokens_per_second == 300.0
    assert lowest >= 300.0


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 5),
    old_n=st.integers(0, 5),
    surge=st.integers(0, 3),
    min_avail=st.floats(0, 1),
    old_cap=st.floats(10, 1000),
    new_ratio=st.floats(0.1, 3),
    startup=st.integers(1, 4),
)
def test_capacity_never_drops_below_the_floor(n, old_n, surge, min_avail, old_cap, new_ratio, startup):
    if surge == 0 and min_avail >= 1.0:
        min_avail = 0.99  # the API rejects this combination
    sim = Sim({"old": (old_n, old_cap)}, startup=startup)
    sim.add_revision("new", old_cap * new_ratio)
    spec = RolloutSpec(max_surge=surge, min_available_capacity=min_avail)
    state, lowest, floor = run(sim, "new", n, spec, RolloutStatus(target_revision="old", phase="Complete"), steps=80)
    assert lowest + 1e-6 >= floor
    assert sum(len(p) for p in sim.pods.values()) <= max(n, old_n) + surge
    kept = min(old_n, n)  # the floor holds the capacity of at most spec.replicas old pods
    can_finish = new_ratio >= 1 and (surge >= 1 or min_avail * kept <= kept - 1 or old_n == 0)
    if can_finish:
        assert state.phase == "Complete", state


def test_the_rollout_phases_are_the_api_values_in_order():
    """The operator's enum and the API's RolloutPhase (the CRD's enum) name the same strings."""
    assert [p.value for p in RolloutPhase] == list(typing.get_args(api.RolloutPhase))
    assert RolloutStatus().phase == RolloutPhase.IDLE
    assert RolloutStatus(phase=RolloutPhase.PAUSED).to_api()["phase"] == "Paused"


def test_every_phase_has_a_progressing_condition():
    for phase in typing.get_args(api.RolloutPhase):  # as read back from status: plain strings
        d = Decision({}, frozenset(), RolloutStatus(phase=phase, message="m"), (), "r")
        status, reason, _ = d.progressing_condition
        assert status in ("True", "False", "Unknown") and reason
