"""Pod IP addresses for the development node agent: reachable on this machine, valid for Kubernetes.

Each pod needs its own address that local processes can bind and reach. Loopback (127.0.0.0/8)
would need no setup, but the API server refuses loopback addresses in EndpointSlices
(``may not be in the loopback range``), so Services would have no endpoints. Instead a private
range (``10.244.0.0/16`` by default, ``$GRAPHSERVING_POD_RANGE`` to change it) is made local with
one route, the Linux "AnyIP" mechanism::

    ip route add local 10.244.0.0/16 dev lo

after which every address in the range can be bound and connected to on this machine, like
127.0.0.0/8. Adding the route needs root (CAP_NET_ADMIN); without it the agent falls back to
loopback addresses (pods run and are reachable, but their Services have no endpoints) and says so.
The route is refused if the range overlaps a route the machine already has.

Several clusters may run at once (a ``cluster up`` and test sessions): each node agent claims one
``/24`` of the range by holding an ``flock`` on ``<cache>/pod-network/<subnet>.lock`` for its
lifetime, so two agents never hand out the same address. The route is removed again when no
agent holds a subnet (:func:`release_route_if_unused`).
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import re
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

from graphserving.dev import binaries

DEFAULT_POD_RANGE = "10.244.0.0/16"
LOOPBACK_POD_RANGE = "127.1.0.0/16"
SUBNET_PREFIX = 24


class PodNetworkError(RuntimeError):
    """The pod range cannot be made local; the message says what to run or set."""


def pod_range() -> str:
    return os.environ.get("GRAPHSERVING_POD_RANGE") or DEFAULT_POD_RANGE


def lock_dir() -> Path:
    return binaries.cache_dir() / "pod-network"


def is_loopback(cidr: str) -> bool:
    return ipaddress.ip_network(cidr).subnet_of(ipaddress.ip_network("127.0.0.0/8"))


def is_local(cidr: str) -> bool:
    """True if this machine accepts a bind to an address inside ``cidr``."""
    address = str(next(ipaddress.ip_network(cidr).hosts()))
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((address, 0))
            return True
        except OSError:
            return False


_ROUTE_DST = re.compile(r"^(?:(?:local|unicast|broadcast|blackhole|unreachable|prohibit)\s+)?(\d+\.\d+\.\d+\.\d+(?:/\d+)?)\s")


def overlapping_routes(cidr: str, routes_text: str) -> list[str]:
    """Lines of ``ip -4 route show table all`` whose destination overlaps ``cidr`` (pure)."""
    network = ipaddress.ip_network(cidr)
    hits = []
    for line in routes_text.splitlines():
        match = _ROUTE_DST.match(line.strip())
        if not match:
            continue
        dst = ipaddress.ip_network(match.group(1), strict=False)
        if dst.overlaps(network) and not (line.strip().startswith("local") and dst == network):
            hits.append(line.strip())
    return hits


@contextlib.contextmanager
def _global_lock() -> Iterator[None]:
    lock_dir().mkdir(parents=True, exist_ok=True)
    with open(lock_dir() / "route.lock", "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _ip() -> str:
    ip = shutil.which("ip") or next((p for p in ("/usr/sbin/ip", "/sbin/ip") if os.path.exists(p)), None)
    if ip is None:
        raise PodNetworkError("the `ip` command (iproute2) is not installed")
    return ip


def ensure_route(cidr: str) -> None:
    """Make every address in ``cidr`` local (``ip route add local CIDR dev lo``) unless it already is."""
    if is_loopback(cidr) or is_local(cidr):
        return
    ip = _ip()
    routes = subprocess.run([ip, "-4", "route", "show", "table", "all"], capture_output=True, text=True).stdout
    clash = overlapping_routes(cidr, routes)
    if clash:
        raise PodNetworkError(f"pod range {cidr} overlaps routes of this machine ({'; '.join(clash[:3])}); "
                              "set GRAPHSERVING_POD_RANGE to a free private range")
    result = subprocess.run([ip, "route", "add", "local", cidr, "dev", "lo"], capture_output=True, text=True)
    if result.returncode != 0 and not is_local(cidr):
        raise PodNetworkError(f"cannot make {cidr} local ({result.stderr.strip()}): run once as root "
                              f"`ip route add local {cidr} dev lo`")


class SubnetClaim:
    """A ``/24`` of the pod range held (by ``flock``) for the life of this object's process."""

    def __init__(self, subnet: str, handle) -> None:
        self.subnet = subnet
        self._handle = handle

    def release(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None


def claim_subnet(cidr: str) -> SubnetClaim:
    """Make ``cidr`` local and claim a free ``/24`` of it; raises :class:`PodNetworkError`."""
    network = ipaddress.ip_network(cidr)
    prefix = max(SUBNET_PREFIX, network.prefixlen)
    with _global_lock():
        ensure_route(cidr)
        for subnet in network.subnets(new_prefix=prefix):
            handle = open(lock_dir() / f"{subnet.network_address}-{prefix}.lock", "a")
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.close()
                continue
            return SubnetClaim(str(subnet), handle)
    raise PodNetworkError(f"every /{prefix} of {cidr} is held by another node agent")


def release_route_if_unused(cidr: str) -> bool:
    """Remove the local route of ``cidr`` when no node agent holds a subnet of it; True if removed."""
    if is_loopback(cidr) or not lock_dir().exists():
        return False
    network = ipaddress.ip_network(cidr)
    with _global_lock():
        for path in lock_dir().glob("*.lock"):
            if path.name == "route.lock":
                continue
            name = path.stem.replace("-", "/")
            with contextlib.suppress(ValueError):
                if not ipaddress.ip_network(name).subnet_of(network):
                    continue
            with open(path, "a") as handle:
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    return False  # an agent still uses it
                fcntl.flock(handle, fcntl.LOCK_UN)
        try:
            ip = _ip()
        except PodNetworkError:
            return False
        routes = subprocess.run([ip, "-4", "route", "show", "table", "local"], capture_output=True, text=True).stdout
        if not any(line.split()[:2] == ["local", cidr] for line in routes.splitlines()):
            return False
        return subprocess.run([ip, "route", "del", "local", cidr, "dev", "lo"],
                              capture_output=True).returncode == 0
