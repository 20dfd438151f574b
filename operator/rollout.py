"""The rollout state machine (pure): observed revisions + state -> desired replicas per revision.

Level-triggered and idempotent: every call recomputes the next step from what is observed and from
the state kept in ``status.rollout``, so a restarted operator resumes a rollout where it stood.

Capacity is measured: a ready Pod counts at the effective capacity (tokens/s) of its report, a
degraded Pod at its measured degraded capacity, any other Pod at zero. The floor is
``minAvailableCapacity`` x the capacity served when the rollout started (the baseline), scaled by
``spec.replicas / baselineReplicas`` while the spec asks for fewer pods than the baseline was measured
on (a scale-down with or during a rollout; the full baseline could never be reached). Scaling an old
revision down is charged at its worst case: the ReplicaSet deletes not-ready Pods first, and among
ready ones we assume the highest-capacity Pods go first, so the projected capacity never
overestimates what remains.

Steps (docs/architecture.md, "Rollouts"): surge the target revision within ``maxSurge``; wait for its Pods'
graphs-ready gates; scale old revisions down only while the projected capacity stays >= the floor;
complete when the target has ``replicas`` ready Pods and no old Pod remains. Pause freezes every
revision's replicas; the progress deadline sets ``DeadlineExceeded``; canary failures on the target
roll back to the previous revision when ``autoRollback`` is set. The failed revision is remembered
with the graph config its canaries failed under and is not retried until the revision or the graph
config changes: canaries depend on the graphs (thresholds, capture sizes, modes), which do not change
the revision hash, so a graph-only fix must retry the revision.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import enum

from graphserving.contract.graphserving_types import RolloutSpec, RolloutStatus


class RolloutPhase(enum.StrEnum):
    """``status.rollout.phase``: the values of the API's ``RolloutPhase`` (the CRD's enum), in its
    order; a member is its string, in status, in Events and in the ``rollout_phase`` metric."""

    IDLE = "Idle"
    PROGRESSING = "Progressing"
    PAUSED = "Paused"
    COMPLETE = "Complete"
    DEADLINE_EXCEEDED = "DeadlineExceeded"
    ROLLED_BACK = "RolledBack"


#: Phases that ``spec.rollout.paused`` freezes.
_PAUSABLE = frozenset({RolloutPhase.PROGRESSING, RolloutPhase.DEADLINE_EXCEEDED, RolloutPhase.COMPLETE,
                       RolloutPhase.PAUSED})
#: Phases from which canary failures on the target roll back.
_ROLLBACK_FROM = frozenset({RolloutPhase.PROGRESSING, RolloutPhase.DEADLINE_EXCEEDED, RolloutPhase.PAUSED})
#: Phases in which the rollout still moves (the reconcile requeues soon, for the deadline).
MOVING = frozenset({RolloutPhase.PROGRESSING, RolloutPhase.DEADLINE_EXCEEDED})


@dataclasses.dataclass(frozen=True)
class PodCapacity:
    """One live (not terminating) Pod of a revision as the rollout sees it."""

    name: str
    ready: bool
    capacity: float = 0.0
    canary_failed: bool = False

    @property
    def serving(self) -> float:
        return self.capacity if self.ready else 0.0


@dataclasses.dataclass(frozen=True)
class RevisionState:
    """A revision's Deployment (``replicas`` desired; ``exists`` False when not created yet)."""

    revision: str
    replicas: int
    pods: tuple[PodCapacity, ...] = ()
    exists: bool = True

    @property
    def ready_count(self) -> int:
        return sum(1 for p in self.pods if p.ready)

    @property
    def capacity(self) -> float:
        return sum(p.serving for p in self.pods)


@dataclasses.dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclasses.dataclass(frozen=True)
class Decision:
    replicas: dict[str, int]
    delete: frozenset[str]
    state: RolloutStatus
    events: tuple[Event, ...]
    serving_target: str

    @property
    def progressing_condition(self) -> tuple[str, str, str]:
        """(status, reason, message) of the ``Progressing`` condition."""
        phase = self.state.phase
        table = {
            RolloutPhase.IDLE: ("False", "NoRollout", "nothing to roll out"),
            RolloutPhase.PROGRESSING: ("True", "RolloutInProgress", self.state.message),
            RolloutPhase.PAUSED: ("Unknown", "RolloutPaused", self.state.message),
            RolloutPhase.COMPLETE: ("True", "RolloutComplete", self.state.message),
            RolloutPhase.DEADLINE_EXCEEDED: ("False", "ProgressDeadlineExceeded", self.state.message),
            RolloutPhase.ROLLED_BACK: ("False", "RolledBack", self.state.message),
        }
        return table[phase]


def remaining_capacity(rev: RevisionState, replicas: int) -> float:
    """Worst-case capacity ``rev`` keeps once its Deployment runs ``replicas`` Pods.

    Not-ready Pods are removed first (the ReplicaSet's ranking); then, conservatively, the ready
    Pods with the highest capacity.
    """
    remove = max(0, len(rev.pods) - replicas)
    removed_ready = max(0, remove - sum(1 for p in rev.pods if not p.ready))
    ready_caps = sorted(p.capacity for p in rev.pods if p.ready)
    return sum(ready_caps[: len(ready_caps) - removed_ready])


def projected_capacity(revisions: dict[str, RevisionState], replicas: dict[str, int]) -> float:
    """Worst-case total capacity once every revision runs ``replicas[rev]`` Pods."""
    return sum(remaining_capacity(rev, replicas.get(name, rev.replicas)) for name, rev in revisions.items())


def capacity_floor(rollout: RolloutSpec, state: RolloutStatus, spec_replicas: int) -> float:
    """Capacity (tokens/s) a rollout step must keep serving in the worst case.

    ``minAvailableCapacity`` x the baseline, x ``spec_replicas / baselineReplicas`` when the spec asks
    for fewer pods than the baseline was measured on: holding the capacity of more pods than the
    spec wants would keep old pods forever (the rollout could never complete). 0 baseline replicas
    (a status written before they were recorded) leaves the baseline whole.
    """
    baseline = state.baseline_capacity_tokens_per_second
    if spec_replicas < state.baseline_replicas:
        baseline *= spec_replicas / state.baseline_replicas
    return rollout.min_available_capacity * baseline


def _scale_down_order(olds: list[str], revisions: dict[str, RevisionState]) -> list[str]:
    """Old revisions in the order they lose Pods: the least capacity first, so the best-serving one
    is kept longest."""
    return sorted(olds, key=lambda n: (revisions[n].capacity, n))


def _below_floor(projected: float, floor: float) -> bool:
    """Whether a projected capacity (tokens/s) falls below the floor (with float tolerance)."""
    return projected + 1e-9 < floor


def _scale_step(
    target: str,
    revisions: dict[str, RevisionState],
    spec_replicas: int,
    rollout: RolloutSpec,
    floor: float,
) -> dict[str, int]:
    replicas = {name: rev.replicas for name, rev in revisions.items()}
    replicas.setdefault(target, 0)
    olds = [name for name in revisions if name != target]
    # Scale old revisions down one Pod at a time while the worst case stays above the floor.
    for name in _scale_down_order(olds, revisions):
        while replicas[name] > 0:
            trial = dict(replicas)
            trial[name] -= 1
            if _below_floor(projected_capacity(revisions, trial), floor):
                break
            replicas = trial
    old_total = sum(replicas[n] for n in olds)
    surge_room = spec_replicas + rollout.max_surge - old_total
    current = revisions[target].replicas if target in revisions else 0
    replicas[target] = min(spec_replicas, max(min(current, spec_replicas), surge_room))
    return replicas


def _start(
    target: str, previous: str | None, revisions: dict[str, RevisionState], now: dt.datetime, message: str
) -> RolloutStatus:
    """A new rollout toward ``target`` from ``previous``, its baseline measured on ``revisions`` now."""
    return RolloutStatus(
        phase=RolloutPhase.PROGRESSING,
        target_revision=target,
        previous_revision=previous,
        baseline_capacity_tokens_per_second=sum(rev.capacity for rev in revisions.values()),
        baseline_replicas=sum(rev.ready_count for rev in revisions.values()),
        started_at=now,
        last_progress_at=now,
        message=message,
    )


def _start_or_retry(
    target: str,
    revisions: dict[str, RevisionState],
    state: RolloutStatus,
    now: dt.datetime,
    graph_config_hash: str | None,
) -> tuple[RolloutStatus, tuple[Event, ...]]:
    """A new rollout when the spec's revision changed, or a retry of a rolled-back ``target`` whose
    graph config changed since its canaries failed; else ``state`` unchanged."""
    if state.target_revision != target:
        # Roll back to what serves most, not to the last target: a spec changed again mid-rollout
        # (A -> B -> C before B was ready) must fall back to A, not to an unproven B.
        others = {n: r for n, r in revisions.items() if n != target and (r.replicas > 0 or r.pods)}
        candidates = others or {n: r for n, r in revisions.items() if n == state.target_revision}
        previous = max(
            candidates,
            key=lambda n: (candidates[n].capacity, candidates[n].ready_count, n == state.target_revision, n),
            default=None,
        )
        message = f"rolling out revision {target}" + (f" from {previous}" if previous else "")
        state = _start(target, previous, revisions, now, message)
        return state, (Event("Normal", "RolloutStarted", state.message),)
    if (
        state.phase == RolloutPhase.ROLLED_BACK
        and state.failed_revision == target
        and graph_config_hash is not None
        and state.failed_graph_config_hash not in (None, graph_config_hash)
    ):
        message = (
            f"retrying revision {target} under graph config {graph_config_hash} (its canaries failed under "
            f"{state.failed_graph_config_hash})" + (f" from {state.previous_revision}" if state.previous_revision else "")
        )
        state = _start(target, state.previous_revision, revisions, now, message)
        return state, (Event("Normal", "RolloutRetried", state.message),)
    return state, ()


def _is_rolled_back(state: RolloutStatus, target: str) -> bool:
    return state.phase == RolloutPhase.ROLLED_BACK and state.failed_revision == target


def _roll_back_on_canary_failures(
    target: str,
    revisions: dict[str, RevisionState],
    rollout: RolloutSpec,
    state: RolloutStatus,
    now: dt.datetime,
    graph_config_hash: str | None,
) -> tuple[RolloutStatus, tuple[Event, ...]]:
    """``RolledBack`` when ``autoRollback`` is set, a target Pod failed canaries and the previous
    revision still has a Deployment to return to; else ``state`` unchanged."""
    target_rev = revisions.get(target)
    if (
        _is_rolled_back(state, target)
        or not rollout.auto_rollback
        or state.phase not in _ROLLBACK_FROM
        or target_rev is None
        or not any(p.canary_failed for p in target_rev.pods)
        or state.previous_revision not in revisions
    ):
        return state, ()
    failed = sum(1 for p in target_rev.pods if p.canary_failed)
    state = state.model_copy(
        update={
            "phase": RolloutPhase.ROLLED_BACK,
            "failed_revision": target,
            "failed_graph_config_hash": graph_config_hash,
            "last_progress_at": now,
            "message": f"{failed} pod(s) of revision {target} failed canaries; "
            f"rolled back to {state.previous_revision}",
        }
    )
    return state, (Event("Warning", "RolledBack", state.message),)


def _pause_or_resume(
    rollout: RolloutSpec, state: RolloutStatus, now: dt.datetime
) -> tuple[RolloutStatus, tuple[Event, ...], bool]:
    """``(state, events, paused)``: ``Paused`` while ``spec.rollout.paused`` holds a pausable
    rollout, ``Progressing`` again once it is lifted."""
    if rollout.paused and state.phase in _PAUSABLE:
        if state.phase == RolloutPhase.PAUSED:
            return state, (), True
        state = state.model_copy(update={"phase": RolloutPhase.PAUSED, "message": "rollout paused (spec.rollout.paused)"})
        return state, (Event("Normal", "RolloutPaused", state.message),), True
    if state.phase == RolloutPhase.PAUSED:
        state = state.model_copy(
            update={"phase": RolloutPhase.PROGRESSING, "last_progress_at": now, "message": "rollout resumed"}
        )
        return state, (Event("Normal", "RolloutResumed", state.message),), False
    return state, (), False


@dataclasses.dataclass(frozen=True)
class ScalePlan:
    """This step's replicas toward ``serving_target`` and what they leave."""

    replicas: dict[str, int]
    delete: frozenset[str]
    ready: int  # graphs-ready Pods of the serving target
    old_left: int  # Pods an old revision still has or is still asked to keep
    marker: str  # changes whenever the rollout advances
    complete: bool
    held_by_floor: str = ""  # why the capacity floor keeps old Pods the target no longer needs ("" if not)


def _plan_scale(
    serving_target: str,
    revisions: dict[str, RevisionState],
    spec_replicas: int,
    rollout: RolloutSpec,
    state: RolloutStatus,
    rolled_back: bool,
) -> ScalePlan:
    floor = capacity_floor(rollout, state, spec_replicas)
    replicas = _scale_step(serving_target, revisions, spec_replicas, rollout, floor)
    olds = [n for n in revisions if n != serving_target]
    serving = revisions.get(serving_target)
    ready = serving.ready_count if serving else 0
    # Pods an old revision still has or is still asked to keep (zero only when both are).
    old_left = sum(max(replicas[n], len(revisions[n].pods)) for n in olds)
    complete = ready >= spec_replicas and old_left == 0
    # Old Deployments without pods go, except the previous revision while a rollback may need it.
    delete = frozenset(
        n
        for n in olds
        if replicas.get(n, 0) == 0
        and not revisions[n].pods
        and (complete or rolled_back or n != state.previous_revision)
    )
    marker = f"{serving_target}:{ready}:{replicas[serving_target]}:{old_left}"
    return ScalePlan(replicas, delete, ready, old_left, marker, complete,
                     floor_hold(serving_target, revisions, replicas, floor))


def floor_hold(target: str, revisions: dict[str, RevisionState], replicas: dict[str, int], floor: float) -> str:
    """Why the rollout waits on nothing that will change by itself: the target's asked-for Pods are
    all ready, and one old Pod fewer would project below the capacity floor (tokens/s), so no old
    Pod goes (and ``maxSurge`` allows the target no more). ``""`` when that is not the case.

    Such a rollout moves again only when capacities change (the target's Pods measure more, or
    ``minAvailableCapacity`` is lowered); otherwise the progress deadline ends it.
    """
    serving = revisions.get(target)
    kept = [n for n in revisions if n != target and replicas.get(n, 0) > 0]
    if not kept or serving is None or serving.ready_count < replicas[target]:
        return ""
    trial = dict(replicas)
    trial[_scale_down_order(kept, revisions)[0]] -= 1  # _scale_step's next candidate
    projected = projected_capacity(revisions, trial)
    if not _below_floor(projected, floor):
        return ""
    return (f"held by the capacity floor of {floor:.1f} tokens/s (minAvailableCapacity x the baseline): "
            f"one old pod fewer projects {projected:.1f} tokens/s, the target's {serving.ready_count} "
            f"ready pod(s) measure {remaining_capacity(serving, serving.ready_count):.1f}")


def _complete(
    target: str, spec_replicas: int, state: RolloutStatus, now: dt.datetime, plan: ScalePlan
) -> tuple[RolloutStatus, tuple[Event, ...]]:
    """``Complete`` (once), keeping the marker current."""
    if state.phase != RolloutPhase.COMPLETE:
        state = state.model_copy(
            update={
                "phase": RolloutPhase.COMPLETE,
                "last_progress_at": now,
                "progress_marker": plan.marker,
                "message": f"revision {target} serves {plan.ready}/{spec_replicas} replicas",
            }
        )
        return state, (Event("Normal", "RolloutComplete", state.message),)
    if state.progress_marker != plan.marker:
        state = state.model_copy(update={"progress_marker": plan.marker})
    return state, ()


def _progress(
    target: str,
    spec_replicas: int,
    rollout: RolloutSpec,
    state: RolloutStatus,
    now: dt.datetime,
    plan: ScalePlan,
) -> tuple[RolloutStatus, tuple[Event, ...]]:
    """``Progressing`` when the marker moved, ``DeadlineExceeded`` after the progress deadline
    without movement."""
    if state.phase == RolloutPhase.COMPLETE:  # e.g. a scale-up or a pod lost: progressing again
        state = state.model_copy(update={"phase": RolloutPhase.PROGRESSING, "last_progress_at": now})
    message = f"revision {target}: {plan.ready}/{spec_replicas} graphs-ready; {plan.old_left} old pod(s) left"
    if plan.held_by_floor:
        message = f"{message}; {plan.held_by_floor}"
    if state.progress_marker != plan.marker:
        events = (Event("Normal", "RolloutProgressing", message),) if state.phase == RolloutPhase.DEADLINE_EXCEEDED else ()
        state = state.model_copy(
            update={
                "phase": RolloutPhase.PROGRESSING, "last_progress_at": now, "progress_marker": plan.marker,
                "message": message,
            }
        )
        return state, events
    if state.phase != RolloutPhase.PROGRESSING:
        return state, ()
    last = state.last_progress_at or now
    if (now - last).total_seconds() > rollout.progress_deadline_seconds:
        message = f"no progress for more than {rollout.progress_deadline_seconds}s: {message}"
        state = state.model_copy(update={"phase": RolloutPhase.DEADLINE_EXCEEDED, "message": message})
        return state, (Event("Warning", "ProgressDeadlineExceeded", message),)
    return state.model_copy(update={"message": message}), ()


def step(
    target: str,
    revisions: dict[str, RevisionState],
    spec_replicas: int,
    rollout: RolloutSpec,
    state: RolloutStatus,
    now: dt.datetime,
    graph_config_hash: str | None = None,
) -> Decision:
    """One reconcile step of the rollout toward the spec's revision ``target``.

    Args:
        target: revision hash of the current spec.
        revisions: every revision that has a Deployment (``target`` may be absent: not created yet).
        spec_replicas: ``spec.replicas``.
        rollout: ``spec.rollout``.
        state: ``status.rollout`` as last written (a default ``RolloutStatus`` when new).
        now: the current time (UTC), for the progress deadline.
        graph_config_hash: ``config_hash`` of the graph config the spec asks for; a revision rolled
            back under another one is retried (None: never retried on that account).

    Returns:
        The desired replicas of every revision (the target included), the revisions whose
        Deployments can be deleted (no replicas, no pods, not needed for rollback), the new state
        and the Events to emit.
    """
    state, started = _start_or_retry(target, revisions, state, now, graph_config_hash)
    state, rollback = _roll_back_on_canary_failures(target, revisions, rollout, state, now, graph_config_hash)
    events = started + rollback
    rolled_back = _is_rolled_back(state, target)
    serving_target = state.previous_revision if rolled_back else target
    assert serving_target is not None

    state, paused_or_resumed, paused = _pause_or_resume(rollout, state, now)
    events += paused_or_resumed
    if paused:  # every revision keeps its replicas
        replicas = {n: r.replicas for n, r in revisions.items()}
        replicas.setdefault(target, 0)
        return Decision(replicas, frozenset(), state, events, serving_target)

    plan = _plan_scale(serving_target, revisions, spec_replicas, rollout, state, rolled_back)
    if rolled_back:
        state = state.model_copy(update={"progress_marker": plan.marker})
    elif plan.complete:
        state, advanced = _complete(target, spec_replicas, state, now, plan)
        events += advanced
    else:
        state, advanced = _progress(target, spec_replicas, rollout, state, now, plan)
        events += advanced
    return Decision(plan.replicas, plan.delete, state, events, serving_target)
