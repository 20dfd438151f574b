"""Event aggregation: a repeat within the window counts on the existing Event instead of a new one.

The decision is tested as a pure function; the recorder against the real API server, with an
injected clock (no sleeping, no timing asserts).
"""

from __future__ import annotations

import datetime as dt
from types import SimpleNamespace

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from graphserving.operator import events
from graphserving.operator.events import Recorder, Seen, decide, event_key

T0 = dt.datetime(2025, 3, 1, 12, 0, 0, tzinfo=dt.timezone.utc)


class Clock:
    """A clock the test moves by hand."""

    def __init__(self, now: dt.datetime = T0) -> None:
        self.now = now

    def __call__(self) -> dt.datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += dt.timedelta(seconds=seconds)


def _obj(uid: str = "uid-1", name: str = "gs", namespace: str = "ns") -> dict:
    return {"apiVersion": "graphserving.io/v1alpha1", "kind": "GraphServing",
            "metadata": {"name": name, "namespace": namespace, "uid": uid}}


# ------------------------------------------------------------------------------ the pure decision

def test_an_event_never_posted_is_created():
    assert decide(None, T0) == "create"


def test_a_repeat_within_the_window_patches():
    seen = Seen("gs.1", 3, T0, T0 + dt.timedelta(minutes=2))
    assert decide(seen, T0 + dt.timedelta(minutes=11)) == "patch"  # 9 minutes after the latest
    assert decide(seen, T0 + dt.timedelta(minutes=12)) == "patch"  # exactly the window


def test_a_repeat_after_the_window_creates():
    seen = Seen("gs.1", 3, T0, T0 + dt.timedelta(minutes=2))
    assert decide(seen, T0 + dt.timedelta(minutes=12, seconds=1)) == "create"


def test_a_clock_that_stepped_back_counts_as_inside_the_window():
    assert decide(Seen("gs.1", 1, T0, T0), T0 - dt.timedelta(seconds=30)) == "patch"


def test_the_window_is_ten_minutes_and_the_cache_4096_keys():
    assert events.WINDOW == dt.timedelta(seconds=600)
    assert events.CACHE_SIZE == 4096


def test_the_key_is_namespace_uid_type_reason_and_the_stored_message():
    key = event_key(_obj(), "Warning", "CanaryFailed", "x" * 2000)
    assert (key.namespace, key.uid, key.type, key.reason, key.message) == (
        "ns", "uid-1", "Warning", "CanaryFailed", "x" * 1024)
    other_object = event_key(_obj(uid="uid-2"), "Warning", "CanaryFailed", "m")
    assert other_object != event_key(_obj(), "Warning", "CanaryFailed", "m")


# -------------------------------------------------------------------- the recorder, fake client

class FakeCore:
    """Records calls; names Events e0, e1, ...; raises what the test sets."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.patch_error: Exception | None = None
        self.create_error: Exception | None = None

    def create_namespaced_event(self, namespace, body, **kwargs):
        self.calls.append(("create", namespace, body["reason"], body["message"], body["count"]))
        if self.create_error is not None:
            raise self.create_error
        return SimpleNamespace(metadata=SimpleNamespace(name=f"e{sum(c[0] == 'create' for c in self.calls) - 1}"))

    def patch_namespaced_event(self, name, namespace, body, **kwargs):
        self.calls.append(("patch", name, body["count"], body["lastTimestamp"], kwargs.get("_content_type")))
        if self.patch_error is not None:
            raise self.patch_error


def test_the_cache_drops_the_least_recently_posted_key_beyond_its_size():
    core, clock = FakeCore(), Clock()
    rec = Recorder(clock=clock, size=2)
    for message in ("a", "b", "a", "c"):  # "a" was posted after "b", so "b" is dropped for "c"
        rec.post(core, _obj(), "Normal", "R", message)
    assert len(rec) == 2
    assert rec.seen(event_key(_obj(), "Normal", "R", "b")) is None
    assert rec.seen(event_key(_obj(), "Normal", "R", "a")) == Seen("e0", 2, T0, T0)
    rec.post(core, _obj(), "Normal", "R", "b")
    assert [c[:2] for c in core.calls] == [("create", "ns"), ("create", "ns"), ("patch", "e0"), ("create", "ns"),
                                          ("create", "ns")]


def test_a_patch_is_a_json_merge_patch_of_count_and_last_timestamp():
    core, clock = FakeCore(), Clock()
    rec = Recorder(clock=clock)
    rec.post(core, _obj(), "Warning", "R", "m")
    clock.advance(90)
    rec.post(core, _obj(), "Warning", "R", "m")
    assert core.calls[1] == ("patch", "e0", 2, "2025-03-01T12:01:30Z", "application/merge-patch+json")


def test_a_failed_patch_is_logged_not_raised_and_the_next_patch_carries_the_full_count(caplog):
    core, clock = FakeCore(), Clock()
    rec = Recorder(clock=clock)
    rec.post(core, _obj(), "Warning", "R", "m")
    core.patch_error = ApiException(status=500, reason="etcd timeout")
    rec.post(core, _obj(), "Warning", "R", "m")
    core.patch_error = None
    rec.post(core, _obj(), "Warning", "R", "m")
    assert [c[:3] for c in core.calls] == [("create", "ns", "R"), ("patch", "e0", 2), ("patch", "e0", 3)]
    assert "could not count event R/m on e0" in caplog.text


def test_a_failed_create_is_logged_not_raised_and_the_repeat_creates_again(caplog):
    core, clock = FakeCore(), Clock()
    rec = Recorder(clock=clock)
    core.create_error = ApiException(status=403, reason="Forbidden")
    rec.post(core, _obj(), "Warning", "R", "m")
    assert rec.seen(event_key(_obj(), "Warning", "R", "m")) is None
    core.create_error = None
    rec.post(core, _obj(), "Warning", "R", "m")
    assert [c[0] for c in core.calls] == ["create", "create"]
    assert rec.seen(event_key(_obj(), "Warning", "R", "m")) == Seen("e1", 1, T0, T0)
    assert "could not post event R/m" in caplog.text


def test_a_repeat_after_the_window_creates_a_new_event():
    core, clock = FakeCore(), Clock()
    rec = Recorder(clock=clock)
    rec.post(core, _obj(), "Warning", "R", "m")
    clock.advance(601)
    rec.post(core, _obj(), "Warning", "R", "m")
    assert [c[0] for c in core.calls] == ["create", "create"]
    assert rec.seen(event_key(_obj(), "Warning", "R", "m")) == Seen("e1", 1, clock.now, clock.now)


# ------------------------------------------------------------------------ against the API server

def _config_map(core: client.CoreV1Api, namespace: str, name: str) -> dict:
    cm = core.create_namespaced_config_map(namespace, {"metadata": {"name": name}, "data": {}})
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": name, "namespace": namespace, "uid": cm.metadata.uid,
                         "resourceVersion": cm.metadata.resource_version}}


def _events(core: client.CoreV1Api, namespace: str, obj: dict) -> list:
    items = core.list_namespaced_event(namespace, field_selector=f"involvedObject.uid={obj['metadata']['uid']}").items
    return sorted(items, key=lambda e: e.metadata.creation_timestamp)


@pytest.mark.cluster
def test_the_same_event_three_times_is_one_event_with_count_three(core, namespace):
    clock = Clock()
    rec = Recorder(clock=clock)
    obj = _config_map(core, namespace, "target")
    for _ in range(3):
        rec.post(core, obj, "Warning", "CanaryFailed", "canary prompt diverged")
        clock.advance(120)
    [event] = _events(core, namespace, obj)
    assert (event.count, event.reason, event.type, event.message) == (3, "CanaryFailed", "Warning",
                                                                       "canary prompt diverged")
    assert event.source.component == events.COMPONENT
    assert event.first_timestamp == T0
    assert event.last_timestamp == T0 + dt.timedelta(seconds=240)
    assert event.last_timestamp >= event.first_timestamp


@pytest.mark.cluster
def test_a_different_message_is_a_second_event(core, namespace):
    rec = Recorder(clock=Clock())
    obj = _config_map(core, namespace, "target")
    for message in ("first", "first", "second"):
        rec.post(core, obj, "Warning", "CanaryFailed", message)
    assert sorted((e.message, e.count) for e in _events(core, namespace, obj)) == [("first", 2), ("second", 1)]


@pytest.mark.cluster
def test_a_repeat_after_the_event_was_deleted_creates_a_new_one(core, namespace):
    clock = Clock()
    rec = Recorder(clock=clock)
    obj = _config_map(core, namespace, "target")
    rec.post(core, obj, "Normal", "RecaptureRequested", "graph config abc")
    rec.post(core, obj, "Normal", "RecaptureRequested", "graph config abc")
    [old] = _events(core, namespace, obj)
    assert old.count == 2
    core.delete_namespaced_event(old.metadata.name, namespace)
    clock.advance(30)
    rec.post(core, obj, "Normal", "RecaptureRequested", "graph config abc")
    [new] = _events(core, namespace, obj)
    assert new.metadata.name != old.metadata.name
    assert (new.count, new.first_timestamp, new.last_timestamp) == (1, clock.now, clock.now)
    rec.post(core, obj, "Normal", "RecaptureRequested", "graph config abc")
    [again] = _events(core, namespace, obj)
    assert (again.metadata.name, again.count) == (new.metadata.name, 2)


@pytest.mark.cluster
def test_post_keeps_its_signature_and_aggregates_through_the_process_recorder(core, namespace):
    obj = _config_map(core, namespace, "target")
    events.post(core, obj, "Normal", "RolloutStarted", "to revision abc")
    events.post(core, obj, "Normal", "RolloutStarted", "to revision abc")
    [event] = _events(core, namespace, obj)
    assert event.count == 2 and event.last_timestamp >= event.first_timestamp
