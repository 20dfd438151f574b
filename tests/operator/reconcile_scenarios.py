"""Reconcile scenarios over :class:`fake_kube.FakeKube`: a whole GraphServing life, step by step.

Each scenario drives :class:`~graphserving.operator.reconcile.Reconciler` the way the work queue
does (reconcile, let the "kubelet" bring Pods to each Deployment's replicas, reconcile again) and
returns what a test asserts on: the requeue delays, the calls made and the objects left.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from fake_kube import Clock, FakeKube, api_error, graphserving
from op_helpers import make_report, spec_dict

from graphserving.contract import graphserving_types as api
from graphserving.contract import worker_config as wc
from graphserving.contract.report import Phase, WorkerReport
from graphserving.operator import events, naming
from graphserving.operator.metrics import OperatorMetrics
from graphserving.operator.reconcile import Reconciler

REV_A = "a" * 64
REV_B = "b" * 64
REV_C = "c" * 64

#: A Pod's report from its name, the Pod's revision hash and the worker config its Deployment gives.
ReportFor = Callable[[str, str, wc.WorkerConfig], "WorkerReport | None"]


def ready_report(pod: str, revision: str, config: wc.WorkerConfig, **kw: Any) -> WorkerReport:
    """A Ready report about the weights and graph config ``config`` asks for."""
    return make_report(pod=pod, namespace="ns", model_revision=config.revision, graphs=config.graphs,
                       sizes=tuple(config.graphs.capture_sizes or (1, 2, 4, 8)), **kw)


@dataclasses.dataclass
class World:
    """A fake cluster, a reconciler on it and the history of one GraphServing."""

    kube: FakeKube
    clock: Clock
    reconciler: Reconciler
    metrics: OperatorMetrics
    recaptures: list[tuple[str, int, str]]
    requeues: list[float | None] = dataclasses.field(default_factory=list)
    pod_serial: int = 0

    @classmethod
    def new(cls) -> World:
        kube, clock, recaptures = FakeKube(), Clock(), []
        metrics = OperatorMetrics()
        events.RECORDER = events.Recorder(clock=clock)  # a fresh Event cache per world
        reconciler = Reconciler(kube.clients(), metrics, clock=clock,
                                recapture_http=lambda ip, port, payload: recaptures.append((ip, port, payload)))
        return cls(kube, clock, reconciler, metrics, recaptures)

    def create(self, name: str = "gs", **spec_overrides: Any) -> dict[str, Any]:
        return self.kube.put(api.KIND, graphserving(name, spec_dict(**spec_overrides)))

    def edit(self, name: str = "gs", **spec_overrides: Any) -> None:
        gs = self.kube.get(api.KIND, name)
        assert gs is not None
        gs["spec"].update(spec_overrides)
        gs["metadata"]["generation"] += 1

    def reconcile(self, name: str = "gs") -> float | None:
        requeue = self.reconciler.reconcile("ns", name)
        self.requeues.append(requeue)
        return requeue

    def status(self, name: str = "gs") -> dict[str, Any]:
        gs = self.kube.get(api.KIND, name)
        assert gs is not None
        return gs.get("status") or {}

    def condition(self, type_: str, name: str = "gs") -> dict[str, Any]:
        return next(c for c in self.status(name)["conditions"] if c["type"] == type_)

    def kubelet(self, report_for: ReportFor = ready_report, name: str = "gs") -> None:
        """Bring each Deployment's Pods to its replicas: not-ready Pods go first, new ones report."""
        for dep in self.kube.of_kind("Deployment"):
            revision = dep["metadata"]["labels"][naming.LABEL_REVISION]
            config = worker_config(dep)
            pods = [p for p in self.kube.of_kind("Pod") if p["metadata"]["labels"][naming.LABEL_REVISION] == revision]
            want = int(dep["spec"]["replicas"])
            pods.sort(key=lambda p: (_gate(p) == "True", p["metadata"]["name"]))
            for pod in pods[: max(0, len(pods) - want)]:
                self.kube.objects.pop(("Pod", "ns", pod["metadata"]["name"]))
            for _ in range(want - len(pods)):
                self.pod_serial += 1
                pod = f"{name}-{revision}-p{self.pod_serial}"
                self.kube.add_pod(name, revision, pod, report_for(pod, revision, config))

    def settle(self, steps: int = 6, report_for: ReportFor = ready_report, name: str = "gs") -> None:
        for _ in range(steps):
            self.reconcile(name)
            self.kubelet(report_for, name)
            self.clock.advance(5)


def _gate(pod: dict[str, Any]) -> str | None:
    for cond in pod["status"].get("conditions") or []:
        if cond["type"] == naming.READINESS_GATE:
            return cond["status"]
    return None


def worker_config(dep: dict[str, Any]) -> wc.WorkerConfig:
    """The worker config a revision's Deployment gives its Pods."""
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    env = next(e["value"] for e in container["env"] if e["name"] == "GRAPHSERVING_WORKER_CONFIG")
    return wc.WorkerConfig.model_validate_json(env)


def failing_canary(bad_revision: str) -> ReportFor:
    """Pods of ``bad_revision`` fail a canary (phase Failed); others report Ready."""

    def report_for(pod: str, revision: str, config: wc.WorkerConfig) -> WorkerReport:
        if revision != bad_revision:
            return ready_report(pod, revision, config)
        return ready_report(pod, revision, config, phase=Phase.FAILED, canary_fail=(2,), failure_reason="canary failed")

    return report_for


def never_ready(slow_revision: str) -> ReportFor:
    """Pods of ``slow_revision`` stay Capturing; others report Ready."""

    def report_for(pod: str, revision: str, config: wc.WorkerConfig) -> WorkerReport:
        phase = Phase.CAPTURING if revision == slow_revision else Phase.READY
        return ready_report(pod, revision, config, phase=phase)

    return report_for


def refuse_service(world: World, name: str, status: int = 422) -> None:
    world.kube.refuse("apply Service", name, api_error(status, f"Service \"{name}\" is invalid: spec.ports"))
