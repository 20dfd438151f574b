"""Pod networking for the development node agent: one network namespace per node agent.

Each pod needs its own address that EndpointSlices accept (the API server refuses loopback
addresses: ``may not be in the loopback range``) and that processes on this machine can reach.
Those addresses must not live in the machine's own (root) network namespace, so each node agent
gets a namespace of its own, made with iproute2 (needs root)::

    ip netns add gs-<id>                                         # <id>: hash of state dir + node
    ip link add gs-<id> type veth peer name eth0 netns gs-<id>
    ip addr add 10.244.N.1/24 dev gs-<id>; ip link set gs-<id> up   # host end, root namespace
    ip -n gs-<id> link set lo up; ip -n gs-<id> link set eth0 up
    ip -n gs-<id> route add 10.244.N.1/32 dev eth0 scope link       # pods reach only the host end
    ip -n gs-<id> addr add 10.244.N.x/32 dev eth0                   # one per pod, x >= 2

Pod processes run inside the namespace (``nsenter --net=/run/netns/gs-<id> -- CMD``, which
execs, so the pid is the pod's process). The root namespace reaches the pods through the veth's
connected ``/24`` route; it gets no address and no local route for the rest of the range, only
``unreachable <range>`` while an agent runs, so that a connection to an address of the range
without a live namespace (a deleted pod, a kwok fake pod) fails at once with "No route to host"
instead of leaving the machine by the default route. Pods have no default route: they reach
their own namespace and the host end only (the node agent's API-server forwarder listens inside
the namespace, see :class:`PodNetwork.listen`).

Several node agents may run at once (a ``cluster up`` and test sessions). Each claims one ``/24``
of the range (``10.244.0.0/16`` by default, ``$GRAPHSERVING_POD_RANGE`` to change it) by holding
an ``flock`` on ``<lock dir>/<subnet>.lock`` for its lifetime and records its namespace and veth
in ``<subnet>.json`` beside it. A record whose lock is free belongs to a dead agent: its namespace
and veth are deleted (:func:`cleanup_stale`) by the next agent that starts and by
``cluster down``. A ``/24`` that overlaps a route of the root namespace is never used. The last
``/22`` of the range is left to kwok's fake pods (:func:`fake_pod_subnet`).

Without root there is no namespace: :func:`loopback_network` hands out ``127.1.N.x`` addresses
in the root namespace instead; pods run and are reachable, but Services get no endpoints.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import fcntl
import hashlib
import ipaddress
import json
import os
import re
import shutil
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

from graphserving.dev import binaries

DEFAULT_POD_RANGE = "10.244.0.0/16"
LOOPBACK_POD_RANGE = "127.1.0.0/16"
SUBNET_PREFIX = 24
#: The pods' interface inside the namespace (the veth peer), named as in a real pod.
POD_INTERFACE = "eth0"
#: Where ``ip netns add`` puts the namespace handles.
NETNS_DIR = Path("/run/netns")
#: Linux interface names are at most 15 bytes (IFNAMSIZ 16 with the terminating NUL).
IFNAME_MAX = 15
_CLONE_NEWNET = 0x40000000  # <sched.h>


class PodNetworkError(RuntimeError):
    """Pod networking cannot be set up; the message says why and what to do."""


def pod_range() -> str:
    return os.environ.get("GRAPHSERVING_POD_RANGE") or DEFAULT_POD_RANGE


def lock_dir() -> Path:
    """Claims and ownership records: per machine (``/run`` is gone after a reboot, like namespaces).

    ``$GRAPHSERVING_POD_NETWORK_DIR`` overrides it; without root the cache directory is used
    (only loopback subnets are claimed then).
    """
    override = os.environ.get("GRAPHSERVING_POD_NETWORK_DIR")
    if override:
        return Path(override)
    if os.geteuid() == 0:
        return Path("/run/graphserving/pod-network")
    return binaries.cache_dir() / "pod-network"


def is_loopback(cidr: str) -> bool:
    return ipaddress.ip_network(cidr).subnet_of(ipaddress.ip_network("127.0.0.0/8"))


# ---------------------------------------------------------------------------------------------
# Pure decisions: names and addresses
# ---------------------------------------------------------------------------------------------

def network_id(state_dir: str | Path, node_name: str) -> str:
    """Eight hex digits naming the network of node ``node_name`` of the cluster in ``state_dir``."""
    key = f"{os.path.realpath(state_dir)}\0{node_name}".encode()
    return hashlib.sha256(key).hexdigest()[:8]


def netns_name(net_id: str) -> str:
    """The network namespace of a node agent (``/run/netns/gs-<id>``)."""
    return f"gs-{net_id}"


def host_interface_name(net_id: str) -> str:
    """The root-namespace end of the veth pair (the peer is :data:`POD_INTERFACE` in the namespace)."""
    name = f"gs-{net_id}"
    if len(name) > IFNAME_MAX:
        raise ValueError(f"interface name {name!r} is longer than {IFNAME_MAX} characters")
    return name


def gateway_address(subnet: str) -> str:
    """The host end's address in ``subnet``: its first host address (``10.244.N.1``)."""
    return str(next(ipaddress.ip_network(subnet).hosts()))


_ROUTE_DST = re.compile(
    r"^(?:(?:local|unicast|broadcast|blackhole|unreachable|prohibit|anycast|multicast)\s+)?"
    r"(\d+\.\d+\.\d+\.\d+(?:/\d+)?)\s")


def overlapping_routes(cidr: str, routes_text: str) -> list[str]:
    """Lines of ``ip -4 route show table all`` whose destination overlaps ``cidr`` (pure)."""
    network = ipaddress.ip_network(cidr)
    hits = []
    for line in routes_text.splitlines():
        match = _ROUTE_DST.match(line.strip())
        if match and ipaddress.ip_network(match.group(1), strict=False).overlaps(network):
            hits.append(line.strip())
    return hits


def guard_route(cidr: str) -> str:
    """The root-namespace route that makes addresses of ``cidr`` without a namespace unreachable."""
    return f"unreachable {ipaddress.ip_network(cidr)}"


def fake_pod_subnet(cidr: str) -> str:
    """The part of the pod range kept for kwok's fake pods (no agent claims it): its last ``/22``.

    Ranges of ``/21`` or smaller keep their last quarter.
    """
    network = ipaddress.ip_network(cidr)
    prefix = min(max(22, network.prefixlen + 2), 32)
    return str(list(network.subnets(new_prefix=prefix))[-1])


def candidate_subnets(cidr: str, routes_text: str) -> tuple[list[str], list[str]]:
    """The ``/24`` s of ``cidr`` for node agents that overlap no route, lowest first, and the clashing routes.

    Pure. The range's own guard route (:func:`guard_route`) is no clash; the fake-pod part of the
    range (:func:`fake_pod_subnet`) is never a candidate.
    """
    network = ipaddress.ip_network(cidr)
    prefix = max(SUBNET_PREFIX, network.prefixlen)
    reserved = ipaddress.ip_network(fake_pod_subnet(cidr))
    guard = guard_route(cidr)
    routes_text = "\n".join(line for line in routes_text.splitlines()
                            if line.strip().split()[:2] != guard.split())
    free, clashes = [], []
    for subnet in network.subnets(new_prefix=prefix):
        if subnet.overlaps(reserved):
            continue
        hits = overlapping_routes(str(subnet), routes_text)
        if hits:
            clashes += [h for h in hits if h not in clashes]
        else:
            free.append(str(subnet))
    return free, clashes


def clash_message(cidr: str, clashes: list[str]) -> str:
    """Why no ``/24`` of ``cidr`` is usable (every one overlaps ``clashes``), and what to do."""
    text = f"every /{SUBNET_PREFIX} of the pod range {cidr} overlaps routes of this machine ({'; '.join(clashes[:3])})"
    legacy = f"local {cidr} dev lo"
    if any(line.startswith(legacy) for line in clashes):
        return (f"{text}: the route `{legacy}` was left by an older graphserving node agent; remove it "
                f"with `ip route del local {cidr} dev lo`")
    return f"{text}; set GRAPHSERVING_POD_RANGE to a free private range"


# ---------------------------------------------------------------------------------------------
# Side effects: iproute2, locks, namespaces
# ---------------------------------------------------------------------------------------------

def _tool(name: str) -> str:
    path = shutil.which(name) or next((p for p in (f"/usr/sbin/{name}", f"/sbin/{name}", f"/usr/bin/{name}")
                                       if os.path.exists(p)), None)
    if path is None:
        package = "iproute2" if name == "ip" else "util-linux"
        raise PodNetworkError(f"pod networking needs the `{name}` command ({package}), which is not installed")
    return path


def _ip(*args: str, netns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    command = [_tool("ip"), *(("-n", netns) if netns else ()), *args]
    result = subprocess.run(command, capture_output=True, text=True)
    if check and result.returncode != 0:
        raise PodNetworkError(f"`{' '.join(command[1:])}` failed: {result.stderr.strip() or result.returncode}")
    return result


def root_routes() -> str:
    """``ip -4 route show table all`` of the root namespace."""
    return _ip("-4", "route", "show", "table", "all").stdout


def netns_exists(name: str) -> bool:
    return (NETNS_DIR / name).exists()


def interface_exists(name: str) -> bool:
    return Path("/sys/class/net", name).exists()


@contextlib.contextmanager
def _global_lock() -> Iterator[None]:
    lock_dir().mkdir(parents=True, exist_ok=True)
    with open(lock_dir() / "network.lock", "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _subnet_file(subnet: str, suffix: str) -> Path:
    network = ipaddress.ip_network(subnet)
    return lock_dir() / f"{network.network_address}-{network.prefixlen}{suffix}"


def _try_lock(subnet: str):
    """An open, exclusively ``flock`` ed handle on ``subnet`` 's lock file, or None if it is held."""
    handle = open(_subnet_file(subnet, ".lock"), "a")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        return None
    return handle


def _delete_network(netns: str | None, interface: str | None) -> None:
    """Delete a veth (its peer goes with it) and a namespace; missing ones are fine."""
    if interface and interface_exists(interface):
        _ip("link", "del", interface, check=False)
    if netns and netns_exists(netns):
        _ip("netns", "del", netns, check=False)


def _records() -> list[tuple[Path, dict]]:
    records = []
    for path in sorted(lock_dir().glob("*.json")):
        with contextlib.suppress(OSError, ValueError):
            records.append((path, json.loads(path.read_text())))
    return records


def _release_guard_locked(cidr: str | None) -> None:
    """Remove the guard route of ``cidr`` once no agent's record uses the range (global lock held)."""
    if cidr and not any(record.get("range") == cidr for _, record in _records()):
        _ip("route", "del", *guard_route(cidr).split(), check=False)


def _cleanup_stale_locked() -> list[str]:
    removed = []
    for record_path, record in _records():
        with contextlib.suppress(OSError, KeyError, ValueError):
            handle = _try_lock(record["subnet"])
            if handle is None:
                continue  # its agent is alive
            try:
                _delete_network(record.get("netns"), record.get("interface"))
                record_path.unlink(missing_ok=True)
                _release_guard_locked(record.get("range"))
                removed.append(record.get("netns") or record["subnet"])
            finally:
                handle.close()
    return removed


def cleanup_stale() -> list[str]:
    """Delete the namespaces and veths of node agents that died; returns the namespaces removed.

    An agent holds the ``flock`` of its subnet while it lives, so a record whose lock can be taken
    is stale. Safe to call any time, from any process (``cluster down``, a new agent).
    """
    directory = lock_dir()
    if not directory.exists() or not any(directory.glob("*.json")):
        return []
    with _global_lock():
        return _cleanup_stale_locked()


def _setns_socket(netns: str, host: str, port: int) -> socket.socket:
    """A listening TCP socket bound to ``host:port`` inside namespace ``netns``.

    A socket belongs to the namespace it was created in for life, so a short-lived thread enters
    the namespace (``setns`` changes only the calling thread's namespace), creates the socket and
    ends; the agent's own threads stay in the root namespace.
    """
    result: dict[str, object] = {}

    def create() -> None:
        try:
            fd = os.open(NETNS_DIR / netns, os.O_RDONLY | os.O_CLOEXEC)
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                if libc.setns(fd, _CLONE_NEWNET) != 0:
                    errno = ctypes.get_errno()
                    raise OSError(errno, f"setns into {netns}: {os.strerror(errno)}")
            finally:
                os.close(fd)
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(128)
            result["socket"] = sock
        except OSError as exc:
            result["error"] = exc

    thread = threading.Thread(target=create, name=f"setns-{netns}")
    thread.start()
    thread.join()
    if "error" in result:
        raise PodNetworkError(f"cannot listen on {host}:{port} in namespace {netns}: {result['error']}")
    return result["socket"]  # type: ignore[return-value]


@dataclasses.dataclass
class PodNetwork:
    """A ``/24`` held by this process and, unless loopback, the namespace its pods run in.

    ``netns`` is None for the loopback fallback (pods in the root namespace). Call :meth:`close`
    when the agent stops; it deletes the veth and the namespace and releases the subnet.
    """

    subnet: str
    netns: str | None = None
    interface: str | None = None
    range: str | None = None
    _handle: object = dataclasses.field(default=None, repr=False)

    @property
    def namespaced(self) -> bool:
        return self.netns is not None

    @property
    def gateway(self) -> str | None:
        """The host end's address (``10.244.N.1``), reachable from the pods; None for loopback."""
        return gateway_address(self.subnet) if self.namespaced else None

    def record(self) -> dict:
        """What ``pod-network.json`` and the ownership record say about this network."""
        return {"subnet": self.subnet, "netns": self.netns, "interface": self.interface,
                "gateway": self.gateway, "namespaced": self.namespaced}

    def command_prefix(self) -> list[str]:
        """Prepend to a command line to run it in the pods' namespace (``nsenter`` execs: same pid)."""
        if not self.namespaced:
            return []
        return [_tool("nsenter"), f"--net={NETNS_DIR / self.netns}", "--"]

    def add_address(self, ip: str, device: str = POD_INTERFACE) -> None:
        """Make ``ip`` (a ``/32``) an address of ``device`` in the namespace; present already is fine."""
        if not self.namespaced:
            return
        result = _ip("addr", "add", f"{ip}/32", "dev", device, netns=self.netns, check=False)
        if result.returncode != 0 and "File exists" not in result.stderr:
            raise PodNetworkError(f"cannot add {ip} to {device} in {self.netns}: {result.stderr.strip()}")
        # Linux drops every IPv4 route through a device when its last IPv4 address goes (the last
        # pod of the node ended), so the route to the host end is (re)made with each address.
        route = _ip("route", "replace", f"{self.gateway}/32", "dev", device, "scope", "link", netns=self.netns,
                    check=False)
        if route.returncode != 0:
            raise PodNetworkError(f"cannot route {self.gateway} from {self.netns}: {route.stderr.strip()}")

    def remove_address(self, ip: str, device: str = POD_INTERFACE) -> None:
        """Remove ``ip`` from ``device`` in the namespace; absent (or namespace gone) is fine."""
        if self.namespaced and netns_exists(self.netns):
            _ip("addr", "del", f"{ip}/32", "dev", device, netns=self.netns, check=False)

    def addresses(self, device: str = POD_INTERFACE) -> list[str]:
        """The IPv4 addresses of ``device`` inside the namespace."""
        if not self.namespaced:
            return []
        out = _ip("-4", "-o", "addr", "show", "dev", device, netns=self.netns).stdout
        return [line.split()[3].split("/")[0] for line in out.splitlines() if len(line.split()) > 3]

    def listen(self, host: str, port: int) -> socket.socket:
        """A listening socket on ``host:port`` where the pods are (inside the namespace if any)."""
        if not self.namespaced:
            return socket.create_server((host, port))
        return _setns_socket(self.netns, host, port)

    def close(self) -> None:
        """Delete the veth and the namespace, forget the record and release the subnet (idempotent).

        The range's guard route goes too when this was the last agent using the range.
        """
        if self._handle is None:
            return
        if not self.namespaced:
            self._release()
            return
        with _global_lock():
            self._close_locked()

    def _close_locked(self) -> None:
        try:
            _delete_network(self.netns, self.interface)
            _subnet_file(self.subnet, ".json").unlink(missing_ok=True)
            _release_guard_locked(self.range)
        finally:
            self._release()

    def _release(self) -> None:
        if self._handle is not None:
            self._handle.close()  # type: ignore[attr-defined]
            self._handle = None


def _claim(cidr: str, routes_text: str = "") -> tuple[str, object]:
    """Claim a free ``/24`` of ``cidr`` (caller holds the global lock); returns (subnet, lock handle)."""
    free, clashes = candidate_subnets(cidr, routes_text)
    for subnet in free:
        handle = _try_lock(subnet)
        if handle is not None:
            return subnet, handle
    if not free:
        raise PodNetworkError(clash_message(cidr, clashes))
    raise PodNetworkError(f"every free /{SUBNET_PREFIX} of {cidr} is held by another node agent")


def loopback_network(cidr: str = LOOPBACK_POD_RANGE) -> PodNetwork:
    """Claim a ``/24`` of a loopback range: no namespace; Services get no endpoints (non-root fallback)."""
    if not is_loopback(cidr):
        raise ValueError(f"{cidr} is not a loopback range")
    with _global_lock():
        subnet, handle = _claim(cidr)
    return PodNetwork(subnet, _handle=handle)


def namespaced_network(cidr: str, state_dir: str | Path, node_name: str) -> PodNetwork:
    """Claim a ``/24`` of ``cidr`` and make the node's namespace and veth (see the module doc).

    Deletes stale networks of dead agents first. Raises :class:`PodNetworkError` naming the cause
    (not root, iproute2/nsenter missing, a route clash, every subnet taken, an ``ip`` failure);
    anything half made is deleted again.
    """
    if is_loopback(cidr):
        raise PodNetworkError(f"pod range {cidr} is loopback: the API server refuses loopback addresses "
                              "in EndpointSlices; use a private range such as 10.244.0.0/16")
    if os.geteuid() != 0:
        raise PodNetworkError("pod networking needs root (it creates a network namespace and a veth pair)")
    _tool("nsenter")
    net_id = network_id(state_dir, node_name)
    netns, interface = netns_name(net_id), host_interface_name(net_id)
    with _global_lock():
        _cleanup_stale_locked()
        if netns_exists(netns) or interface_exists(interface):
            # Left by an agent of this cluster and node whose record is gone: nothing else owns the name.
            _delete_network(netns, interface)
        subnet, handle = _claim(cidr, root_routes())
        network = PodNetwork(subnet, netns, interface, str(ipaddress.ip_network(cidr)), _handle=handle)
        record = {**network.record(), "range": network.range, "pid": os.getpid(), "state_dir": str(state_dir),
                  "node": node_name}
        _subnet_file(subnet, ".json").write_text(json.dumps(record))
        try:
            gateway = gateway_address(subnet)
            prefix = ipaddress.ip_network(subnet).prefixlen
            _ip("netns", "add", netns)
            _ip("link", "add", interface, "type", "veth", "peer", "name", POD_INTERFACE, "netns", netns)
            _ip("addr", "add", f"{gateway}/{prefix}", "dev", interface)
            _ip("link", "set", interface, "up")
            _ip("link", "set", "lo", "up", netns=netns)
            _ip("link", "set", POD_INTERFACE, "up", netns=netns)
            _ip("route", "add", f"{gateway}/32", "dev", POD_INTERFACE, "scope", "link", netns=netns)
            guard = _ip("route", "add", *guard_route(cidr).split(), check=False)
            if guard.returncode != 0 and "File exists" not in guard.stderr:
                raise PodNetworkError(f"`ip route add {guard_route(cidr)}` failed: {guard.stderr.strip()}")
        except PodNetworkError as exc:
            network._close_locked()
            raise PodNetworkError(f"cannot create the pod network namespace {netns} (needs root with "
                                  f"CAP_NET_ADMIN and CAP_SYS_ADMIN, and iproute2 with `ip netns`): {exc}") from exc
        except BaseException:
            network._close_locked()
            raise
    return network
