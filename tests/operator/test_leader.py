"""Lease-based leader election: who may take the Lease (pure part)."""

from graphserving.operator.leader import LeaseRecord, may_acquire

HELD = LeaseRecord(holder="a", lease_seconds=15, transitions=0, renew_time="t", resource_version="1")


def test_a_free_lease_may_be_taken():
    assert may_acquire(None, "b", 0.0)
    assert may_acquire(LeaseRecord(None, 15, 1, None, "2"), "b", 0.0)


def test_the_holder_renews():
    assert may_acquire(HELD, "a", 100.0)


def test_another_candidate_waits_while_the_record_keeps_changing():
    assert not may_acquire(HELD, "b", 14.9)


def test_a_record_unchanged_for_longer_than_the_lease_may_be_taken_over():
    assert may_acquire(HELD, "b", 15.1)
