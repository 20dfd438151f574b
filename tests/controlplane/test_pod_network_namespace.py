"""A node agent's namespace and veth are made for real and deleted when their owner is gone (root only)."""

import errno
import ipaddress
import os
import signal
import socket
import subprocess
import sys

import pytest

from graphserving.dev import pod_network

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")

OWNER = """
import sys
from graphserving.dev import pod_network
network = pod_network.namespaced_network(pod_network.pod_range(), sys.argv[1], "stale-node")
print(network.netns, network.interface, network.subnet, flush=True)
sys.stdin.read()  # hold the claim until killed
"""


@pytest.fixture
def owner(tmp_path):
    """A process that made a pod network and holds it; killed by the test."""
    proc = subprocess.Popen([sys.executable, "-c", OWNER, str(tmp_path)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline().split()
    yield proc, line
    proc.kill()
    proc.wait()
    pod_network.cleanup_stale()


def test_the_network_lives_while_its_owner_does(owner):
    proc, (netns, interface, subnet) = owner
    assert pod_network.netns_exists(netns) and pod_network.interface_exists(interface)
    assert netns not in pod_network.cleanup_stale()
    assert pod_network.netns_exists(netns)


def test_addresses_of_the_range_without_a_namespace_are_unreachable_from_this_machine(owner):
    unclaimed = str(ipaddress.ip_network(pod_network.fake_pod_subnet(pod_network.pod_range()))[7])
    routes = subprocess.run(["ip", "-4", "route", "show"], capture_output=True, text=True, check=True).stdout
    # Checked before connecting: without the guard the SYN would leave by the default route.
    guard = pod_network.guard_route(pod_network.pod_range())
    assert guard in [" ".join(line.split()[:2]) for line in routes.splitlines()]
    with pytest.raises(OSError) as refused:
        socket.create_connection((unclaimed, 80), timeout=5)
    assert refused.value.errno == errno.EHOSTUNREACH


def test_a_killed_owners_namespace_and_veth_are_deleted_by_the_next_cleanup(owner):
    proc, (netns, interface, subnet) = owner
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert pod_network.netns_exists(netns)  # nobody deleted it yet
    assert netns in pod_network.cleanup_stale()
    assert not pod_network.netns_exists(netns)
    assert not pod_network.interface_exists(interface)


def test_pod_addresses_are_added_in_the_namespace_only(tmp_path):
    network = pod_network.namespaced_network(pod_network.pod_range(), tmp_path, "addr-node")
    try:
        pod_ip = str(ipaddress.ip_network(network.subnet)[5])
        network.add_address(pod_ip)
        assert network.addresses() == [pod_ip]
        host = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True).stdout
        assert pod_ip not in host.split() and f"{pod_ip}/32" not in host
        network.remove_address(pod_ip)
        assert network.addresses() == []
    finally:
        network.close()
    assert not pod_network.netns_exists(network.netns)


def test_pods_reach_the_host_end_after_the_last_pod_address_went_and_a_new_one_came(tmp_path):
    """Linux drops a device's IPv4 routes with its last address; the next pod must still route."""
    network = pod_network.namespaced_network(pod_network.pod_range(), tmp_path, "route-node")
    try:
        first, second = (str(ipaddress.ip_network(network.subnet)[i]) for i in (5, 6))
        network.add_address(first)
        network.remove_address(first)  # the node's last pod ended
        network.add_address(second)
        routes = subprocess.run(["ip", "-n", network.netns, "route"], capture_output=True, text=True).stdout
        assert f"{network.gateway} dev {pod_network.POD_INTERFACE}" in routes
        reach = subprocess.run(["ip", "-n", network.netns, "route", "get", network.gateway],
                               capture_output=True, text=True)
        assert reach.returncode == 0, reach.stderr
    finally:
        network.close()
