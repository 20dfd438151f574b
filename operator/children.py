"""The objects a GraphServing owns, built as plain dicts (pure).

- one Deployment per revision (``<name>-<revision hash>``), its Pods carrying the readiness gate
  ``graphserving.io/graphs-ready``, the rendered :class:`WorkerConfig` in
  ``GRAPHSERVING_WORKER_CONFIG``, ``GRAPHSERVING_API_KEY`` from ``runtime.apiKeySecretRef`` (a
  ``secretKeyRef``: the operator never reads the Secret) and ``--tool-call-parser`` when set;
- a stable Service over every revision (``<name>``: ``status.url`` and ``status.address`` name it)
  and a Service per revision;
- a PodDisruptionBudget over every revision.

Worker Pods pass the Pod Security Standard ``restricted`` profile (the API server's PodSecurity
admission; tests/operator/test_pod_security_cluster.py): they run as the worker image's non-root
user (uid/gid 65532, images/worker.Dockerfile) with RuntimeDefault seccomp, no privilege
escalation, every capability dropped and a read-only root filesystem; what the worker writes (converted tokenizers, Triton and
TorchInductor kernels, the CUDA JIT cache, temporary files) goes to an emptyDir at ``/tmp``, named
by each library's own environment variable. ``spec.podTemplate.securityContext`` and
``containerSecurityContext`` are merged over these defaults, key by key.

The operator applies them with server-side apply (field manager ``graphserving-operator``) and
owner references to the GraphServing. A revision's pod template is rendered once, when its
Deployment is created, and never rewritten: changing it would restart the Pods, which only a new
revision may do. Graph-only changes reach running Pods through the recapture trigger instead.
"""

from __future__ import annotations

import json
import math
from typing import Any

from graphserving.contract import graphserving_types as api
from graphserving.contract import pod_template
from graphserving.contract import worker_config as wc
from graphserving.contract.report import config_hash
from graphserving.contract.runtime_spec import API_KEY_ENV, TOOL_CALL_PARSER_FLAG
from . import naming

MODEL_MOUNT = "/models"
#: Startup budget when nothing was measured yet: load + warmup + capture + canary, seconds.
DEFAULT_STARTUP_SECONDS = 1800.0
STARTUP_MARGIN = 2.0
STARTUP_SLACK_SECONDS = 60.0
PROBE_PERIOD_SECONDS = 5
TERMINATION_GRACE_SECONDS = 60
#: The worker image's user and group (images/worker.Dockerfile ``USER``).
WORKER_UID = 65532
POD_SECURITY_CONTEXT: dict[str, Any] = {
    "runAsNonRoot": True,
    "runAsUser": WORKER_UID,
    "runAsGroup": WORKER_UID,
    "fsGroup": WORKER_UID,
    # Only when the volume root's owner differs: a large model PVC is not re-chowned at every start.
    "fsGroupChangePolicy": "OnRootMismatch",
    "seccompProfile": {"type": "RuntimeDefault"},
}
CONTAINER_SECURITY_CONTEXT: dict[str, Any] = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
}
#: The worker's writable scratch (an emptyDir): the root filesystem is read-only.
SCRATCH_VOLUME = "worker-tmp"
SCRATCH_DIR = "/tmp"
SCRATCH_SIZE_LIMIT = "4Gi"
#: The shared-memory volume of a multi-GPU (tensor-parallel) worker, mounted at /dev/shm.
SHM_VOLUME = "worker-shm"
#: Caches the worker writes, each under its library's own variable, moved into the scratch volume
#: (their defaults are under ``$HOME``, which the image sets to ``/tmp`` but another image may not).
SCRATCH_ENV: dict[str, str] = {
    "GRAPHSERVING_CACHE_DIR": f"{SCRATCH_DIR}/graphserving",  # converted tokenizers (runtime/model/loader.py)
    "TRITON_CACHE_DIR": f"{SCRATCH_DIR}/triton",  # compiled Triton kernels (default ~/.triton/cache)
    "TORCHINDUCTOR_CACHE_DIR": f"{SCRATCH_DIR}/torchinductor",
    "CUDA_CACHE_PATH": f"{SCRATCH_DIR}/nv-compute-cache",  # the driver's PTX JIT cache (default ~/.nv)
    "XDG_CACHE_HOME": f"{SCRATCH_DIR}/cache",  # huggingface, torch hub
}


def owner_reference(gs: api.GraphServing) -> dict[str, Any]:
    return {
        "apiVersion": api.API_VERSION,
        "kind": api.KIND,
        "name": gs.metadata.name,
        "uid": gs.metadata.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def owned_by(obj: dict[str, Any], uid: str | None) -> bool:
    """Whether ``obj``'s owner references name the object with ``uid``."""
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return any(r.get("uid") == uid for r in refs)


def model_path(source: api.ModelSource) -> str:
    """Where the worker finds the weights inside its Pod."""
    if source.path is not None:
        return source.path
    sub = (source.pvc or source.image).sub_path  # type: ignore[union-attr]
    return f"{MODEL_MOUNT}/{sub}".rstrip("/") if sub else MODEL_MOUNT


def worker_config(spec: api.GraphServingSpec, graphs: wc.GraphConfig) -> wc.WorkerConfig:
    """The worker configuration rendered from ``spec`` (host is the Pod IP, expanded by the kubelet)."""
    return wc.WorkerConfig(
        model_name=spec.model.name,
        model_path=model_path(spec.model.source),
        revision=spec.model.revision,
        dtype=spec.model.dtype,
        device="cuda" if spec.runtime.gpus > 0 else "cpu",
        host="$(POD_IP)",
        port=spec.runtime.port,
        engine=spec.runtime.engine.to_worker(),
        graphs=graphs,
        tensor_parallel_size=max(1, spec.runtime.gpus),  # one rank per GPU of the Pod
    )


def startup_failure_threshold(measured_startup_seconds: float | None) -> int:
    """Startup-probe failureThreshold covering load + capture.

    ``STARTUP_MARGIN`` x the longest measured Loading-to-serving time of earlier workers plus
    ``STARTUP_SLACK_SECONDS`` (``DEFAULT_STARTUP_SECONDS`` before anything was measured), divided by
    the probe period.
    """
    budget = (
        DEFAULT_STARTUP_SECONDS
        if measured_startup_seconds is None
        else STARTUP_MARGIN * measured_startup_seconds + STARTUP_SLACK_SECONDS
    )
    return max(3, math.ceil(budget / PROBE_PERIOD_SECONDS))


def _resources(runtime: api.RuntimeSpec) -> dict[str, Any]:
    requests = dict(runtime.resources.requests or {})
    limits = dict(runtime.resources.limits or {})
    if runtime.gpus:
        limits["nvidia.com/gpu"] = str(runtime.gpus)
    out: dict[str, Any] = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def _model_volume(source: api.ModelSource) -> tuple[list[dict], list[dict]]:
    if source.pvc is not None:
        volume = {"name": "model", "persistentVolumeClaim": {"claimName": source.pvc.claim_name, "readOnly": True}}
    elif source.image is not None:
        volume = {"name": "model", "image": {"reference": source.image.reference, "pullPolicy": source.image.pull_policy}}
    else:
        return [], []
    return [volume], [{"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True}]


def _field_env(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def merged(default: dict[str, Any], override: dict[str, Any] | None) -> dict[str, Any]:
    """``default`` with the keys of ``override`` replacing its own (one level: a given
    ``seccompProfile`` or ``capabilities`` replaces the default one whole)."""
    return {**default, **(override or {})}


def _scratch_env(user_env: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """:data:`SCRATCH_ENV` less the variables ``podTemplate.env`` sets itself (its value wins)."""
    given = {e.get("name") for e in user_env}
    return [{"name": k, "value": v} for k, v in SCRATCH_ENV.items() if k not in given]


def api_key_env(runtime: api.RuntimeSpec) -> list[dict[str, Any]]:
    """``GRAPHSERVING_API_KEY`` from ``runtime.apiKeySecretRef`` (a ``secretKeyRef``: the operator
    never reads the Secret), or nothing when no key is asked for."""
    ref = runtime.api_key_secret_ref
    if ref is None:
        return []
    return [{"name": API_KEY_ENV, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}]


def worker_args(runtime: api.RuntimeSpec) -> list[str]:
    """The worker's command-line flags beyond its configuration: ``--tool-call-parser`` when
    ``runtime.engine.toolCallParser`` is set (unset: the worker's default)."""
    parser = runtime.engine.tool_call_parser
    return [TOOL_CALL_PARSER_FLAG, parser] if parser is not None else []


def worker_container(
    spec: api.GraphServingSpec,
    graphs: wc.GraphConfig,
    measured_startup_seconds: float | None,
    model_mounts: list[dict],
) -> dict[str, Any]:
    """The ``worker`` container: image, command and :func:`worker_args`, the rendered config in
    ``GRAPHSERVING_WORKER_CONFIG``, the Pod's identity, the scratch caches and the API key
    (:func:`api_key_env`) in env (the revision too, from the Pod's label), probes (``/healthz``, ``/readyz``), resources, mounts (the model,
    scratch at ``/tmp``) and the restricted securityContext."""
    overrides = spec.pod_template
    config = worker_config(spec, graphs)
    env = [
        _field_env("POD_NAME", "metadata.name"),
        _field_env("POD_NAMESPACE", "metadata.namespace"),
        _field_env("POD_IP", "status.podIP"),
        # the worker names its revision in every response (X-GraphServing-Revision)
        _field_env("GRAPHSERVING_REVISION", f"metadata.labels['{naming.LABEL_REVISION}']"),
        # tensor_parallel_size 1 stays out: the JSON of single-GPU workers is what it was before the field
        {"name": "GRAPHSERVING_WORKER_CONFIG",
         "value": config.model_dump_json(exclude_none=True, exclude={"tensor_parallel_size"}
                                         if config.tensor_parallel_size == 1 else None)},
        *_scratch_env(overrides.env or []),
        *(overrides.env or []),
        *api_key_env(spec.runtime),
    ]
    container: dict[str, Any] = {
        "name": pod_template.WORKER_CONTAINER,
        "image": spec.runtime.image,
        "imagePullPolicy": spec.runtime.image_pull_policy,
        "command": list(spec.runtime.command or ["graphserving-worker"]),
        **({"args": args} if (args := worker_args(spec.runtime)) else {}),
        "env": env,
        "ports": [{"name": "http", "containerPort": spec.runtime.port, "protocol": "TCP"}],
        **_probes(measured_startup_seconds),
    }
    resources = _resources(spec.runtime)
    if resources:
        container["resources"] = resources
    container["volumeMounts"] = [
        *model_mounts, {"name": SCRATCH_VOLUME, "mountPath": SCRATCH_DIR}, *(overrides.volume_mounts or [])
    ]
    container["securityContext"] = merged(CONTAINER_SECURITY_CONTEXT, overrides.container_security_context)
    return container


def _probes(measured_startup_seconds: float | None) -> dict[str, Any]:
    return {
        "startupProbe": {
            "httpGet": {"path": "/healthz", "port": "http"},
            "periodSeconds": PROBE_PERIOD_SECONDS,
            "failureThreshold": startup_failure_threshold(measured_startup_seconds),
        },
        "livenessProbe": {
            "httpGet": {"path": "/healthz", "port": "http"},
            "periodSeconds": 10,
            "timeoutSeconds": 5,
            "failureThreshold": 6,
        },
        "readinessProbe": {
            "httpGet": {"path": "/readyz", "port": "http"},
            "periodSeconds": PROBE_PERIOD_SECONDS,
            "failureThreshold": 2,
        },
    }


def worker_pod_spec(overrides: api.PodTemplateOverrides, container: dict[str, Any], model_volumes: list[dict]) -> dict[str, Any]:
    """The worker Pod's spec: the workers' ServiceAccount, the graphs-ready readiness gate, the
    restricted securityContext (merged with ``spec.podTemplate.securityContext``), the worker
    container then ``podTemplate.containers``, volumes (model, scratch, ``podTemplate.volumes``)
    and the scheduling and image pass-through fields of ``spec.podTemplate``."""
    pod_spec: dict[str, Any] = {
        "serviceAccountName": naming.WORKER_SERVICE_ACCOUNT,
        "readinessGates": [{"conditionType": naming.READINESS_GATE}],
        "terminationGracePeriodSeconds": TERMINATION_GRACE_SECONDS,
        "securityContext": merged(POD_SECURITY_CONTEXT, overrides.security_context),
        "containers": [container, *(overrides.containers or [])],
        "volumes": [
            *model_volumes,
            {"name": SCRATCH_VOLUME, "emptyDir": {"sizeLimit": SCRATCH_SIZE_LIMIT}},
            *(overrides.volumes or []),
        ],
    }
    for key, value in (
        ("initContainers", overrides.init_containers),
        ("imagePullSecrets", [r.to_api() for r in overrides.image_pull_secrets or []]),
        ("runtimeClassName", overrides.runtime_class_name),
        ("nodeSelector", overrides.node_selector),
        ("tolerations", overrides.tolerations),
        ("affinity", overrides.affinity),
        ("topologySpreadConstraints", overrides.topology_spread_constraints),
        ("priorityClassName", overrides.priority_class_name),
    ):
        if value:
            pod_spec[key] = value
    return pod_spec


def deployment(
    gs: api.GraphServing,
    revision: str,
    replicas: int,
    graphs: wc.GraphConfig,
    measured_startup_seconds: float | None = None,
) -> dict[str, Any]:
    """The Deployment of one revision.

    Args:
        gs: the GraphServing (its spec is the revision's spec).
        revision: :func:`naming.revision_hash` of ``gs.spec``.
        replicas: desired replicas (from the rollout step).
        graphs: the GraphConfig to start the workers with.
        measured_startup_seconds: longest measured startup of earlier workers, for the startup probe.
    """
    spec = gs.spec
    name = gs.metadata.name
    overrides = spec.pod_template
    model_volumes, model_mounts = _model_volume(spec.model.source)
    own_shm = any(m.get("mountPath") == "/dev/shm" for m in overrides.volume_mounts or [])
    if spec.runtime.gpus > 1 and not own_shm:  # NCCL between the ranks of one Pod uses /dev/shm (64 MiB by default)
        model_volumes = [*model_volumes, {"name": SHM_VOLUME, "emptyDir": {"medium": "Memory"}}]
        model_mounts = [*model_mounts, {"name": SHM_VOLUME, "mountPath": "/dev/shm"}]
    container = worker_container(spec, graphs, measured_startup_seconds, model_mounts)
    pod_labels = {**(overrides.labels or {}), **naming.revision_labels(name, revision)}
    pod_annotations = {
        **(overrides.annotations or {}),
        naming.ANNOTATION_MODEL_REVISION: spec.model.revision,
        naming.ANNOTATION_GRAPH_CONFIG_HASH: config_hash(graphs),
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": naming.revision_name(name, revision),
            "namespace": gs.metadata.namespace,
            "labels": naming.revision_labels(name, revision),
            "annotations": {
                naming.ANNOTATION_MODEL_REVISION: spec.model.revision,
                naming.ANNOTATION_GRAPH_CONFIG_HASH: config_hash(graphs),
                **({naming.ANNOTATION_DTYPE: spec.model.dtype} if spec.model.dtype else {}),
            },
            "ownerReferences": [owner_reference(gs)],
        },
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": naming.revision_selector_labels(name, revision)},
            "progressDeadlineSeconds": spec.rollout.progress_deadline_seconds,
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {
                "metadata": {"labels": pod_labels, "annotations": pod_annotations},
                "spec": worker_pod_spec(overrides, container, model_volumes),
            },
        },
    }


def _service(gs: api.GraphServing, name: str, selector: dict[str, str], component: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": name,
            "namespace": gs.metadata.namespace,
            "labels": naming.common_labels(gs.metadata.name, component=component),
            "ownerReferences": [owner_reference(gs)],
        },
        "spec": {
            "selector": selector,
            "ports": [{"name": "http", "port": gs.spec.runtime.port, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def service_address(service: dict[str, Any]) -> str:
    """``<name>.<namespace>.svc:<port>`` of a Service built here: its cluster DNS name (resolvable
    from every namespace of the cluster) and its ``http`` port."""
    meta = service["metadata"]
    return f"{meta['name']}.{meta['namespace']}.svc:{service['spec']['ports'][0]['port']}"


def stable_service(gs: api.GraphServing) -> dict[str, Any]:
    """``<name>``: every ready worker of every revision."""
    name = gs.metadata.name
    return _service(gs, naming.stable_service_name(name), naming.selector_labels(name), "service")


def revision_service(gs: api.GraphServing, revision: str) -> dict[str, Any]:
    """``<name>-<revision>``: the ready workers of one revision (the HTTPRoute's backends)."""
    name = gs.metadata.name
    return _service(
        gs, naming.revision_name(name, revision), naming.revision_selector_labels(name, revision), "revision-service"
    )


def pod_disruption_budget(gs: api.GraphServing) -> dict[str, Any]:
    """Voluntary disruptions keep ``ceil(minAvailableCapacity x replicas)`` ready pods.

    Pods are counted, not capacity (a PDB cannot weigh pods); not-ready pods may always be evicted.
    """
    name = gs.metadata.name
    min_available = math.ceil(gs.spec.rollout.min_available_capacity * gs.spec.replicas - 1e-9)
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {
            "name": name,
            "namespace": gs.metadata.namespace,
            "labels": naming.common_labels(name, component="disruption-budget"),
            "ownerReferences": [owner_reference(gs)],
        },
        "spec": {
            "minAvailable": min_available,
            "selector": {"matchLabels": naming.selector_labels(name)},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


def worker_rbac(namespace: str) -> list[dict[str, Any]]:
    """The workers' identity in ``namespace``: ServiceAccount, Role (get/patch pods), RoleBinding.

    Shared by every GraphServing of the namespace, so not owned by any one of them. RBAC lets a
    worker patch any pod of its namespace; the ValidatingAdmissionPolicy
    ``graphserving-worker-own-pod`` narrows that to its own Pod's report annotation.
    """
    labels = {
        "app.kubernetes.io/name": "graphserving",
        "app.kubernetes.io/component": "worker-identity",
        "app.kubernetes.io/part-of": "graphserving",
        "app.kubernetes.io/managed-by": naming.MANAGED_BY,
    }
    name = naming.WORKER_SERVICE_ACCOUNT
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount",
         "metadata": {"name": name, "namespace": namespace, "labels": labels}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
         "metadata": {"name": name, "namespace": namespace, "labels": labels},
         "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "patch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": {"name": name, "namespace": namespace, "labels": labels},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
         "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}]},
    ]


def content_key(obj: dict[str, Any]) -> str:
    """A stable string of an object's content, to skip re-applying unchanged children."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))
