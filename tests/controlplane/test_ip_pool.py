"""Each pod gets its own loopback address, never shared while held."""

import pytest

from graphserving.dev.node_agent import IPPool


def test_addresses_are_distinct_and_reused_only_after_release():
    pool = IPPool("127.1.0.0/16")
    a, b = pool.allocate("pod-a"), pool.allocate("pod-b")
    assert a == "127.1.0.2" and b == "127.1.0.3"
    assert pool.allocate("pod-a") == a  # idempotent per pod
    pool.release("pod-a")
    assert pool.allocate("pod-c") == a


def test_an_address_claimed_after_restart_is_not_handed_out_again():
    pool = IPPool("127.1.0.0/16")
    assert pool.claim("pod-a", "127.1.0.2")
    assert not pool.claim("pod-b", "127.1.0.2")
    assert pool.allocate("pod-b") == "127.1.0.3"


def test_a_range_outside_loopback_is_refused():
    with pytest.raises(ValueError, match="not inside 127.0.0.0/8"):
        IPPool("10.0.0.0/24")
