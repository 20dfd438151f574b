"""Kubernetes Events from the operator (core/v1, so ``kubectl describe`` shows them).

Repeats are aggregated as Kubernetes' own event recorder aggregates them (the event correlator
of client-go's ``tools/record``): an Event with the same involved object (uid), type, reason and
message as one this process posted at most :data:`WINDOW` ago is not created again; the existing
Event's ``count`` and ``lastTimestamp`` are patched instead, so ``kubectl describe`` shows
"(x12 over 5m)" and etcd holds one object rather than twelve. The source is the same for every
Event this process posts (:data:`COMPONENT`), so the key leaves it out.

The decision is the pure function :func:`decide`; :class:`Recorder` holds the bounded cache of
Events posted and makes the API calls. Events are best effort: failures are logged, never raised.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import socket
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

from kubernetes import client
from kubernetes.client.rest import ApiException

COMPONENT = "graphserving-operator"
MERGE = "application/merge-patch+json"
MAX_MESSAGE = 1024

#: How long after an Event's latest occurrence a repeat still counts on it rather than creating a
#: new Event. 10 minutes mirrors the Kubernetes event recorder's aggregation window (client-go's
#: event correlator, ``defaultAggregateIntervalInSeconds = 600``).
WINDOW = dt.timedelta(minutes=10)

#: Keys remembered at most, least recently posted dropped first; 4096 is the size of client-go's
#: event correlator caches (``maxLruCacheEntries``). One entry is a few hundred bytes.
CACHE_SIZE = 4096

#: Seconds one create or patch may take: the key's lock is held across the call (two concurrent
#: repeats must not both create), so a hung API server must not hold that Event's posters for long.
REQUEST_TIMEOUT_SECONDS = 10.0

#: Locks that serialise posts of the same key (a key hashes to one of them); other keys go on.
KEY_LOCKS = 64

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EventKey:
    """What makes two Events the same occurrence: involved object, type, reason and message.

    ``uid`` is the involved object's ``metadata.uid`` (``kind/name`` when it has none), so a
    recreated object with the same name starts new Events. ``message`` is the stored (cut) message.
    """

    namespace: str | None
    uid: str
    type: str
    reason: str
    message: str


@dataclass(frozen=True)
class Seen:
    """An Event this process created: its name, occurrences so far, first and latest occurrence (UTC)."""

    name: str
    count: int
    first: dt.datetime
    last: dt.datetime


def involved(obj: Mapping[str, Any]) -> dict[str, Any]:
    meta = obj.get("metadata") or {}
    return {
        "apiVersion": obj.get("apiVersion"),
        "kind": obj.get("kind"),
        "name": meta.get("name"),
        "namespace": meta.get("namespace"),
        "uid": meta.get("uid"),
        "resourceVersion": meta.get("resourceVersion"),
    }


def event_key(obj: Mapping[str, Any], type_: str, reason: str, message: str) -> EventKey:
    """The aggregation key of an Event about ``obj`` (see :class:`EventKey`)."""
    meta = obj.get("metadata") or {}
    uid = meta.get("uid") or f"{obj.get('kind')}/{meta.get('name')}"
    return EventKey(meta.get("namespace"), uid, type_, reason, message[:MAX_MESSAGE])


def decide(seen: Seen | None, now: dt.datetime, window: dt.timedelta = WINDOW) -> Literal["create", "patch"]:
    """Whether an occurrence at ``now`` creates a new Event or patches the one in ``seen``.

    ``"patch"`` when the same key was posted and its latest occurrence is at most ``window`` before
    ``now`` (a clock that stepped back counts as inside); ``"create"`` when it was never posted (or
    was evicted from the cache) or the window has passed. Timestamps are timezone-aware.
    """
    if seen is None or now - seen.last > window:
        return "create"
    return "patch"


def _stamp(now: dt.datetime) -> str:
    return now.astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def event_body(obj: Mapping[str, Any], type_: str, reason: str, message: str, now: dt.datetime) -> dict[str, Any]:
    stamp = _stamp(now)
    meta = obj.get("metadata") or {}
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{meta.get('name')}.", "namespace": meta.get("namespace")},
        "involvedObject": involved(obj),
        "type": type_,
        "reason": reason,
        "message": message[:MAX_MESSAGE],
        "source": {"component": COMPONENT},
        "reportingComponent": COMPONENT,
        "reportingInstance": os.environ.get("POD_NAME") or socket.gethostname(),
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }


def _utcnow() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


class Recorder:
    """Posts Events, aggregating repeats (see the module docstring); safe to call from many threads.

    ``clock`` returns the current time, timezone-aware (tests inject one); ``size`` is the number
    of keys remembered (LRU); ``window`` is :data:`WINDOW` unless a test says otherwise.
    """

    def __init__(self, clock: Callable[[], dt.datetime] = _utcnow, size: int = CACHE_SIZE,
                 window: dt.timedelta = WINDOW) -> None:
        if size < 1:
            raise ValueError(f"Recorder size must be at least 1, got {size}")
        self.clock = clock
        self.size = size
        self.window = window
        self._cache: OrderedDict[EventKey, Seen] = OrderedDict()
        self._lock = threading.Lock()  # the cache only, never across an API call
        # One of these per key is held across its create/patch, so that two threads posting the
        # same Event at once cannot both create it, while other keys' Events go on meanwhile.
        self._key_locks = [threading.Lock() for _ in range(KEY_LOCKS)]

    def seen(self, key: EventKey) -> Seen | None:
        """The cache entry for ``key``, or None (does not refresh its LRU position)."""
        with self._lock:
            return self._cache.get(key)

    def __len__(self) -> int:
        with self._lock:
            return len(self._cache)

    def post(self, core: client.CoreV1Api, obj: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
        """Record one occurrence of an Event about ``obj``: create it, or count it on the existing one.

        A patch that finds the Event gone (404: its TTL passed or someone deleted it) creates a new
        one. Other failures are logged, never raised; a failed patch still counts the occurrence, so
        the next successful patch carries the full count.
        """
        key = event_key(obj, type_, reason, message)
        with self._key_locks[hash(key) % len(self._key_locks)]:
            now = self.clock()  # under the key's lock: a waiting thread's time must not precede the cached one
            seen = self.seen(key)
            if seen is not None and decide(seen, now, self.window) == "patch":
                counted = replace(seen, count=seen.count + 1, last=now)
                try:
                    core.patch_namespaced_event(
                        seen.name, key.namespace, {"count": counted.count, "lastTimestamp": _stamp(now)},
                        _content_type=MERGE, _request_timeout=REQUEST_TIMEOUT_SECONDS,
                    )
                except Exception as exc:  # an Event must never break a reconcile
                    if not (isinstance(exc, ApiException) and exc.status == 404):
                        self._remember(key, counted)
                        log.warning("could not count event %s/%s on %s: %s", reason, message, seen.name, exc)
                        return
                    # 404: the Event expired (the API server's event TTL) or was deleted; create anew.
                else:
                    self._remember(key, counted)
                    return
            body = event_body(obj, type_, reason, message, now)
            try:
                created = core.create_namespaced_event(body["metadata"]["namespace"], body,
                                                       _request_timeout=REQUEST_TIMEOUT_SECONDS)
            except Exception as exc:  # an Event must never break a reconcile
                self._remember(key, None)
                log.warning("could not post event %s/%s: %s", reason, message, exc)
                return
            self._remember(key, Seen(created.metadata.name, 1, now, now))

    def _remember(self, key: EventKey, seen: Seen | None) -> None:
        """Cache ``seen`` for ``key`` as the most recent entry (None: forget the key)."""
        with self._lock:
            if seen is None:
                self._cache.pop(key, None)
                return
            self._cache[key] = seen
            self._cache.move_to_end(key)
            while len(self._cache) > self.size:
                self._cache.popitem(last=False)


#: The process's recorder, behind :func:`post`.
RECORDER = Recorder()


def post(core: client.CoreV1Api, obj: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
    """Post an Event about ``obj`` through :data:`RECORDER`: a repeat within :data:`WINDOW` patches
    the existing Event's count and lastTimestamp. Failures are logged, never raised (events are best effort)."""
    RECORDER.post(core, obj, type_, reason, message)
