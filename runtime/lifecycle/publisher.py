"""Publishing the worker report as an annotation on the worker's own Pod.

The worker patches only ``metadata.annotations["graphserving.io/report"]`` of its own Pod (the
ValidatingAdmissionPolicy shipped in manifests/ enforces exactly that). Publishing runs in a
background thread:

- only the newest report matters: a report submitted while another waits replaces it;
- rate limit: at most one patch per ``min_interval`` seconds (progress during capture can produce
  many reports; terminal phases are published as soon as the interval allows);
- retries: failed patches are retried with exponential back-off (``initial_backoff`` doubling up
  to ``max_backoff`` seconds, full jitter), forever while the worker lives; a newer report
  supersedes the one being retried.

The same thread polls the Pod for the recapture annotation (``graphserving.io/recapture``, a
:class:`~graphserving.contract.report.RecaptureRequest`) that the operator writes to ask for an
in-place recapture, and hands each new request to ``on_recapture``.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
from collections.abc import Callable

from graphserving.contract.report import RECAPTURE_ANNOTATION, REPORT_ANNOTATION, RecaptureRequest, WorkerReport

log = logging.getLogger(__name__)


def pod_api():
    """A CoreV1Api from the standard configuration loading (``KUBECONFIG``, else in-cluster)."""
    from kubernetes import client, config

    config.load_config()
    return client.CoreV1Api()


class PodReportPublisher:
    """Patches the newest report onto a Pod, rate-limited and retried; watches for recapture requests.

    Args:
        pod_name / namespace: the worker's own Pod.
        api: a ``kubernetes.client.CoreV1Api`` (default: :func:`pod_api`).
        min_interval: seconds between patches.
        initial_backoff / max_backoff: retry back-off bounds, seconds.
        poll_interval: seconds between reads of the Pod for a recapture request (0: never).
        on_recapture: called (in the publisher thread) with each new :class:`RecaptureRequest`;
            returning ``False`` means "not yet" (say, the engine loop is not serving yet), and the
            same request is delivered again at the next poll.
    """

    def __init__(
        self,
        pod_name: str,
        namespace: str,
        api=None,
        *,
        min_interval: float = 1.0,
        initial_backoff: float = 0.5,
        max_backoff: float = 30.0,
        poll_interval: float = 5.0,
        on_recapture: Callable[[RecaptureRequest], bool | None] | None = None,
    ):
        self.pod_name = pod_name
        self.namespace = namespace
        self.api = api or pod_api()
        self.min_interval = min_interval
        self.initial_backoff = initial_backoff
        self.max_backoff = max_backoff
        self.poll_interval = poll_interval
        self.on_recapture = on_recapture
        self.published = 0
        self.failures = 0
        self.last_error: str | None = None
        self._pending: WorkerReport | None = None
        self._cond = threading.Condition()
        self._stop = False
        self._stopped = threading.Event()  # wakes a back-off sleep on close
        self._idle = threading.Event()
        self._idle.set()
        self._seen_recapture: str | None = None
        self._thread = threading.Thread(target=self._run, name="report-publisher", daemon=True)
        self._thread.start()

    def submit(self, report: WorkerReport) -> None:
        """Queue ``report`` for publishing (replacing any report not yet published)."""
        with self._cond:
            self._pending = report
            self._idle.clear()
            self._cond.notify()

    __call__ = submit

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until the newest report is published; False on timeout."""
        return self._idle.wait(timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Publish what is pending (within ``timeout``) and stop the thread."""
        self.flush(timeout)
        with self._cond:
            self._stop = True
            self._stopped.set()
            self._cond.notify()
        self._thread.join(timeout)

    # -- the thread ----------------------------------------------------------------------

    def _patch(self, report: WorkerReport) -> None:
        body = {"metadata": {"annotations": {REPORT_ANNOTATION: report.to_annotation()}}}
        self.api.patch_namespaced_pod(self.pod_name, self.namespace, body)

    def _poll_recapture(self) -> None:
        if self.on_recapture is None or self.poll_interval <= 0:
            return
        pod = self.api.read_namespaced_pod(self.pod_name, self.namespace)
        value = (pod.metadata.annotations or {}).get(RECAPTURE_ANNOTATION)
        if not value or value == self._seen_recapture:
            return
        try:
            request = RecaptureRequest.model_validate(json.loads(value))
        except (ValueError, TypeError) as exc:
            self._seen_recapture = value
            log.warning("ignoring malformed %s annotation: %s", RECAPTURE_ANNOTATION, exc)
            return
        # the operator asks once per graph config: a request the worker cannot take yet is kept
        if self.on_recapture(request) is not False:
            self._seen_recapture = value

    def _run(self) -> None:
        last_publish = 0.0
        last_poll = 0.0
        backoff = self.initial_backoff
        while True:
            with self._cond:
                while self._pending is None and not self._stop:
                    wait = None
                    if self.on_recapture is not None and self.poll_interval > 0:
                        wait = max(0.0, last_poll + self.poll_interval - time.monotonic())
                    if wait == 0.0:
                        break
                    self._cond.wait(wait)
                if self._stop and self._pending is None:
                    return
                report = self._pending
            if report is None:  # time to poll
                try:
                    self._poll_recapture()
                except Exception as exc:  # the API may be briefly unreachable
                    log.debug("polling for recapture failed: %s", exc)
                last_poll = time.monotonic()
                continue
            delay = last_publish + self.min_interval - time.monotonic()
            if delay > 0:
                time.sleep(delay)
                with self._cond:
                    report = self._pending or report
            try:
                self._patch(report)
            except Exception as exc:  # retried with back-off; a newer report supersedes this one
                self.failures += 1
                self.last_error = f"{type(exc).__name__}: {exc}"[:300]
                log.warning("publishing report generation %d failed (%s); retrying in <= %.1f s",
                            report.generation, self.last_error, backoff)
                if self._stopped.wait(random.uniform(0, backoff)):
                    return  # closed: the worker is exiting, stop retrying
                backoff = min(self.max_backoff, backoff * 2)
                continue
            backoff = self.initial_backoff
            last_publish = time.monotonic()
            self.published += 1
            with self._cond:
                if self._pending is report:
                    self._pending = None
                    self._idle.set()
