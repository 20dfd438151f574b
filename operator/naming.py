"""Names, labels and hashes of the objects the operator owns.

Two hashes split a GraphServing's spec by what a change costs:

- the **revision hash** covers everything that changes the worker process (model, weights revision,
  dtype, runtime, pod overrides, and the operator's rendering version): a change rolls new pods
  (a new ``<name>-<revision hash>`` Deployment);
- the **graph config hash** (:func:`graphserving.contract.report.config_hash` of the rendered
  ``GraphConfig``) covers what only changes the graphs (mode, capture sizes, canary thresholds,
  readiness): a change recaptures in place through the worker's recapture trigger.
"""

from __future__ import annotations

import hashlib
import json

from graphserving.contract import graphserving_types as api

#: Bumped when the rendered pod template changes in a way that needs new pods.
TEMPLATE_VERSION = 1
REVISION_HASH_LENGTH = 10

FIELD_MANAGER = "graphserving-operator"
MANAGED_BY = "graphserving-operator"
READINESS_GATE = "graphserving.io/graphs-ready"
LABEL_NAME = "graphserving.io/name"
LABEL_REVISION = "graphserving.io/revision"
ANNOTATION_GRAPH_CONFIG_HASH = "graphserving.io/graph-config-hash"
ANNOTATION_MODEL_REVISION = "graphserving.io/model-revision"
ANNOTATION_DTYPE = "graphserving.io/dtype"
ANNOTATION_ACCEPTED_REPORT = "graphserving.io/accepted-report"
#: The worker container's ``restartCount`` the operator last posted an Event about (.restarts).
ANNOTATION_OBSERVED_RESTARTS = "graphserving.io/observed-restarts"
#: ``<instance>/<count>``: the online canary divergences the operator last posted an Event about.
ANNOTATION_OBSERVED_DIVERGENCES = "graphserving.io/observed-divergences"
#: JSON: the capacity first accepted from a worker instance and graph config (.capacity).
ANNOTATION_ACCEPTED_CAPACITY = "graphserving.io/accepted-capacity"
POD_DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
WORKER_SERVICE_ACCOUNT = "graphserving-worker"


def revision_hash(spec: api.GraphServingSpec) -> str:
    """10 hex digits of sha256 over the process-changing part of ``spec``.

    Covers ``model``, ``runtime`` and ``podTemplate`` (in their defaulted API form) and
    :data:`TEMPLATE_VERSION`; not ``graphs``, ``replicas``, ``rollout`` or ``routing``.
    """
    material = {
        "templateVersion": TEMPLATE_VERSION,
        "model": spec.model.to_api(),
        "runtime": spec.runtime.to_api(),
        "podTemplate": spec.pod_template.to_api(),
    }
    canonical = json.dumps(material, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:REVISION_HASH_LENGTH]


def revision_name(name: str, revision: str) -> str:
    """``<name>-<revision hash>``: the Deployment and per-revision Service of one revision."""
    return f"{name}-{revision}"


def stable_service_name(name: str) -> str:
    return name


def selector_labels(name: str) -> dict[str, str]:
    """Labels that select every worker pod of one GraphServing (all revisions)."""
    return {LABEL_NAME: name, "app.kubernetes.io/managed-by": MANAGED_BY}


def revision_selector_labels(name: str, revision: str) -> dict[str, str]:
    return {**selector_labels(name), LABEL_REVISION: revision}


def selector_string(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def common_labels(name: str, component: str = "worker") -> dict[str, str]:
    """The recommended ``app.kubernetes.io/*`` labels plus our selector label."""
    return {
        "app.kubernetes.io/name": "graphserving",
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/part-of": "graphserving",
        "app.kubernetes.io/managed-by": MANAGED_BY,
        LABEL_NAME: name,
    }


def revision_labels(name: str, revision: str) -> dict[str, str]:
    return {**common_labels(name), LABEL_REVISION: revision}
