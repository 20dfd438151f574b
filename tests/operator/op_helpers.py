"""Helpers for the operator tests: contract-valid worker reports and GraphServing specs."""

from __future__ import annotations

import datetime as dt
from typing import Any

from graphserving.contract.graph_policy import GraphMode
from graphserving.contract.report import (
    CanaryResult,
    GraphMemory,
    KeyReport,
    KvCacheCapacity,
    ModeKeys,
    Phase,
    PhaseRecord,
    WorkerIdentity,
    WorkerReport,
    config_hash,
)
from graphserving.contract.worker_config import GraphConfig

REVISION = "a" * 64
T0 = dt.datetime(2025, 1, 1, tzinfo=dt.timezone.utc)


def make_report(
    *,
    pod: str = "gs-1-abc",
    namespace: str = "ns",
    instance: str = "i-1",
    generation: int = 3,
    phase: Phase = Phase.READY,
    sizes: tuple[int, ...] = (1, 2, 4, 8),
    canary_fail: tuple[int, ...] = (),
    graphs: GraphConfig | None = None,
    model_revision: str | None = REVISION,
    capacity: float = 1000.0,
    degraded_reason: str | None = None,
    failure_reason: str | None = None,
    coverage: float | None = None,
) -> WorkerReport:
    """A contract-valid report of a worker that captured FULL graphs at ``sizes``."""
    graphs = graphs or GraphConfig(mode=GraphMode.FULL, capture_sizes=list(sizes))
    keys = [
        KeyReport(
            kind="FULL",
            size=s,
            captured=True,
            capture_seconds=0.1 * (i + 1),
            memory_estimate_bytes=s << 20,
            memory_bytes=s << 20,
            decode_step_seconds=0.002,
            canary=CanaryResult(
                passed=s not in canary_fail, max_relative_logit_error=1e-4, top1_agreement=1.0, min_top1_margin=1.2
            ),
        )
        for i, s in enumerate(sizes)
    ]
    passed = sum(1 for s in sizes if s not in canary_fail)
    phases = [
        PhaseRecord(phase=p, started_at=T0 + dt.timedelta(seconds=i), duration_seconds=1.0)
        for i, p in enumerate((Phase.LOADING, Phase.WARMUP, Phase.PROFILING, Phase.CAPTURING, Phase.CANARY))
    ]
    return WorkerReport(
        worker=WorkerIdentity(pod_name=pod, namespace=namespace, instance=instance, started_at=T0),
        model_name="smollm2",
        model_revision=model_revision,
        graph_config_hash=config_hash(graphs),
        mode=graphs.mode,
        generation=generation,
        phase=phase,
        phases=phases,
        modes=[ModeKeys(kind="FULL", configured=list(sizes), captured=list(sizes))],
        coverage=coverage if coverage is not None else (passed / len(sizes) if sizes else 1.0),
        keys=keys,
        graph_memory=GraphMemory(estimate_bytes=sum(s << 20 for s in sizes), actual_bytes=sum(s << 20 for s in sizes)),
        kv_cache=KvCacheCapacity(num_blocks=512, block_size=16, tokens=8192),
        effective_capacity_tokens_per_second=capacity,
        degraded_reason=degraded_reason,
        failure_reason=failure_reason,
        updated_at=T0 + dt.timedelta(seconds=10),
    )


def spec_dict(**overrides: Any) -> dict[str, Any]:
    """A minimal valid GraphServing spec as JSON (camelCase), with top-level overrides."""
    spec: dict[str, Any] = {
        "model": {"name": "smollm2", "source": {"path": "/models/smollm2.gguf"}, "revision": REVISION},
        "runtime": {"engine": {"maxNumSeqs": 8, "maxNumBatchedTokens": 256}},
        "graphs": {"mode": "FULL", "captureSizes": [1, 2, 4, 8]},
    }
    spec.update(overrides)
    return spec


def rendered_engine(gs) -> dict[str, Any]:
    """The ``engine`` section of the worker configuration the operator renders into ``gs``'s
    Deployment (``GRAPHSERVING_WORKER_CONFIG``), after checking it is a valid WorkerConfig."""
    import json

    from graphserving.contract.worker_config import WorkerConfig
    from graphserving.operator import children

    dep = children.deployment(gs, "r", 1, gs.spec.graphs.to_worker())
    env = {e["name"]: e for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
    config = json.loads(env["GRAPHSERVING_WORKER_CONFIG"]["value"])
    WorkerConfig.model_validate(config)
    return config["engine"]


def rfc3339(t: dt.datetime) -> str:
    """A metav1.Time as the API serves it (UTC, whole seconds)."""
    return t.astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def worker_status(
    *,
    restarts: int = 0,
    running_since: dt.datetime | None = T0,
    waiting: str | None = None,
    last_exit: tuple[int, str] | None = None,
    last_started: dt.datetime | None = None,
) -> dict[str, Any]:
    """The ``worker`` entry of ``status.containerStatuses`` as the kubelet writes it (camelCase).

    ``running_since`` None with ``waiting`` None leaves the state terminated with ``last_exit``.
    """
    if running_since is not None:
        state: dict[str, Any] = {"running": {"startedAt": rfc3339(running_since)}}
    elif waiting is not None:
        state = {"waiting": {"reason": waiting, "message": f"back-off restarting failed container={waiting}"}}
    else:
        code, reason = last_exit or (0, "Completed")
        state = {"terminated": {"exitCode": code, "reason": reason}}
    last: dict[str, Any] = {}
    if last_exit is not None and (running_since is not None or waiting is not None):
        code, reason = last_exit
        terminated = {"exitCode": code, "reason": reason, "finishedAt": rfc3339(T0)}
        if last_started is not None:
            terminated["startedAt"] = rfc3339(last_started)
        last = {"terminated": terminated}
    return {"name": "worker", "image": "graphserving-worker", "ready": running_since is not None,
            "restartCount": restarts, "state": state, "lastState": last}
