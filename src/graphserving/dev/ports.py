"""Free loopback ports for servers that a test, the demo or a benchmark starts as another process.

``bind(("127.0.0.1", 0))`` hands out a port from the kernel's ephemeral range
(``net.ipv4.ip_local_port_range``, 32768-60999 by default), the range the kernel also draws the
source ports of outgoing connections from. A port read that way and passed to a server process is
free only until some connection takes it as its source port: a suite that starts a control plane
makes hundreds of them (kube-apiserver to etcd, clients to the apiserver), and a kube-scheduler
started seconds later failed to bind its ``--secure-port`` with "address already in use". Ports
below the ephemeral range are never given to outgoing connections, so :func:`free_port` picks one
of those that binds now and that this process has not handed out before.
"""
from __future__ import annotations

import random
import socket
from pathlib import Path

LOWEST_PORT = 10000
"""Below this are well-known and registered services' usual ports (and 8000-9999 are common
development servers'); nothing in the project needs them."""

_EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_DEFAULT_EPHEMERAL_LOW = 32768
_handed_out: set[int] = set()
_random = random.SystemRandom()


def ephemeral_range_start(path: Path = _EPHEMERAL_RANGE_FILE) -> int:
    """The first port of the kernel's ephemeral range (the first number of ``path``; 32768 where it
    cannot be read, Linux's default)."""
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return _DEFAULT_EPHEMERAL_LOW


def _binds(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(*, attempts: int = 200) -> int:
    """A TCP port on 127.0.0.1 that binds right now, below the ephemeral range and not handed out
    before by this process. Where the ephemeral range leaves no room (it starts at or below
    :data:`LOWEST_PORT` + 1000), a port the kernel picks (``bind(port 0)``) instead.

    Raises:
        OSError: no candidate bound in ``attempts`` tries.
    """
    high = ephemeral_range_start()
    if high - LOWEST_PORT < 1000:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            return sock.getsockname()[1]
    for _ in range(attempts):
        port = _random.randrange(LOWEST_PORT, high)
        if port not in _handed_out and _binds(port):
            _handed_out.add(port)
            return port
    raise OSError(f"no free loopback port in {LOWEST_PORT}-{high - 1} after {attempts} tries")
