"""Leader election through a ``coordination.k8s.io/v1`` Lease (kopf has none; its peering is not one).

The client-go algorithm: a candidate takes the Lease when it has no holder, or when its record has
not changed for ``leaseDurationSeconds`` *as observed on this candidate's own monotonic clock* (so
clock skew between machines does not matter); the holder renews it every ``renew_seconds``. Writes
carry the ``resourceVersion`` read, so two candidates can never both win a round (the loser gets a
409 Conflict). A holder that fails to renew within the lease duration stops acting.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from kubernetes import client
from kubernetes.client.rest import ApiException

log = logging.getLogger(__name__)


def _micro_time(now: dt.datetime) -> str:
    return now.astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclasses.dataclass(frozen=True)
class LeaseRecord:
    holder: str | None
    lease_seconds: int
    transitions: int
    renew_time: str | None
    resource_version: str | None

    @classmethod
    def from_lease(cls, lease: dict[str, Any]) -> LeaseRecord:
        spec = lease.get("spec") or {}
        return cls(
            holder=spec.get("holderIdentity") or None,
            lease_seconds=int(spec.get("leaseDurationSeconds") or 0),
            transitions=int(spec.get("leaseTransitions") or 0),
            renew_time=spec.get("renewTime"),
            resource_version=(lease.get("metadata") or {}).get("resourceVersion"),
        )

    @property
    def fingerprint(self) -> tuple:
        return (self.holder, self.renew_time, self.transitions)


def may_acquire(record: LeaseRecord | None, identity: str, observed_unchanged_seconds: float) -> bool:
    """Whether ``identity`` may write itself as holder (pure).

    True when there is no Lease or holder, when ``identity`` already holds it, or when the record
    has stayed unchanged for longer than its lease duration on this candidate's clock.
    """
    if record is None or record.holder is None or record.holder == identity:
        return True
    return observed_unchanged_seconds > record.lease_seconds


class LeaderElector:
    def __init__(
        self,
        coordination: client.CoordinationV1Api,
        namespace: str,
        name: str,
        identity: str,
        lease_seconds: int = 15,
        renew_seconds: float = 5.0,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.api = coordination
        self.namespace = namespace
        self.name = name
        self.identity = identity
        self.lease_seconds = lease_seconds
        self.renew_seconds = renew_seconds
        self._monotonic = monotonic
        self._observed: tuple | None = None
        self._observed_at = monotonic()
        self._last_renew = float("-inf")
        self.is_leader = False

    def _body(self, record: LeaseRecord | None, now: dt.datetime) -> dict[str, Any]:
        taking_over = record is None or record.holder != self.identity
        spec = {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": self.lease_seconds,
            "renewTime": _micro_time(now),
            "leaseTransitions": (record.transitions if record else 0) + (1 if record and taking_over and record.holder else 0),
        }
        if taking_over:
            spec["acquireTime"] = _micro_time(now)
        body: dict[str, Any] = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": self.name, "namespace": self.namespace},
            "spec": spec,
        }
        if record is not None:
            body["metadata"]["resourceVersion"] = record.resource_version
        return body

    def try_acquire_or_renew(self) -> bool:
        """One election round; returns whether this candidate holds the Lease afterwards."""
        now = dt.datetime.now(dt.timezone.utc)
        try:
            raw = self.api.read_namespaced_lease(self.name, self.namespace, _preload_content=False)
            record: LeaseRecord | None = LeaseRecord.from_lease(json.loads(raw.data))
        except ApiException as exc:
            if exc.status != 404:
                raise
            record = None
        tick = self._monotonic()
        if record is not None and record.fingerprint != self._observed:
            self._observed, self._observed_at = record.fingerprint, tick
        if not may_acquire(record, self.identity, tick - self._observed_at):
            self.is_leader = False
            return False
        body = self._body(record, now)
        try:
            if record is None:
                self.api.create_namespaced_lease(self.namespace, body)
            else:
                self.api.replace_namespaced_lease(self.name, self.namespace, body)
        except ApiException as exc:
            if exc.status in (409, 422):
                self.is_leader = False
                return False
            raise
        self._last_renew = tick
        self.is_leader = True
        return True

    def acquire(self, stop: threading.Event) -> bool:
        """Block until this candidate leads (True) or ``stop`` is set (False)."""
        while not stop.is_set():
            try:
                if self.try_acquire_or_renew():
                    log.info("leader election: %s acquired lease %s/%s", self.identity, self.namespace, self.name)
                    return True
            except Exception as exc:
                log.warning("leader election: %s", exc)
            stop.wait(self.renew_seconds / 2)
        return False

    def keep_renewing(self, stop: threading.Event, on_lost: Callable[[], None]) -> None:
        """Renew until ``stop``; call ``on_lost`` once when the Lease is lost or cannot be renewed
        within its duration (the caller must then stop acting)."""
        while not stop.wait(self.renew_seconds):
            try:
                if self.try_acquire_or_renew():
                    continue
                log.error("leader election: lost lease %s/%s", self.namespace, self.name)
            except Exception as exc:
                if self._monotonic() - self._last_renew < self.lease_seconds:
                    log.warning("leader election: renew failed, retrying: %s", exc)
                    continue
                log.error("leader election: could not renew within %ss: %s", self.lease_seconds, exc)
            self.is_leader = False
            on_lost()
            return

    def release(self) -> None:
        """Give the Lease up (holder cleared) so a successor need not wait for it to expire."""
        if not self.is_leader:
            return
        try:
            self.api.patch_namespaced_lease(
                self.name, self.namespace, {"spec": {"holderIdentity": None, "leaseDurationSeconds": 1}},
                _content_type="application/merge-patch+json",
            )
        except ApiException as exc:
            log.warning("leader election: release failed: %s", exc)
        self.is_leader = False
