"""The pod range is made local only where it clashes with nothing, and shared by /24 claims."""

from graphserving.dev import pod_network

ROUTES = """\
default via 192.0.2.1 dev eth0
192.0.2.0/24 dev eth0 proto kernel scope link src 192.0.2.2
local 10.244.0.0/16 dev lo table local scope host
local 127.0.0.0/8 dev lo table local proto kernel scope host src 127.0.0.1
local 192.0.2.2 dev eth0 table local proto kernel scope host src 192.0.2.2
"""


def test_a_range_clashing_with_an_interface_route_is_reported():
    assert pod_network.overlapping_routes("192.0.0.0/16", ROUTES) == [
        "192.0.2.0/24 dev eth0 proto kernel scope link src 192.0.2.2",
        "local 192.0.2.2 dev eth0 table local proto kernel scope host src 192.0.2.2"]


def test_our_own_local_route_and_the_default_route_are_no_clash():
    assert pod_network.overlapping_routes("10.244.0.0/16", ROUTES) == []


def test_agents_claim_distinct_subnets(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAPHSERVING_CACHE_DIR", str(tmp_path))
    first = pod_network.claim_subnet("127.3.0.0/16")
    second = pod_network.claim_subnet("127.3.0.0/16")
    assert (first.subnet, second.subnet) == ("127.3.0.0/24", "127.3.1.0/24")
    first.release()
    assert pod_network.claim_subnet("127.3.0.0/16").subnet == "127.3.0.0/24"
