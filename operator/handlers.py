"""kopf handlers: thin. Every watch event only enqueues the owning GraphServing's key.

Deployments and Pods feed the reconcile; Services, PodDisruptionBudgets and HTTPRoutes are watched
so that one deleted or edited by someone else is applied again. Only ``@kopf.on.event`` handlers
are used: they need no progress or diff-base storage and no finalizer, so kopf writes nothing on
our objects (no ``kopf.zalando.org/*`` annotations, no ``status.kopf``). The reconcile itself
(:mod:`graphserving.operator.reconcile`) runs from a work queue, one key at a time, in worker
threads.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import kopf

from graphserving.contract import graphserving_types as api
from . import naming, routing
from .kube import Clients, bounded_api_client, load_kube_config
from .metrics import OperatorMetrics
from .reconcile import Reconciler
from .workqueue import WorkQueue

log = logging.getLogger(__name__)
MANAGED = {"app.kubernetes.io/managed-by": naming.MANAGED_BY}


@dataclasses.dataclass
class ReconcileLoop:
    """The process's reconcile loop, shared by the handlers: its metrics, the reconciler (over the
    API clients) and the work queue that runs it in ``workers`` threads.

    :func:`configure` sets ``metrics`` and ``workers`` before kopf starts; :func:`startup` builds the
    reconciler and starts the queue (``started``); :func:`cleanup` stops it.
    """

    metrics: OperatorMetrics = dataclasses.field(default_factory=OperatorMetrics)
    workers: int = 4
    reconciler: Reconciler | None = None
    queue: WorkQueue | None = None
    started: bool = False


#: The one loop of this process.
LOOP = ReconcileLoop()


def configure(metrics: OperatorMetrics | None = None, workers: int = 4) -> ReconcileLoop:
    LOOP.metrics = metrics or OperatorMetrics()
    LOOP.workers = workers
    return LOOP


def apply_settings(settings: kopf.OperatorSettings) -> None:
    """kopf settings: our own names if kopf ever persists anything, no kopf Events, modest timeouts."""
    settings.persistence.finalizer = f"{api.GROUP}/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=api.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=api.GROUP, key="last-handled-configuration"
    )
    settings.posting.enabled = False  # we post our own Events (graphserving.operator.events)
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.watching.connect_timeout = 10
    settings.networking.request_timeout = 30
    settings.execution.max_workers = 8


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
    load_kube_config()
    apply_settings(settings)
    LOOP.reconciler = Reconciler(Clients.from_api_client(bounded_api_client()), LOOP.metrics)
    LOOP.queue = WorkQueue(LOOP.reconciler.reconcile, workers=LOOP.workers, metrics=LOOP.metrics.workqueue)
    LOOP.queue.start()
    LOOP.started = True


@kopf.on.cleanup()
async def cleanup(**_: Any) -> None:
    if LOOP.queue is not None:
        await LOOP.queue.stop()
    LOOP.started = False


def _enqueue(namespace: str | None, name: str | None) -> None:
    if LOOP.queue is not None and namespace and name:
        LOOP.queue.add((namespace, name))


@kopf.on.event(api.GROUP, api.VERSION, api.PLURAL)
async def graphserving_event(event: dict, namespace: str, name: str, **_: Any) -> None:
    if event.get("type") == "DELETED":
        if LOOP.queue is not None:
            LOOP.queue.forget((namespace, name))
        if LOOP.reconciler is not None:
            LOOP.reconciler.forget(namespace, name)
        return
    _enqueue(namespace, name)


@kopf.on.event("apps", "v1", "deployments", labels=MANAGED)
async def deployment_event(namespace: str, labels: dict, **_: Any) -> None:
    _enqueue(namespace, labels.get(naming.LABEL_NAME))


@kopf.on.event("v1", "pods", labels=MANAGED)
async def pod_event(namespace: str, labels: dict, **_: Any) -> None:
    _enqueue(namespace, labels.get(naming.LABEL_NAME))


def _child_event(kind: str, namespace: str, name: str, labels: dict) -> None:
    # The reconciler skips children whose content it applied already; a child deleted or edited by
    # someone else must be applied again (our own no-op applies produce no further events).
    if LOOP.reconciler is not None:
        LOOP.reconciler.child_changed(kind, namespace, name)
    _enqueue(namespace, labels.get(naming.LABEL_NAME))


@kopf.on.event("v1", "services", labels=MANAGED)
async def service_event(namespace: str, name: str, labels: dict, **_: Any) -> None:
    _child_event("Service", namespace, name, labels)


@kopf.on.event("policy", "v1", "poddisruptionbudgets", labels=MANAGED)
async def pdb_event(namespace: str, name: str, labels: dict, **_: Any) -> None:
    _child_event("PodDisruptionBudget", namespace, name, labels)


@kopf.on.event(routing.GROUP, routing.VERSION, routing.PLURAL, labels=MANAGED)
async def httproute_event(namespace: str, name: str, labels: dict, **_: Any) -> None:
    _child_event("HTTPRoute", namespace, name, labels)
