"""Pod networks: names per cluster and node, one /24 per agent, never a subnet that clashes with a route."""

import pytest

from graphserving.dev import pod_network

ROUTES = """\
default via 192.0.2.1 dev eth0
192.0.2.0/24 dev eth0 proto kernel scope link src 192.0.2.2
10.244.0.0/24 dev gs-0a1b2c3d proto kernel scope link src 10.244.0.1
local 10.244.0.1 dev gs-0a1b2c3d table local proto kernel scope host src 10.244.0.1
local 127.0.0.0/8 dev lo table local proto kernel scope host src 127.0.0.1
local 192.0.2.2 dev eth0 table local proto kernel scope host src 192.0.2.2
"""


def test_the_network_id_is_stable_for_a_cluster_and_node():
    assert pod_network.network_id("/state/a", "node-1") == pod_network.network_id("/state/a/", "node-1")
    assert len(pod_network.network_id("/state/a", "node-1")) == 8


def test_clusters_and_nodes_get_distinct_network_ids():
    ids = {pod_network.network_id("/state/a", "node-1"), pod_network.network_id("/state/b", "node-1"),
           pod_network.network_id("/state/a", "node-2")}
    assert len(ids) == 3


def test_namespace_and_host_interface_are_named_after_the_id_within_the_kernel_limit():
    assert pod_network.netns_name("0a1b2c3d") == "gs-0a1b2c3d"
    assert pod_network.host_interface_name("0a1b2c3d") == "gs-0a1b2c3d"
    with pytest.raises(ValueError, match="longer than 15"):
        pod_network.host_interface_name("0123456789abcdef")


def test_the_host_end_takes_the_first_address_of_the_subnet():
    assert pod_network.gateway_address("10.244.7.0/24") == "10.244.7.1"


def test_a_range_clashing_with_an_interface_route_is_reported():
    assert pod_network.overlapping_routes("192.0.0.0/16", ROUTES) == [
        "192.0.2.0/24 dev eth0 proto kernel scope link src 192.0.2.2",
        "local 192.0.2.2 dev eth0 table local proto kernel scope host src 192.0.2.2"]


def test_the_default_route_is_no_clash():
    assert pod_network.overlapping_routes("10.244.1.0/24", ROUTES) == []


def test_subnets_with_a_route_are_skipped():
    free, clashes = pod_network.candidate_subnets("10.244.0.0/22", ROUTES)
    assert free == ["10.244.1.0/24", "10.244.2.0/24"]  # 10.244.3.0/24 is for fake pods
    assert clashes == ["10.244.0.0/24 dev gs-0a1b2c3d proto kernel scope link src 10.244.0.1",
                       "local 10.244.0.1 dev gs-0a1b2c3d table local proto kernel scope host src 10.244.0.1"]


def test_the_ranges_own_guard_route_is_no_clash():
    free, clashes = pod_network.candidate_subnets("10.244.0.0/22", "unreachable 10.244.0.0/22 \n")
    assert (free[0], clashes) == ("10.244.0.0/24", [])
    assert pod_network.guard_route("10.244.0.0/22") == "unreachable 10.244.0.0/22"


def test_the_last_slash_22_is_kept_for_kwok_fake_pods():
    assert pod_network.fake_pod_subnet("10.244.0.0/16") == "10.244.252.0/22"
    free, _ = pod_network.candidate_subnets("10.244.0.0/16", "")
    assert (len(free), free[-1]) == (252, "10.244.251.0/24")


def test_a_small_range_keeps_its_last_quarter_for_fake_pods():
    assert pod_network.fake_pod_subnet("10.244.0.0/23") == "10.244.1.128/25"
    assert pod_network.candidate_subnets("10.244.0.0/23", "")[0] == ["10.244.0.0/24"]


def test_a_local_route_for_the_whole_range_left_by_older_versions_is_named_with_its_fix():
    routes = "local 10.244.0.0/16 dev lo table local scope host\n"
    free, clashes = pod_network.candidate_subnets("10.244.0.0/16", routes)
    assert free == []
    assert pod_network.clash_message("10.244.0.0/16", clashes).endswith(
        "remove it with `ip route del local 10.244.0.0/16 dev lo`")


def test_agents_claim_distinct_loopback_subnets(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAPHSERVING_POD_NETWORK_DIR", str(tmp_path))
    first = pod_network.loopback_network("127.3.0.0/16")
    second = pod_network.loopback_network("127.3.0.0/16")
    assert (first.subnet, second.subnet) == ("127.3.0.0/24", "127.3.1.0/24")
    assert not first.namespaced and first.command_prefix() == []
    first.close()
    assert pod_network.loopback_network("127.3.0.0/16").subnet == "127.3.0.0/24"


def test_a_loopback_range_is_refused_for_a_namespace():
    with pytest.raises(pod_network.PodNetworkError, match="refuses loopback addresses"):
        pod_network.namespaced_network("127.3.0.0/16", "/state", "node")
