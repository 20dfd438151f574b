"""A local Kubernetes control plane on loopback: etcd, kube-apiserver, controller-manager, scheduler.

Everything runs as real processes from the binaries of :mod:`graphserving.dev.binaries`, on
127.0.0.1 with free ports, with its state (certificates, kubeconfigs, etcd data, logs, pids) in
one state directory:

* etcd with ``--unsafe-no-fsync`` (test data only);
* kube-apiserver on a secure port with a generated CA, a service-account issuer and signing keys
  (so the TokenRequest API works), ``--authorization-mode=Node,RBAC`` and the
  ``NodeRestriction`` and ``ValidatingAdmissionPolicy`` admission plugins on top of the defaults;
* kube-controller-manager with its own client certificate, per-controller service-account
  credentials and the service-account token signing key (all default controllers: deployment,
  replicaset, endpointslice, garbage collector, namespace, node lifecycle, service account...);
* kube-scheduler;
* optionally the development node agent (:mod:`graphserving.dev.node_agent`) as a ``Node``;
* the Gateway API's standard-channel CRDs (:mod:`graphserving.dev.gateway_api`), unless
  ``gateway_api=False``.

Client identities for the gateway (:mod:`graphserving.dev.gateway`) and Prometheus
(:mod:`graphserving.dev.prometheus`) are issued with the others; those components start on
demand against the running cluster.

``start()`` returns once ``/readyz`` is ok, the controllers run and (with a node) the Node is
Ready. ``stop()`` ends every process group it started, also after a failed start. The pids (with
their kernel start times, so a recycled pid is never signalled) are written to ``state.json``,
so another process can stop the cluster with :func:`stop_state_dir` (``graphserving dev cluster down``).
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import yaml

from graphserving.dev import binaries, gateway_api, pki, pod_network, resources
from graphserving.dev.ports import free_port

#: Service CIDR of the local cluster; the first address is the ``kubernetes`` Service.
SERVICE_CIDR = "10.0.0.0/24"
#: ClusterIP of the ``kubernetes`` Service (in the serving certificate): pods reach the API server there.
KUBERNETES_SERVICE_IP = "10.0.0.1"
#: Issuer of service-account tokens (the in-cluster DNS name of the API server).
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"
DEFAULT_NODE_NAME = "graphserving-local"
#: Seconds to wait for the whole control plane (a cold start on 2 cores takes 10-30 s).
DEFAULT_START_TIMEOUT = 180.0
#: Client identities (kubeconfig name -> user) of the components that start on demand; their
#: permissions come from the ClusterRoles those components apply.
ADDON_USERS = {"gateway": "graphserving-dev:gateway", "prometheus": "graphserving-dev:prometheus"}
STATE_FILE = "state.json"


class ClusterError(RuntimeError):
    """The control plane could not start or stop; the message names the component and its log."""


def default_state_dir(name: str = "default") -> Path:
    """State directory of the cluster that ``graphserving dev cluster up`` manages."""
    return binaries.cache_dir() / "clusters" / name


def kubeconfig_dict(server: str, ca_pem: bytes, user: str, cert_pem: bytes | None = None,
                    key_pem: bytes | None = None, token: str | None = None,
                    namespace: str | None = None) -> dict:
    """A one-cluster, one-user kubeconfig with embedded credentials (client cert or token)."""
    user_entry: dict[str, str] = {}
    if cert_pem is not None and key_pem is not None:
        user_entry["client-certificate-data"] = base64.b64encode(cert_pem).decode()
        user_entry["client-key-data"] = base64.b64encode(key_pem).decode()
    if token is not None:
        user_entry["token"] = token
    context: dict[str, str] = {"cluster": "graphserving-dev", "user": user}
    if namespace:
        context["namespace"] = namespace
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "graphserving-dev", "cluster": {
            "server": server, "certificate-authority-data": base64.b64encode(ca_pem).decode()}}],
        "users": [{"name": user, "user": user_entry}],
        "contexts": [{"name": "graphserving-dev", "context": context}],
        "current-context": "graphserving-dev",
    }


def write_kubeconfig(path: Path, config: dict) -> Path:
    """Write a kubeconfig with mode 0600 (it holds credentials), atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        yaml.safe_dump(config, fh, sort_keys=False)
    os.replace(tmp, path)
    return path


# ---------------------------------------------------------------------------------------------
# Processes
# ---------------------------------------------------------------------------------------------

def process_start_time(pid: int) -> int | None:
    """The kernel start time (clock ticks since boot) of ``pid``, or None if it does not exist."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may contain spaces; fields after it are plain.
    fields = stat[stat.rfind(")") + 2:].split()
    return int(fields[19])


def process_alive(pid: int, start_time: int | None) -> bool:
    """True if ``pid`` still runs the process started at ``start_time`` (and is not a zombie)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    fields = stat[stat.rfind(")") + 2:].split()
    if fields[0] == "Z":
        return False
    return start_time is None or int(fields[19]) == start_time


@dataclasses.dataclass
class ProcessRecord:
    """A started process: it leads its own session/process group (pgid == pid)."""

    name: str
    pid: int
    start_time: int | None
    log: str
    command: list[str]


def _set_parent_death_signal() -> None:
    """In the child: get SIGTERM when the parent dies (Linux prctl PR_SET_PDEATHSIG)."""
    import ctypes

    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)


def spawn(name: str, command: list[str], log_path: Path, env: dict[str, str] | None = None,
          die_with_parent: bool = False, cwd: Path | None = None) -> tuple[subprocess.Popen, ProcessRecord]:
    """Start ``command`` in a new session with stdout+stderr appended to ``log_path``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True, env=env, cwd=cwd,
            preexec_fn=_set_parent_death_signal if die_with_parent else None,
        )
    return proc, ProcessRecord(name, proc.pid, process_start_time(proc.pid), str(log_path), command)


def terminate(records: list[ProcessRecord], grace: float = 10.0) -> list[str]:
    """SIGTERM each record's process group, wait up to ``grace`` s, then SIGKILL the rest.

    Records whose pid now belongs to another process (start time differs) are skipped. Returns
    the names of the processes that had to be killed.
    """
    alive = [r for r in records if process_alive(r.pid, r.start_time)]
    for r in alive:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(r.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(process_alive(r.pid, r.start_time) for r in alive):
        for r in alive:  # reap our own children so they do not linger as zombies
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(r.pid, os.WNOHANG)
        time.sleep(0.1)
    killed = []
    for r in alive:
        if process_alive(r.pid, r.start_time):
            killed.append(r.name)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(r.pid, signal.SIGKILL)
    for r in alive:
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(r.pid, 0)
    return killed


def log_tail(path: str | Path, lines: int = 25) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


# ---------------------------------------------------------------------------------------------
# The cluster
# ---------------------------------------------------------------------------------------------

class LocalCluster:
    """A control plane (and optionally the development node agent) in ``state_dir``.

    Use as a context manager or call :meth:`start` / :meth:`stop`. ``die_with_parent`` makes the
    processes exit when this Python process dies (for test sessions); ``graphserving dev cluster
    up`` leaves it off so the cluster outlives the command.
    """

    def __init__(self, state_dir: Path, node_name: str | None = DEFAULT_NODE_NAME,
                 die_with_parent: bool = False, log: Callable[[str], None] | None = None,
                 pod_range: str | None = None, gateway_api: bool = True) -> None:
        self.state_dir = Path(state_dir)
        self.gateway_api = gateway_api
        self.pod_range = pod_range or pod_network.pod_range()
        self.pod_network: dict = {}
        self.node_name = node_name
        self.die_with_parent = die_with_parent
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.records: list[ProcessRecord] = []
        self._procs: dict[str, subprocess.Popen] = {}
        self.paths: dict[str, Path] = {}
        self.ports: dict[str, int] = {}
        #: URLs of the components started on demand (``gateway``, ``prometheus``), kept in the state.
        self.endpoints: dict[str, str] = {}

    # -- paths -------------------------------------------------------------------------------
    @property
    def kubeconfig(self) -> Path:
        """The admin kubeconfig (``system:masters``)."""
        return self.state_dir / "admin.kubeconfig"

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.ports['apiserver']}"

    @property
    def pki_dir(self) -> Path:
        return self.state_dir / "pki"

    # -- lifecycle ---------------------------------------------------------------------------
    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self, timeout: float = DEFAULT_START_TIMEOUT) -> None:
        """Start every component and wait until the cluster is usable.

        Raises :class:`ClusterError` (after stopping what was started) when a binary is missing,
        a component exits, or readiness is not reached within ``timeout`` seconds.
        """
        if running_processes(self.state_dir):
            raise ClusterError(f"a cluster is already running from {self.state_dir}; stop it first "
                               "(`graphserving dev cluster down`)")
        missing = binaries.missing_components(("etcd", *binaries.KUBERNETES_COMPONENTS))
        if missing:
            raise ClusterError(f"missing binaries: {', '.join(missing)}; run `graphserving dev build` "
                               "(or set KUBEBUILDER_ASSETS)")
        deadline = time.monotonic() + timeout
        try:
            self._prepare()
            self._start_etcd(deadline)
            self._start_apiserver(deadline)
            self._start_controllers(deadline)
            if self.node_name:
                self._start_node_agent(deadline)
            self._wait_controllers_working(deadline)
            if self.gateway_api:
                self._install_gateway_api(deadline)
            self._save_state(running=True)
        except BaseException:
            self.stop(remove=False)
            raise

    def stop(self, remove: bool = False) -> None:
        """Stop every process (node agent first, so pod processes end gracefully); keep logs unless ``remove``."""
        order = {"node-agent": 0, "kube-scheduler": 1, "kube-controller-manager": 1,
                 "kube-apiserver": 2, "etcd": 3}
        for rank in sorted(set(order.values())):
            terminate([r for r in self.records if order.get(r.name, 0) == rank],
                      grace=20.0 if rank == 0 else 10.0)
        terminate(_pod_process_records(self.state_dir), grace=2.0)
        if self.node_name:
            # The agent deletes its namespace and veth when it stops; this catches a killed one.
            with contextlib.suppress(OSError, pod_network.PodNetworkError):
                pod_network.cleanup_stale()
        self._save_state(running=False)
        if remove:
            shutil.rmtree(self.state_dir, ignore_errors=True)

    # -- steps -------------------------------------------------------------------------------
    def _prepare(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        for sub in ("etcd", "logs", "pki", "kcm-certs", "scheduler-certs", "apiserver-certs"):
            shutil.rmtree(self.state_dir / sub, ignore_errors=True)
        (self.state_dir / "etcd").mkdir(mode=0o700)
        self.ports = {k: free_port() for k in ("etcd", "etcd-peer", "apiserver", "kcm", "scheduler")}
        ca = pki.CertificateAuthority(self.pki_dir)
        serving = ca.issue(
            "apiserver", "kube-apiserver", server=True,
            dns_names=("localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc",
                       "kubernetes.default.svc.cluster.local"),
            ip_addresses=("127.0.0.1", KUBERNETES_SERVICE_IP))
        sa = pki.service_account_keys(self.pki_dir)
        identities = {
            "admin": ("kubernetes-admin", ("system:masters",)),
            "controller-manager": ("system:kube-controller-manager", ()),
            "scheduler": ("system:kube-scheduler", ()),
            **{name: (user, ()) for name, user in ADDON_USERS.items()},
        }
        if self.node_name:
            identities["node"] = (f"system:node:{self.node_name}", ("system:nodes",))
        ca_pem = ca.pair.cert.read_bytes()
        for name, (cn, orgs) in identities.items():
            pair = ca.issue(name, cn, orgs)
            write_kubeconfig(self.state_dir / f"{name}.kubeconfig", kubeconfig_dict(
                self.server, ca_pem, cn, pair.cert.read_bytes(), pair.key.read_bytes()))
        self.paths = {"ca": ca.pair.cert, "ca-key": ca.pair.key, "serving": serving.cert,
                      "serving-key": serving.key, "sa-pub": sa.cert, "sa-key": sa.key}

    def _spawn(self, name: str, command: list[str], env: dict[str, str] | None = None) -> None:
        proc, record = spawn(name, command, self.state_dir / "logs" / f"{name}.log", env=env,
                             die_with_parent=self.die_with_parent, cwd=self.state_dir)
        self._procs[name] = proc
        self.records.append(record)
        self._save_state(running=False)

    def spawn_client(self, name: str, command: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start a client of the running cluster (the demo's operator, say) in a session of its own,
        logged to ``<state_dir>/<name>.log`` and recorded in the state, so that :meth:`stop` and
        ``graphserving dev cluster down`` stop it before the control plane."""
        proc, record = spawn(name, command, self.state_dir / f"{name}.log", env=env,
                             die_with_parent=self.die_with_parent)
        self._procs[name] = proc
        self.records.append(record)
        self._save_state(running=True)
        return proc

    def stop_client(self, record: ProcessRecord, grace: float) -> None:
        """Stop a client started with :meth:`spawn_client` (its ``record``): SIGTERM, ``grace``
        seconds, then SIGKILL; it leaves the records and its URL (``endpoints[record.name]``) goes."""
        terminate([record], grace=grace)
        self.records.remove(record)
        self.endpoints.pop(record.name, None)

    def _check_alive(self, name: str) -> None:
        proc = self._procs[name]
        if proc.poll() is not None:
            record = next(r for r in self.records if r.name == name)
            raise ClusterError(f"{name} exited with code {proc.returncode}; log {record.log}:\n"
                               f"{log_tail(record.log)}")

    def _wait(self, what: str, name: str, deadline: float, probe: Callable[[], bool]) -> None:
        last_error = ""
        while time.monotonic() < deadline:
            self._check_alive(name)
            try:
                if probe():
                    return
            except Exception as exc:  # noqa: BLE001 - every failure means "not yet"
                last_error = f"{type(exc).__name__}: {exc}"
            time.sleep(0.25)
        record = next(r for r in self.records if r.name == name)
        raise ClusterError(f"timed out waiting for {what} ({last_error}); log {record.log}:\n"
                           f"{log_tail(record.log)}")

    def _start_etcd(self, deadline: float) -> None:
        client = f"http://127.0.0.1:{self.ports['etcd']}"
        peer = f"http://127.0.0.1:{self.ports['etcd-peer']}"
        self._spawn("etcd", [
            str(binaries.binary_path("etcd")), "--name=default",
            f"--data-dir={self.state_dir / 'etcd'}",
            f"--listen-client-urls={client}", f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}", f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=default={peer}", "--unsafe-no-fsync", "--log-level=warn",
        ])

        def healthy() -> bool:
            with urllib.request.urlopen(f"{client}/health", timeout=2) as resp:
                return json.loads(resp.read()).get("health") == "true"
        self._wait("etcd /health", "etcd", deadline, healthy)

    def _tls_context(self, client_identity: str | None = "admin") -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.paths["ca"]))
        if client_identity:
            ctx.load_cert_chain(self.pki_dir / f"{client_identity}.crt", self.pki_dir / f"{client_identity}.key")
        return ctx

    def get(self, path: str, timeout: float = 5.0) -> tuple[int, str]:
        """GET ``path`` on the API server as admin; returns (status, body)."""
        return self.request("GET", path, timeout=timeout)

    def request(self, method: str, path: str, body: dict | None = None,
                content_type: str = "application/json", timeout: float = 10.0) -> tuple[int, str]:
        """``method path`` on the API server as admin, with ``body`` as JSON; returns (status, body)."""
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": content_type} if data is not None else {}
        req = urllib.request.Request(self.server + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout, context=self._tls_context()) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode(errors="replace")

    def _start_apiserver(self, deadline: float) -> None:
        p = self.paths
        self._spawn("kube-apiserver", [
            str(binaries.binary_path("kube-apiserver")),
            f"--etcd-servers=http://127.0.0.1:{self.ports['etcd']}",
            f"--secure-port={self.ports['apiserver']}", "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            f"--cert-dir={self.state_dir / 'apiserver-certs'}",
            f"--tls-cert-file={p['serving']}", f"--tls-private-key-file={p['serving-key']}",
            f"--client-ca-file={p['ca']}",
            f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
            f"--service-account-key-file={p['sa-pub']}",
            f"--service-account-signing-key-file={p['sa-key']}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--authorization-mode=Node,RBAC",
            "--enable-admission-plugins=NodeRestriction,ValidatingAdmissionPolicy",
            "--allow-privileged=true",
            "--profiling=false",
            "--v=1",
        ])
        self._wait("kube-apiserver /readyz", "kube-apiserver", deadline,
                   lambda: self.get("/readyz", timeout=3)[0] == 200)

    def _start_controllers(self, deadline: float) -> None:
        p = self.paths
        kcm_kc = self.state_dir / "controller-manager.kubeconfig"
        sched_kc = self.state_dir / "scheduler.kubeconfig"
        self._spawn("kube-controller-manager", [
            str(binaries.binary_path("kube-controller-manager")),
            f"--kubeconfig={kcm_kc}", f"--authentication-kubeconfig={kcm_kc}",
            f"--authorization-kubeconfig={kcm_kc}",
            f"--secure-port={self.ports['kcm']}", "--bind-address=127.0.0.1",
            f"--cert-dir={self.state_dir / 'kcm-certs'}",
            "--leader-elect=false", "--use-service-account-credentials=true",
            f"--service-account-private-key-file={p['sa-key']}", f"--root-ca-file={p['ca']}",
            f"--cluster-signing-cert-file={p['ca']}", f"--cluster-signing-key-file={p['ca-key']}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--controllers=*,bootstrapsigner,tokencleaner", "--v=1",
        ])
        self._spawn("kube-scheduler", [
            str(binaries.binary_path("kube-scheduler")),
            f"--kubeconfig={sched_kc}", f"--authentication-kubeconfig={sched_kc}",
            f"--authorization-kubeconfig={sched_kc}",
            f"--secure-port={self.ports['scheduler']}", "--bind-address=127.0.0.1",
            f"--cert-dir={self.state_dir / 'scheduler-certs'}",
            "--leader-elect=false", "--v=1",
        ])
        insecure = ssl.create_default_context()
        insecure.check_hostname = False
        insecure.verify_mode = ssl.CERT_NONE
        for name, port in (("kube-controller-manager", self.ports["kcm"]),
                           ("kube-scheduler", self.ports["scheduler"])):
            def healthy(port: int = port) -> bool:
                with urllib.request.urlopen(f"https://127.0.0.1:{port}/healthz", timeout=2,
                                            context=insecure) as resp:
                    return resp.status == 200
            self._wait(f"{name} /healthz", name, deadline, healthy)

    def _start_node_agent(self, deadline: float) -> None:
        assert self.node_name
        self._spawn("node-agent", [
            sys.executable, "-m", "graphserving.dev.node_agent",
            f"--kubeconfig={self.state_dir / 'node.kubeconfig'}",
            f"--node-name={self.node_name}", f"--state-dir={self.state_dir / 'node'}",
            f"--pod-range={self.pod_range}",
            f"--service-ip={KUBERNETES_SERVICE_IP}",
        ])

        def node_ready() -> bool:
            status, body = self.get(f"/api/v1/nodes/{self.node_name}")
            if status != 200:
                return False
            node = json.loads(body)
            ready = any(c["type"] == "Ready" and c["status"] == "True"
                        for c in node.get("status", {}).get("conditions", []))
            tainted = any(t["key"].startswith("node.kubernetes.io/not-ready")
                          for t in node.get("spec", {}).get("taints", []) or [])
            return ready and not tainted
        self._wait(f"Node {self.node_name} Ready and untainted", "node-agent", deadline, node_ready)
        self.pod_network = json.loads((self.state_dir / "node" / "pod-network.json").read_text())
        if self.pod_network.get("warning"):
            self.log(f"warning: {self.pod_network['warning']}")

    def _install_gateway_api(self, deadline: float) -> None:
        try:
            gateway_api.install(self, deadline, gateway_api.ensure_crds(self.log))
        except (binaries.BinaryError, resources.ApplyError) as exc:
            raise ClusterError(f"the Gateway API {gateway_api.GATEWAY_API_VERSION} CRDs: {exc}") from exc

    def _wait_controllers_working(self, deadline: float) -> None:
        # The service-account controller creates `default` in every namespace and the root-CA
        # publisher the `kube-root-ca.crt` ConfigMap: proof that the controller-manager works.
        self._wait("the default ServiceAccount (controller-manager)", "kube-controller-manager", deadline,
                   lambda: self.get("/api/v1/namespaces/default/serviceaccounts/default")[0] == 200)

    # -- state -------------------------------------------------------------------------------
    def _save_state(self, running: bool) -> None:
        if not self.state_dir.exists():
            return
        state = {
            "running": running,
            "server": self.server if self.ports else None,
            "kubeconfig": str(self.kubeconfig),
            "node": self.node_name,
            "pod_range": self.pod_range,
            "pod_network": self.pod_network,
            "ports": self.ports,
            "endpoints": self.endpoints,
            "versions": {c: binaries.component_version(c) for c in ("etcd", *binaries.KUBERNETES_COMPONENTS)},
            "binaries": {c: str(binaries.binary_path(c) or "") for c in binaries.ALL_COMPONENTS},
            "processes": [dataclasses.asdict(r) for r in self.records],
        }
        tmp = self.state_dir / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(state, indent=2))
        os.replace(tmp, self.state_dir / STATE_FILE)


def read_state(state_dir: Path) -> dict:
    """The saved state of a cluster (empty dict if none)."""
    try:
        return json.loads((Path(state_dir) / STATE_FILE).read_text())
    except (OSError, ValueError):
        return {}


def _pod_process_records(state_dir: Path) -> list[ProcessRecord]:
    """Pod processes the node agent recorded (``node/pods/*/*.pid``), in case the agent died."""
    records = []
    for pid_file in sorted((Path(state_dir) / "node" / "pods").glob("*/*.pid")):
        with contextlib.suppress(OSError, ValueError, KeyError):
            data = json.loads(pid_file.read_text())
            records.append(ProcessRecord(pid_file.stem, int(data["pid"]), data.get("start_time"), "", []))
    return records


def running_processes(state_dir: Path) -> list[ProcessRecord]:
    """The recorded processes (control plane and pods) of ``state_dir`` that are still alive."""
    state = read_state(state_dir)
    records = [ProcessRecord(**r) for r in state.get("processes", [])]
    records += _pod_process_records(state_dir)
    return [r for r in records if process_alive(r.pid, r.start_time)]


def stop_state_dir(state_dir: Path, remove: bool = True) -> list[str]:
    """Stop the cluster recorded in ``state_dir`` from any process; returns names that needed SIGKILL."""
    state = read_state(state_dir)
    records = [ProcessRecord(**r) for r in state.get("processes", [])]
    order = ["node-agent", "kube-scheduler", "kube-controller-manager", "kube-apiserver", "etcd"]
    # clients first (LocalCluster.spawn_client: the demo's operator), while the API server still answers
    killed = terminate([r for r in records if r.name not in order], grace=10.0)
    for name in order:
        killed += terminate([r for r in records if r.name == name], grace=20.0 if name == "node-agent" else 10.0)
    killed += terminate(_pod_process_records(state_dir), grace=2.0)
    with contextlib.suppress(OSError, pod_network.PodNetworkError):
        pod_network.cleanup_stale()
    if remove:
        shutil.rmtree(state_dir, ignore_errors=True)
    elif state:
        state["running"] = False
        (Path(state_dir) / STATE_FILE).write_text(json.dumps(state, indent=2))
    return killed
