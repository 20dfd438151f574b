"""A small node agent for development and CI machines without a container runtime.

**Production uses the kubelet.** This agent exists so that Pods scheduled to a local Node run as
real processes on a machine with no Docker or containerd, for the demo and end-to-end tests.
It implements just enough of the kubelet's contract:

* registers a ``Node`` (capacity: this machine's cpu and memory, 110 pods; a ``Ready`` condition)
  and renews its ``Lease`` in ``kube-node-lease`` every 10 s so the node lifecycle controller
  keeps it Ready;
* watches the Pods bound to it and starts each container's ``command`` + ``args`` as a process on
  this machine (the image is ignored; commands resolve on ``PATH``), init containers first,
  with the pod's env (incl. the downward API, see :mod:`graphserving.dev.pod_env`);
* runs the pods in a network namespace of its own (see :mod:`graphserving.dev.pod_network`):
  each pod gets its own address there as ``status.podIP`` from the agent's ``/24`` of
  ``10.244.0.0/16``, never reused while a pod holds it; processes must bind to it (the env var
  from ``fieldRef: status.podIP``), so several pods can use the same port. This machine reaches
  the pods through a veth pair;
* runs startup, readiness and liveness probes (httpGet, tcpSocket, exec) and restarts
  containers by ``restartPolicy`` with back-off;
* reports container statuses and computes ``Ready`` honouring ``spec.readinessGates``: Ready only
  when the containers are ready and every gate condition is True. It never writes a gate
  condition; those belong to whoever owns the gate (the operator);
* on deletion: SIGTERM to the process group, ``terminationGracePeriodSeconds``, SIGKILL, then
  deletes the Pod with grace period 0;
* credentials as the kubelet gives them: a service-account token from the TokenRequest API
  bound to the Pod (so the ``authentication.kubernetes.io/pod-name`` claim exists), handed to the
  process as a per-pod kubeconfig in ``KUBECONFIG`` (with ``tokenFile``, refreshed hourly) plus
  ``KUBERNETES_SERVICE_HOST``/``PORT``: ``kubernetes.config.load_config()`` just works. The
  address is the ``kubernetes`` Service's ClusterIP (``10.0.0.1:443``) inside the pods'
  namespace, where a :class:`~graphserving.dev.tcp_forwarder.TcpForwarder` of the agent relays
  to the API server on 127.0.0.1 (the serving certificate names that ClusterIP);
* logs: each container's stdout+stderr goes to
  ``<state-dir>/pods/<namespace>_<pod>_<uid>/<container>.log``
  (``graphserving dev logs POD`` prints it; ``kubectl logs`` does not work).

Not supported: volumes (processes see the host filesystem), images, resource limits, security
contexts, service links, ``preStop`` hooks, ports on the node IP, ephemeral containers.

Run with ``python -m graphserving.dev.node_agent --kubeconfig NODE.kubeconfig --node-name N
--state-dir DIR``; ``graphserving dev cluster up`` and the pytest fixtures start it for you.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import datetime as dt
import ipaddress
import json
import logging
import os
import platform
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client, config, watch
from kubernetes.client.rest import ApiException

from graphserving.dev import pod_env, pod_network, pod_status
from graphserving.dev.probes import ProbeTracker, run_probe
from graphserving.dev.tcp_forwarder import TcpForwarder

log = logging.getLogger("graphserving.node_agent")

LEASE_DURATION_SECONDS = 40
LEASE_RENEW_SECONDS = 10
NODE_STATUS_SECONDS = 30
#: Token lifetime asked for, like the kubelet (3607 s lets the API server extend it).
TOKEN_EXPIRATION_SECONDS = 3607
TOKEN_REFRESH_SECONDS = 50 * 60
#: Variables of the agent's own environment handed to every process (pod env overrides them).
PASS_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "VIRTUAL_ENV", "PYTHONPATH",
            "GRAPHSERVING_CACHE_DIR", "HF_HOME", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
TICK_SECONDS = 0.2
MAX_BACKOFF_SECONDS = 30.0
#: The ``kubernetes`` Service (first address of the cluster's service CIDR) and its port: where
#: pods reach the API server, as in a real cluster.
DEFAULT_SERVICE_IP = "10.0.0.1"
SERVICE_PORT = 443


def now_rfc3339() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def now_micro() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class IPPool:
    """Pod IPs from ``cidr`` (a subnet claimed by :mod:`pod_network`): lowest first, never twice while held."""

    def __init__(self, cidr: str) -> None:
        self.network = ipaddress.ip_network(cidr)
        self._held: dict[str, str] = {}  # ip -> pod uid
        self._lock = threading.Lock()

    def claim(self, uid: str, ip: str) -> bool:
        """Record that pod ``uid`` already holds ``ip`` (after an agent restart); False if taken or foreign."""
        if ipaddress.ip_address(ip) not in self.network or ip == pod_network.gateway_address(str(self.network)):
            return False
        with self._lock:
            if self._held.get(ip, uid) != uid:
                return False
            self._held[ip] = uid
            return True

    def allocate(self, uid: str) -> str:
        with self._lock:
            for ip, owner in self._held.items():
                if owner == uid:
                    return ip
            for address in self.network.hosts():
                ip = str(address)
                if ip.endswith(".0") or ip.endswith(".1") or ip in self._held:
                    continue
                self._held[ip] = uid
                return ip
        raise RuntimeError(f"pod CIDR {self.network} is exhausted")

    def release(self, uid: str) -> None:
        with self._lock:
            for ip in [ip for ip, owner in self._held.items() if owner == uid]:
                del self._held[ip]

    def held(self) -> dict[str, str]:
        with self._lock:
            return dict(self._held)


def _host_memory_bytes() -> int:
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return 0


def node_object(name: str, kubelet_version: str, host_ip: str = "127.0.0.1") -> dict:
    """The Node this agent registers: this machine's capacity; ``host_ip`` as seen from its pods."""
    capacity = {"cpu": str(os.cpu_count() or 1), "memory": f"{_host_memory_bytes() // 1024}Ki",
                "pods": "110", "ephemeral-storage": "100Gi"}
    arch = {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": {
            "kubernetes.io/hostname": name, "kubernetes.io/os": "linux", "kubernetes.io/arch": arch,
            "graphserving.io/dev-node-agent": "true"}},
        "spec": {},
        "status": {
            "capacity": capacity, "allocatable": dict(capacity),
            "addresses": [{"type": "InternalIP", "address": host_ip}, {"type": "Hostname", "address": name}],
            "nodeInfo": {"kubeletVersion": kubelet_version, "kubeProxyVersion": "",
                         "operatingSystem": "linux", "architecture": arch,
                         "osImage": platform.platform(), "kernelVersion": platform.release(),
                         "containerRuntimeVersion": "graphserving-node-agent://0.1",
                         "machineID": "", "systemUUID": "", "bootID": ""},
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 0}},
        },
    }


def node_conditions(heartbeat: str, transition: str) -> list[dict]:
    healthy = [("MemoryPressure", "KubeletHasSufficientMemory"), ("DiskPressure", "KubeletHasNoDiskPressure"),
               ("PIDPressure", "KubeletHasSufficientPID")]
    conditions = [{"type": t, "status": "False", "reason": r, "message": "", "lastHeartbeatTime": heartbeat,
                   "lastTransitionTime": transition} for t, r in healthy]
    conditions.append({"type": "Ready", "status": "True", "reason": "KubeletReady",
                       "message": "graphserving development node agent is posting ready status",
                       "lastHeartbeatTime": heartbeat, "lastTransitionTime": transition})
    return conditions


class Container:
    """One container of a pod: its process, restart state and probes."""

    def __init__(self, spec: dict, init: bool = False) -> None:
        self.spec = spec
        self.name: str = spec["name"]
        self.init = init
        self.proc: subprocess.Popen | None = None
        self.started_at: str | None = None
        self.started_mono = 0.0
        self.restart_count = 0
        self.last_terminated: dict | None = None
        self.waiting: tuple[str, str] | None = ("ContainerCreating", "")
        self.terminated: dict | None = None  # final state when it will not restart
        self.next_start = 0.0
        self.backoff = 1.0
        self.startup: ProbeTracker | None = None
        self.readiness: ProbeTracker | None = None
        self.liveness: ProbeTracker | None = None
        self.started = False
        self.ready = False

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def state(self) -> dict:
        if self.running:
            return {"running": {"startedAt": self.started_at}}
        if self.terminated is not None:
            return {"terminated": self.terminated}
        reason, message = self.waiting or ("ContainerCreating", "")
        return {"waiting": {"reason": reason, **({"message": message} if message else {})}}

    def status(self) -> dict:
        status = {
            "name": self.name, "image": self.spec.get("image", ""), "imageID": "",
            "containerID": f"graphserving://{self.proc.pid}" if self.proc else None,
            "ready": self.ready, "started": self.started if not self.init else None,
            "restartCount": self.restart_count, "state": self.state(),
            "lastState": {"terminated": self.last_terminated} if self.last_terminated else {},
        }
        return status


class PodRunner:
    """Runs one pod in its own thread: allocation, credentials, processes, probes, status, deletion."""

    def __init__(self, agent: NodeAgent, pod: dict) -> None:
        meta = pod["metadata"]
        self.thread = threading.Thread(target=self.run, name=f"pod-{meta['namespace']}/{meta['name']}", daemon=True)
        self.agent = agent
        self.uid: str = meta["uid"]
        self.namespace: str = meta["namespace"]
        self.pod_name: str = meta["name"]
        self.pod = pod
        self._lock = threading.Lock()
        self.gone = threading.Event()  # the API object is deleted
        self.stop_now = threading.Event()  # the agent shuts down
        self.dir = agent.state_dir / "pods" / f"{self.namespace}_{self.pod_name}_{self.uid}"
        self.init_containers = [Container(c, init=True) for c in pod["spec"].get("initContainers") or []]
        self.containers = [Container(c) for c in pod["spec"]["containers"]]
        self.pod_ip = ""
        self.start_time = pod.get("status", {}).get("startTime") or now_rfc3339()
        self.env_base: dict[str, str] = {}
        self.token_written = 0.0
        self.last_reported: str = ""
        self.patched_rv: str | None = None
        self.terminal = False

    def start(self) -> None:
        self.thread.start()

    def is_alive(self) -> bool:
        return self.thread.is_alive()

    def join(self, timeout: float | None = None) -> None:
        self.thread.join(timeout)

    # -- inputs from the watch ---------------------------------------------------------------
    def update(self, pod: dict) -> None:
        with self._lock:
            self.pod = pod

    def current(self) -> dict:
        with self._lock:
            return self.pod

    # -- main loop ---------------------------------------------------------------------------
    def run(self) -> None:
        try:
            self._setup()
            while not self.gone.is_set() and not self.stop_now.is_set():
                pod = self.current()
                if pod["metadata"].get("deletionTimestamp"):
                    self._terminate_gracefully(pod)
                    return
                self._step(pod)
                self._report(pod)
                self.gone.wait(TICK_SECONDS)
        except Exception:  # noqa: BLE001 - a pod's failure must not take the agent down
            log.exception("pod %s/%s: runner failed", self.namespace, self.pod_name)
        finally:
            self._kill_all(grace=0 if self.gone.is_set() else 5)
            if self.pod_ip:
                with contextlib.suppress(pod_network.PodNetworkError):
                    self.agent.network.remove_address(self.pod_ip)
            self.agent.pool.release(self.uid)

    def _setup(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        pod = self.current()
        existing = pod.get("status", {}).get("podIP")
        if existing and self.agent.pool.claim(self.uid, existing):
            self.pod_ip = existing
        else:
            self.pod_ip = self.agent.pool.allocate(self.uid)
        self.agent.network.add_address(self.pod_ip)
        self.env_base = {k: os.environ[k] for k in PASS_ENV if k in os.environ}
        self.env_base["HOSTNAME"] = self.pod_name
        self._report(pod, force=True)

    def _credentials(self, pod: dict) -> dict[str, str]:
        """Write (or refresh) the pod's token and kubeconfig; returns the env that points at them."""
        if pod["spec"].get("automountServiceAccountToken") is False:
            return {}
        if time.monotonic() - self.token_written > TOKEN_REFRESH_SECONDS or not self.token_written:
            token = self.agent.request_token(pod)
            token_path = self.dir / "token"
            tmp = token_path.with_suffix(".tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as fh:
                fh.write(token)
            os.replace(tmp, token_path)
            kubeconfig = {
                "apiVersion": "v1", "kind": "Config",
                "clusters": [{"name": "local", "cluster": {
                    "server": self.agent.pod_server,
                    "certificate-authority-data": base64.b64encode(self.agent.ca_pem).decode()}}],
                "users": [{"name": "pod", "user": {"tokenFile": str(token_path)}}],
                "contexts": [{"name": "pod", "context": {"cluster": "local", "user": "pod",
                                                         "namespace": self.namespace}}],
                "current-context": "pod",
            }
            path = self.dir / "kubeconfig"
            fd = os.open(path.with_suffix(".tmp"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as fh:
                yaml.safe_dump(kubeconfig, fh, sort_keys=False)
            os.replace(path.with_suffix(".tmp"), path)
            (self.dir / "ca.crt").write_bytes(self.agent.ca_pem)
            self.token_written = time.monotonic()
        host, port = self.agent.service_host_port
        return {"KUBECONFIG": str(self.dir / "kubeconfig"), "KUBERNETES_SERVICE_HOST": host,
                "KUBERNETES_SERVICE_PORT": str(port), "KUBERNETES_SERVICE_PORT_HTTPS": str(port),
                "KUBERNETES_NAMESPACE": self.namespace}

    def _pod_for_env(self, pod: dict) -> dict:
        view = json.loads(json.dumps(pod))
        status = view.setdefault("status", {})
        status["podIP"] = self.pod_ip
        status["podIPs"] = [{"ip": self.pod_ip}]
        status["hostIP"] = self.agent.host_ip
        status["hostIPs"] = [{"ip": self.agent.host_ip}]
        return view

    def _container_env(self, pod: dict, spec: dict) -> dict[str, str]:
        env = dict(self.env_base)
        env.update(self._credentials(pod))
        env.update(pod_env.resolve_env(self._pod_for_env(pod), spec, self.agent.allocatable,
                                       self.agent.config_map_getter(self.namespace),
                                       self.agent.secret_getter(self.namespace)))
        return env

    def _start(self, pod: dict, c: Container) -> None:
        try:
            env = self._container_env(pod, c.spec)
            argv = pod_env.command_line(c.spec, env)
        except (pod_env.EnvError, ApiException) as exc:
            reason = "CreateContainerConfigError"
            c.waiting = (reason, str(exc) if isinstance(exc, pod_env.EnvError) else f"API error: {exc.reason}")
            c.next_start = time.monotonic() + c.backoff
            c.backoff = min(c.backoff * 2, MAX_BACKOFF_SECONDS)
            return
        executable = shutil.which(argv[0], path=env.get("PATH"))
        if executable is None:
            c.waiting = ("RunContainerError", f'exec: "{argv[0]}": executable file not found in $PATH')
            c.next_start = time.monotonic() + c.backoff
            c.backoff = min(c.backoff * 2, MAX_BACKOFF_SECONDS)
            return
        cwd = c.spec.get("workingDir") or str(self.dir)
        try:
            with open(self.dir / f"{c.name}.log", "ab") as logfile:
                c.proc = subprocess.Popen([*self.agent.network.command_prefix(), executable, *argv[1:]],
                                          env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                                          stdout=logfile, stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as exc:
            # A missing or unusable workingDir (chdir fails in the child), an exec that fails:
            # the kubelet's RunContainerError, retried with back-off; raising would end this
            # pod's runner and leave the Pod without a status for good.
            c.waiting = ("RunContainerError", f"cannot start {executable} in {cwd}: {exc}")
            c.next_start = time.monotonic() + c.backoff
            c.backoff = min(c.backoff * 2, MAX_BACKOFF_SECONDS)
            return
        from graphserving.dev.cluster import process_start_time  # local: cluster imports binaries
        (self.dir / f"{c.name}.pid").write_text(json.dumps(
            {"pid": c.proc.pid, "start_time": process_start_time(c.proc.pid)}))
        c.started_at, c.started_mono = now_rfc3339(), time.monotonic()
        c.waiting, c.terminated = None, None
        c.started = False
        c.ready = False
        c.env = env  # type: ignore[attr-defined]
        now = time.monotonic()
        c.startup = ProbeTracker(c.spec["startupProbe"], now) if c.spec.get("startupProbe") else None
        c.readiness = ProbeTracker(c.spec["readinessProbe"], now) if c.spec.get("readinessProbe") else None
        c.liveness = ProbeTracker(c.spec["livenessProbe"], now) if c.spec.get("livenessProbe") else None
        log.info("pod %s/%s: started container %s (pid %d) on %s: %s", self.namespace, self.pod_name,
                 c.name, c.proc.pid, self.pod_ip, " ".join(argv))

    def _reap(self, pod: dict, c: Container, restart_policy: str) -> None:
        """Handle a container process that exited."""
        assert c.proc is not None
        code = c.proc.returncode
        (self.dir / f"{c.name}.pid").unlink(missing_ok=True)
        terminated = {"exitCode": code if code >= 0 else 128 - code, "reason": "Completed" if code == 0 else "Error",
                      "startedAt": c.started_at, "finishedAt": now_rfc3339(),
                      "containerID": f"graphserving://{c.proc.pid}"}
        if code < 0:
            terminated["signal"] = -code
        c.proc = None
        c.started = c.ready = False
        restart = restart_policy == "Always" or (restart_policy == "OnFailure" and code != 0)
        if c.init and code == 0:
            restart = False
        if restart:
            c.last_terminated = terminated
            c.restart_count += 1
            c.waiting = ("CrashLoopBackOff", f"back-off {c.backoff:.0f}s restarting failed container={c.name}")
            c.next_start = time.monotonic() + c.backoff
            # Back-off resets after a container ran for a while, as the kubelet does (10 min there).
            ran = time.monotonic() - c.started_mono
            c.backoff = 1.0 if ran > 60 else min(c.backoff * 2, MAX_BACKOFF_SECONDS)
        else:
            c.terminated = terminated

    def _run_probe(self, probe: dict, c: Container, env: dict[str, str]) -> tuple[bool, str]:
        # HTTP and TCP probes reach the pod IP through the veth; exec probes run in the namespace.
        return run_probe(probe, c.spec, self.pod_ip, env, str(self.dir), self.agent.network.command_prefix())

    def _probe(self, c: Container) -> None:
        now = time.monotonic()
        env = getattr(c, "env", {})
        if c.startup is not None and c.startup.verdict is not True:
            if c.startup.due(now):
                ok, msg = self._run_probe(c.startup.probe, c, env)
                if c.startup.record(ok, msg) is False:
                    log.info("pod %s/%s: startup probe of %s failed: %s; restarting", self.namespace,
                             self.pod_name, c.name, msg)
                    self._kill(c, self._grace(c.startup.probe))
                    return
            if c.startup.verdict is not True:
                return
        c.started = True
        if c.liveness is not None and c.liveness.due(now):
            ok, msg = self._run_probe(c.liveness.probe, c, env)
            if c.liveness.record(ok, msg) is False:
                log.info("pod %s/%s: liveness probe of %s failed: %s; restarting", self.namespace,
                         self.pod_name, c.name, msg)
                self._kill(c, self._grace(c.liveness.probe))
                return
        if c.readiness is None:
            c.ready = True
        elif c.readiness.due(now):
            ok, msg = self._run_probe(c.readiness.probe, c, env)
            c.ready = bool(c.readiness.record(ok, msg))
            if not ok and c.readiness.verdict is False:
                c.ready = False

    def _grace(self, probe: dict | None = None) -> float:
        if probe and probe.get("terminationGracePeriodSeconds") is not None:
            return float(probe["terminationGracePeriodSeconds"])
        value = self.current()["spec"].get("terminationGracePeriodSeconds")
        return float(30 if value is None else value)

    def _kill(self, c: Container, grace: float) -> None:
        """SIGTERM the container's process group, wait ``grace`` s, then SIGKILL; reap it."""
        if c.proc is None:
            return
        if c.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(c.proc.pid, signal.SIGTERM)
            try:
                c.proc.wait(timeout=max(grace, 0.0))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(c.proc.pid, signal.SIGKILL)
                c.proc.wait()
        # Leftover children in the group (a shell's background jobs) go too.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(c.proc.pid, signal.SIGKILL)

    def _kill_all(self, grace: float) -> None:
        containers = [c for c in self.init_containers + self.containers if c.proc is not None]
        for c in containers:
            if c.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(c.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for c in containers:
            try:
                c.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(c.proc.pid, signal.SIGKILL)
            c.proc.wait()
            (self.dir / f"{c.name}.pid").unlink(missing_ok=True)

    def _initialized(self) -> bool:
        return all(c.terminated is not None and c.terminated["exitCode"] == 0 for c in self.init_containers)

    def _step(self, pod: dict) -> None:
        policy = pod["spec"].get("restartPolicy") or "Always"
        now = time.monotonic()
        if not self._initialized():
            for c in self.init_containers:
                if c.terminated is not None and c.terminated["exitCode"] == 0:
                    continue
                if c.proc is not None and c.proc.poll() is not None:
                    self._reap(pod, c, "OnFailure" if policy == "Always" else policy)
                elif c.proc is None and c.terminated is None and now >= c.next_start:
                    self._start(pod, c)
                break
            if any(c.terminated is not None and c.terminated["exitCode"] != 0 for c in self.init_containers):
                self.terminal = True
            return
        for c in self.containers:
            if c.proc is not None and c.proc.poll() is not None:
                self._reap(pod, c, policy)
            if c.proc is None and c.terminated is None and now >= c.next_start:
                self._start(pod, c)
            if c.running:
                self._probe(c)
        if pod["spec"].get("restartPolicy") != "Always" and all(c.terminated for c in self.containers):
            self.terminal = True

    # -- status ------------------------------------------------------------------------------
    def _status(self, pod: dict) -> dict:
        initialized = self._initialized()
        states = [c.state() for c in self.containers]
        phase = pod_status.pod_phase(pod["spec"].get("restartPolicy") or "Always", states, initialized)
        if any(c.terminated is not None and c.terminated["exitCode"] != 0 for c in self.init_containers):
            phase = "Failed"
        started = any(c.proc is not None or c.terminated is not None for c in self.init_containers + self.containers)
        conditions = pod_status.agent_conditions(pod, initialized, started,
                                                 {c.name: c.ready for c in self.containers})
        previous = pod.get("status", {}).get("conditions") or []
        status = {
            "phase": phase,
            "hostIP": self.agent.host_ip, "hostIPs": [{"ip": self.agent.host_ip}],
            "podIP": self.pod_ip, "podIPs": [{"ip": self.pod_ip}],
            "startTime": self.start_time,
            "conditions": pod_status.with_transition_times(conditions, previous, now_rfc3339()),
            "containerStatuses": [c.status() for c in self.containers],
        }
        if self.init_containers:
            status["initContainerStatuses"] = [c.status() for c in self.init_containers]
        return status

    def _report(self, pod: dict, force: bool = False) -> None:
        status = self._status(pod)
        # Compare without transition times: they only change when a status does.
        key = json.dumps({**status, "conditions": [{k: v for k, v in c.items() if k != "lastTransitionTime"}
                                                   for c in status["conditions"]]}, sort_keys=True)
        current = pod.get("status", {}).get("conditions") or []
        drift = any(
            next((p for p in current if p.get("type") == c["type"]), {}).get("status") != c["status"]
            for c in status["conditions"])
        # A pod object older than our last patch (the watch lags) is not drift.
        drift = drift and pod["metadata"].get("resourceVersion") != self.patched_rv
        if not force and key == self.last_reported and not drift:
            return
        try:
            resp = self.agent.core.patch_namespaced_pod_status(
                self.pod_name, self.namespace, {"status": status},
                _content_type="application/strategic-merge-patch+json", _preload_content=False)
            self.patched_rv = json.loads(resp.data)["metadata"]["resourceVersion"]
            self.last_reported = key
        except ApiException as exc:
            if exc.status == 404:
                self.gone.set()
            else:
                log.warning("pod %s/%s: status update failed: %s %s", self.namespace, self.pod_name,
                            exc.status, exc.reason)

    def _terminate_gracefully(self, pod: dict) -> None:
        grace = pod["metadata"].get("deletionGracePeriodSeconds")
        grace = self._grace() if grace is None else float(grace)
        log.info("pod %s/%s: deleting, grace %.0fs", self.namespace, self.pod_name, grace)
        self._kill_all(grace)
        try:
            self.agent.core.delete_namespaced_pod(
                self.pod_name, self.namespace,
                body={"gracePeriodSeconds": 0, "preconditions": {"uid": self.uid}})
        except ApiException as exc:
            if exc.status not in (404, 409):
                log.warning("pod %s/%s: final delete failed: %s", self.namespace, self.pod_name, exc.reason)
        self.gone.set()


class NodeAgent:
    """Registers the Node, heartbeats, and runs a :class:`PodRunner` per pod bound to it."""

    def __init__(self, kubeconfig: str, node_name: str, state_dir: Path, pod_range: str | None = None,
                 service_ip: str = DEFAULT_SERVICE_IP) -> None:
        self.node_name = node_name
        self.state_dir = Path(state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.pod_range = pod_range or pod_network.pod_range()
        with open(kubeconfig) as fh:
            kc = yaml.safe_load(fh)
        cluster = kc["clusters"][0]["cluster"]
        self.server: str = cluster["server"]
        self.ca_pem = base64.b64decode(cluster["certificate-authority-data"])
        hostport = self.server.split("://", 1)[1].rstrip("/")
        host, _, port = hostport.rpartition(":")
        self.server_host_port = (host, int(port))
        self.network, warning = self._pod_network()
        self.forwarder: TcpForwarder | None = None
        try:
            if self.network.namespaced:
                # Pods reach the API server at the `kubernetes` Service's ClusterIP inside their
                # namespace (named in the serving certificate), relayed to loopback from here.
                self.network.add_address(service_ip, device="lo")
                listener = self.network.listen(service_ip, SERVICE_PORT)
                self.forwarder = TcpForwarder(listener, self.server_host_port, name="apiserver-forwarder").start()
                self.service_host_port = (service_ip, SERVICE_PORT)
            else:
                self.service_host_port = self.server_host_port
        except BaseException:
            self.network.close()
            raise
        #: The node's address as its pods see it: the host end of the veth (loopback without one).
        self.host_ip = self.network.gateway or "127.0.0.1"
        self.pod_server = f"https://{self.service_host_port[0]}:{self.service_host_port[1]}"
        self.pool = IPPool(self.network.subnet)
        (self.state_dir / "pod-network.json").write_text(json.dumps(
            {"range": self.pod_range, **self.network.record(),
             "routed": self.network.namespaced, "apiserver": self.pod_server, "warning": warning}))
        log.info("pod IPs from %s%s; pods reach the API server at %s", self.network.subnet,
                 f" in network namespace {self.network.netns}" if self.network.namespaced else "", self.pod_server)
        self.api = config.new_client_from_config(config_file=kubeconfig)
        self.core = client.CoreV1Api(self.api)
        self.coordination = client.CoordinationV1Api(self.api)
        self.runners: dict[str, PodRunner] = {}
        self.stopping = threading.Event()
        self.allocatable: dict[str, str] = {}
        self.node_uid = ""

    def _pod_network(self) -> tuple[pod_network.PodNetwork, str]:
        """The agent's namespace and subnet; loopback addresses (with a warning) only without root."""
        if os.geteuid() != 0:
            warning = (f"not root: pods get loopback IPs from {pod_network.LOOPBACK_POD_RANGE} in this "
                       "machine's network namespace; they run and are reachable, but Services get no "
                       "endpoints (the API server refuses loopback addresses in EndpointSlices). Run as "
                       "root for a pod network namespace")
            log.warning(warning)
            return pod_network.loopback_network(), warning
        return pod_network.namespaced_network(self.pod_range, self.state_dir, self.node_name), ""

    def close_network(self) -> None:
        """Stop the API-server forwarder and delete the pods' namespace and veth."""
        if self.forwarder is not None:
            self.forwarder.stop()
            self.forwarder = None
        self.network.close()

    # -- API helpers -------------------------------------------------------------------------
    def request_token(self, pod: dict) -> str:
        sa = pod["spec"].get("serviceAccountName") or "default"
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                "spec": {"expirationSeconds": TOKEN_EXPIRATION_SECONDS,
                         "boundObjectRef": {"apiVersion": "v1", "kind": "Pod",
                                            "name": pod["metadata"]["name"], "uid": pod["metadata"]["uid"]}}}
        resp = self.core.create_namespaced_service_account_token(
            sa, pod["metadata"]["namespace"], body, _preload_content=False)
        return json.loads(resp.data)["status"]["token"]

    def _getter(self, kind: str, namespace: str):
        def get(name: str) -> dict | None:
            read = self.core.read_namespaced_config_map if kind == "configmap" else self.core.read_namespaced_secret
            for attempt in range(10):
                try:
                    return json.loads(read(name, namespace, _preload_content=False).data).get("data") or {}
                except ApiException as exc:
                    if exc.status == 404:
                        return None
                    # The Node authorizer's graph learns the pod's references a moment after binding.
                    if exc.status == 403 and attempt < 9:
                        time.sleep(0.3)
                        continue
                    raise
            return None
        return get

    def config_map_getter(self, namespace: str):
        return self._getter("configmap", namespace)

    def secret_getter(self, namespace: str):
        return self._getter("secret", namespace)

    # -- node --------------------------------------------------------------------------------
    def register(self) -> None:
        kubelet_version = os.environ.get("GRAPHSERVING_KUBELET_VERSION", "")
        if not kubelet_version:
            with contextlib.suppress(Exception):
                resp = client.VersionApi(self.api).get_code(_preload_content=False)
                kubelet_version = json.loads(resp.data)["gitVersion"]
        node = node_object(self.node_name, kubelet_version or "v0.0.0", self.host_ip)
        self.allocatable = dict(node["status"]["allocatable"])
        try:
            created = self.core.create_node(node, _preload_content=False)
            self.node_uid = json.loads(created.data)["metadata"]["uid"]
        except ApiException as exc:
            if exc.status != 409:
                raise
            self.node_uid = json.loads(self.core.read_node(self.node_name, _preload_content=False).data)["metadata"]["uid"]
        now = now_rfc3339()
        self.core.patch_node_status(self.node_name, {"status": {**node["status"],
                                                                "conditions": node_conditions(now, now)}},
                                    _content_type="application/strategic-merge-patch+json")
        self.transition = now
        log.info("node %s registered (uid %s)", self.node_name, self.node_uid)

    def _renew_lease(self) -> None:
        body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": {"name": self.node_name, "namespace": "kube-node-lease",
                             "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": self.node_name,
                                                  "uid": self.node_uid}]},
                "spec": {"holderIdentity": self.node_name, "leaseDurationSeconds": LEASE_DURATION_SECONDS,
                         "renewTime": now_micro()}}
        try:
            self.coordination.patch_namespaced_lease(
                self.node_name, "kube-node-lease", {"spec": body["spec"]},
                _content_type="application/merge-patch+json")
        except ApiException as exc:
            if exc.status != 404:
                raise
            self.coordination.create_namespaced_lease("kube-node-lease", body)

    def heartbeat_loop(self) -> None:
        last_status = 0.0
        while not self.stopping.is_set():
            try:
                self._renew_lease()
                if time.monotonic() - last_status > NODE_STATUS_SECONDS:
                    now = now_rfc3339()
                    self.core.patch_node_status(self.node_name, {"status": {
                        "conditions": node_conditions(now, self.transition)}},
                        _content_type="application/strategic-merge-patch+json")
                    last_status = time.monotonic()
            except Exception as exc:  # noqa: BLE001 - keep heartbeating through API hiccups
                log.warning("heartbeat failed: %s", exc)
            self.stopping.wait(LEASE_RENEW_SECONDS)

    # -- pods --------------------------------------------------------------------------------
    def _handle(self, pod: dict, deleted: bool = False) -> None:
        uid = pod["metadata"]["uid"]
        runner = self.runners.get(uid)
        if deleted:
            if runner is not None:
                runner.update(pod)
                runner.gone.set()
                self.runners.pop(uid, None)
            return
        phase = pod.get("status", {}).get("phase")
        if runner is None:
            if phase in ("Succeeded", "Failed"):
                return
            if pod["metadata"].get("deletionTimestamp"):
                # Deleted while we were away: nothing runs; finish the deletion.
                with contextlib.suppress(ApiException):
                    self.core.delete_namespaced_pod(pod["metadata"]["name"], pod["metadata"]["namespace"],
                                                    body={"gracePeriodSeconds": 0,
                                                          "preconditions": {"uid": uid}})
                return
            runner = PodRunner(self, pod)
            self.runners[uid] = runner
            runner.start()
        else:
            runner.update(pod)
        for gone_uid in [u for u, r in self.runners.items() if not r.is_alive() and r.gone.is_set()]:
            self.runners.pop(gone_uid, None)

    def watch_loop(self) -> None:
        selector = f"spec.nodeName={self.node_name}"
        while not self.stopping.is_set():
            try:
                resp = self.core.list_pod_for_all_namespaces(field_selector=selector, _preload_content=False)
                listing = json.loads(resp.data)
                seen = set()
                for pod in listing.get("items", []):
                    seen.add(pod["metadata"]["uid"])
                    self._handle(pod)
                for uid in [u for u in self.runners if u not in seen]:
                    self.runners[uid].gone.set()
                    self.runners.pop(uid, None)
                rv = listing["metadata"]["resourceVersion"]
                w = watch.Watch()
                for event in w.stream(self.core.list_pod_for_all_namespaces, field_selector=selector,
                                      resource_version=rv, timeout_seconds=120, deserialize=False,
                                      allow_watch_bookmarks=True):
                    if self.stopping.is_set():
                        w.stop()
                        break
                    kind, obj = event["type"], event.get("raw_object", event["object"])
                    if kind == "ERROR":
                        break  # e.g. 410 Gone: relist
                    if kind == "BOOKMARK":
                        continue
                    self._handle(obj, deleted=(kind == "DELETED"))
            except Exception as exc:  # noqa: BLE001 - relist after any watch failure
                if not self.stopping.is_set():
                    log.warning("pod watch failed (%s); relisting", exc)
                    self.stopping.wait(1.0)

    def run(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.register()
        self._renew_lease()
        threading.Thread(target=self.heartbeat_loop, name="heartbeat", daemon=True).start()
        watcher = threading.Thread(target=self.watch_loop, name="pod-watch", daemon=True)
        watcher.start()
        self.stopping.wait()
        log.info("stopping: ending %d pods' processes", len(self.runners))
        for runner in list(self.runners.values()):
            runner.stop_now.set()
        for runner in list(self.runners.values()):
            runner.join(timeout=15)
        self.close_network()

    def stop(self, *_: Any) -> None:
        self.stopping.set()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m graphserving.dev.node_agent", description=__doc__.splitlines()[0])
    parser.add_argument("--kubeconfig", required=True, help="kubeconfig with the node's identity (system:node:NAME)")
    parser.add_argument("--node-name", required=True)
    parser.add_argument("--state-dir", required=True, type=Path, help="pod directories, logs and tokens go here")
    parser.add_argument("--pod-range", default=None,
                        help=f"range of pod IPs, one /24 per agent (default $GRAPHSERVING_POD_RANGE or "
                             f"{pod_network.DEFAULT_POD_RANGE})")
    parser.add_argument("--service-ip", default=DEFAULT_SERVICE_IP,
                        help="ClusterIP of the `kubernetes` Service (in the API server's certificate): "
                             "pods reach the API server there")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(threadName)s %(message)s")
    try:
        agent = NodeAgent(args.kubeconfig, args.node_name, args.state_dir, args.pod_range, args.service_ip)
    except pod_network.PodNetworkError as exc:
        log.error("cannot set up the pod network: %s", exc)
        return 2
    signal.signal(signal.SIGTERM, agent.stop)
    signal.signal(signal.SIGINT, agent.stop)
    try:
        agent.run()
    finally:
        agent.close_network()
    return 0


if __name__ == "__main__":
    sys.exit(main())
