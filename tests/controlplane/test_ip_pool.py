"""Each pod gets its own address, never shared while held."""

from graphserving.dev.node_agent import IPPool


def test_addresses_are_distinct_and_reused_only_after_release():
    pool = IPPool("10.244.3.0/24")
    a, b = pool.allocate("pod-a"), pool.allocate("pod-b")
    assert a == "10.244.3.2" and b == "10.244.3.3"
    assert pool.allocate("pod-a") == a  # idempotent per pod
    pool.release("pod-a")
    assert pool.allocate("pod-c") == a


def test_an_address_claimed_after_restart_is_not_handed_out_again():
    pool = IPPool("10.244.3.0/24")
    assert pool.claim("pod-a", "10.244.3.2")
    assert not pool.claim("pod-b", "10.244.3.2")
    assert pool.allocate("pod-b") == "10.244.3.3"


def test_an_address_outside_the_subnet_or_the_host_end_is_not_claimed():
    pool = IPPool("10.244.3.0/24")
    assert not pool.claim("pod-a", "10.244.9.2")  # an address from an earlier agent's subnet
    assert not pool.claim("pod-a", "10.244.3.1")  # the host end of the veth
    assert pool.allocate("pod-a") == "10.244.3.2"
