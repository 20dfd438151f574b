"""Fake nodes for scale tests: kwok against the local control plane.

kwok (``sigs.k8s.io/kwok``) simulates the kubelet of many nodes without processes. Its default
pod stages set every ``spec.readinessGates`` condition to True together with ``Ready``, which
would hide exactly what the operator's graph-gated readiness must decide. So this module runs
kwok with our own Stages (supplying any Stage replaces all of kwok's defaults, so node stages are
included too):

* ``node-initialize`` / ``node-heartbeat``: fake nodes become Ready and keep their Lease fresh;
* ``pod-running``: a pod on a fake node gets Running with its containers ready and
  ``ContainersReady`` True; ``Ready`` is True only when it has no readiness gates;
* ``pod-gates-ready`` / ``pod-gates-unready``: ``Ready`` follows the readiness-gate conditions
  that someone else (the operator, a test) writes, never set by kwok itself;
* ``pod-delete``: deleted pods go away at once.

Fake nodes carry the annotation ``kwok.x-k8s.io/node: fake`` (kwok manages only those) and
the taint ``kwok.x-k8s.io/node=fake:NoSchedule``: a pod must tolerate it to land there, so the
real local node keeps the pods that need processes. Their pod IPs come from the part of the pod
range that no node agent claims (:func:`graphserving.dev.pod_network.fake_pod_subnet`).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from graphserving.dev import binaries, cluster, pod_network

FAKE_ANNOTATION = "kwok.x-k8s.io/node"
FAKE_TAINT = {"key": "kwok.x-k8s.io/node", "value": "fake", "effect": "NoSchedule"}
FAKE_TOLERATION = {"key": "kwok.x-k8s.io/node", "operator": "Equal", "value": "fake", "effect": "NoSchedule"}

# jq over the pod: "yes" when every readiness gate has a condition with status "True".
_GATES_HOLD = ('(([.spec.readinessGates[]?.conditionType]) - ([.status.conditions[]? | '
               'select(.status == "True") | .type]) | length == 0) | tostring')

_NODE_STATUS = """\
{{ $now := Now }}
conditions:
- {type: Ready, status: "True", reason: KubeletReady, message: kwok fake node, lastHeartbeatTime: {{ $now | Quote }}, lastTransitionTime: {{ or .metadata.creationTimestamp $now | Quote }}}
- {type: MemoryPressure, status: "False", reason: KubeletHasSufficientMemory, lastHeartbeatTime: {{ $now | Quote }}, lastTransitionTime: {{ or .metadata.creationTimestamp $now | Quote }}}
- {type: DiskPressure, status: "False", reason: KubeletHasNoDiskPressure, lastHeartbeatTime: {{ $now | Quote }}, lastTransitionTime: {{ or .metadata.creationTimestamp $now | Quote }}}
- {type: PIDPressure, status: "False", reason: KubeletHasSufficientPID, lastHeartbeatTime: {{ $now | Quote }}, lastTransitionTime: {{ or .metadata.creationTimestamp $now | Quote }}}
addresses:
- {type: InternalIP, address: {{ NodeIP | Quote }}}
- {type: Hostname, address: {{ .metadata.name | Quote }}}
phase: Running
"""

_POD_RUNNING = """\
{{ $now := Now }}
{{ $gated := false }}{{ range .spec.readinessGates }}{{ $gated = true }}{{ end }}
conditions:
- {type: PodReadyToStartContainers, status: "True", lastTransitionTime: {{ $now | Quote }}}
- {type: Initialized, status: "True", lastTransitionTime: {{ $now | Quote }}}
- {type: ContainersReady, status: "True", lastTransitionTime: {{ $now | Quote }}}
{{ if $gated }}
- {type: Ready, status: "False", reason: ReadinessGatesNotReady, lastTransitionTime: {{ $now | Quote }}}
{{ else }}
- {type: Ready, status: "True", lastTransitionTime: {{ $now | Quote }}}
{{ end }}
containerStatuses:
{{ range .spec.containers }}
- {name: {{ .name | Quote }}, image: {{ .image | Quote }}, ready: true, started: true, restartCount: 0, state: {running: {startedAt: {{ $now | Quote }}}}}
{{ end }}
{{ with NodeIPWith .spec.nodeName }}
hostIP: {{ . | Quote }}
{{ end }}
{{ with PodIPWith .spec.nodeName false (or .metadata.uid "") (or .metadata.name "") (or .metadata.namespace "") }}
podIP: {{ . | Quote }}
podIPs: [{ip: {{ . | Quote }}}]
{{ end }}
phase: Running
startTime: {{ $now | Quote }}
"""


def _ready_template(status: str, reason: str) -> str:
    line = f'- {{type: Ready, status: "{status}", lastTransitionTime: {{{{ Now | Quote }}}}'
    line += f", reason: {reason}}}" if reason else "}"
    return "conditions:\n" + line + "\n"


def stages() -> list[dict]:
    """The kwok Stage objects described in the module docstring."""
    def stage(name: str, kind: str, selector: list[dict], template: str | None = None,
              delete: bool = False, delay_ms: int | None = None) -> dict:
        nxt: dict = {"delete": True} if delete else {
            "patches": [{"subresource": "status", "type": "strategic", "root": "status", "template": template}]}
        spec: dict = {"resourceRef": {"apiGroup": "v1", "kind": kind},
                      "selector": {"matchExpressions": selector}, "next": nxt}
        if delay_ms is not None:
            spec["delay"] = {"durationMilliseconds": delay_ms, "jitterDurationMilliseconds": delay_ms + 5000}
        return {"apiVersion": "kwok.x-k8s.io/v1alpha1", "kind": "Stage", "metadata": {"name": name}, "spec": spec}

    ready = '.status.conditions.[] | select( .type == "Ready" ) | .status'
    alive = {"key": ".metadata.deletionTimestamp", "operator": "DoesNotExist"}
    return [
        stage("node-initialize", "Node", [{"key": ready, "operator": "NotIn", "values": ["True"]}], _NODE_STATUS),
        stage("node-heartbeat", "Node", [{"key": ready, "operator": "In", "values": ["True"]}],
              _NODE_STATUS, delay_ms=20000),
        stage("pod-running", "Pod", [alive, {"key": ".status.phase", "operator": "In", "values": ["Pending"]}],
              _POD_RUNNING),
        stage("pod-gates-ready", "Pod", [
            alive, {"key": ".status.phase", "operator": "In", "values": ["Running"]},
            {"key": ready, "operator": "NotIn", "values": ["True"]},
            {"key": _GATES_HOLD, "operator": "In", "values": ["true"]}],
            _ready_template("True", "")),
        stage("pod-gates-unready", "Pod", [
            alive, {"key": ".status.phase", "operator": "In", "values": ["Running"]},
            {"key": ready, "operator": "In", "values": ["True"]},
            {"key": _GATES_HOLD, "operator": "In", "values": ["false"]}],
            _ready_template("False", "ReadinessGatesNotReady")),
        stage("pod-delete", "Pod", [{"key": ".metadata.deletionTimestamp", "operator": "Exists"}], delete=True),
    ]


def fake_node(name: str, cpu: str = "32", memory: str = "256Gi", pods: str = "110",
              gpus: int = 0) -> dict:
    """A Node object that kwok will manage (annotated and tainted as fake)."""
    capacity = {"cpu": cpu, "memory": memory, "pods": pods}
    if gpus:
        capacity["nvidia.com/gpu"] = str(gpus)
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "annotations": {FAKE_ANNOTATION: "fake"},
                     "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                                "kubernetes.io/arch": "amd64", "type": "kwok"}},
        "spec": {"taints": [FAKE_TAINT]},
        "status": {"capacity": capacity, "allocatable": dict(capacity)},
    }


class Kwok:
    """A kwok process managing the fake nodes of a :class:`~graphserving.dev.cluster.LocalCluster`."""

    def __init__(self, local: cluster.LocalCluster) -> None:
        self.cluster = local
        self.dir = local.state_dir / "kwok"
        fake = pod_network.fake_pod_subnet(local.pod_range)
        #: kwok's ``--cidr`` (the gateway address and prefix of the fake pods' subnet) and ``--node-ip``.
        self.fake_node_ip = pod_network.gateway_address(fake)
        self.fake_pod_cidr = f"{self.fake_node_ip}/{fake.split('/')[1]}"
        self.proc: subprocess.Popen | None = None
        self.record: cluster.ProcessRecord | None = None

    def start(self) -> None:
        path = binaries.binary_path("kwok")
        if path is None:
            raise cluster.ClusterError("kwok is not built; run `graphserving dev build kwok`")
        self.dir.mkdir(parents=True, exist_ok=True)
        config = self.dir / "stages.yaml"
        config.write_text("\n---\n".join(json.dumps(s) for s in stages()))
        self.proc, self.record = cluster.spawn("kwok", [
            str(path), f"--kubeconfig={self.cluster.kubeconfig}", f"--config={config}",
            "--manage-all-nodes=false", f"--manage-nodes-with-annotation-selector={FAKE_ANNOTATION}=fake",
            # Fake pods and nodes get addresses from the part of the pod range no node agent claims:
            # while an agent runs it is unreachable from this machine, so nothing sent there leaves it.
            f"--cidr={self.fake_pod_cidr}", f"--node-ip={self.fake_node_ip}", "--node-lease-duration-seconds=40",
        ], self.dir / "kwok.log", die_with_parent=self.cluster.die_with_parent)
        self.cluster.records.append(self.record)

    def stop(self) -> None:
        if self.record is not None:
            cluster.terminate([self.record], grace=5)
            self.cluster.records.remove(self.record)
            self.record = None

    def __enter__(self) -> Kwok:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def log_path(local: cluster.LocalCluster) -> Path:
    return local.state_dir / "kwok" / "kwok.log"
