"""The Pod report publisher: newest report wins, retries with back-off, rate limit, recapture requests.

Unit tests drive :class:`PodReportPublisher` with an in-memory object shaped like
``kubernetes.client.CoreV1Api`` (only ``patch_namespaced_pod`` and ``read_namespaced_pod``) that
fails on demand with the client's own ``ApiException``. The cluster test runs it against a real
kube-apiserver (tests/controlplane) and a real Pod.
"""

from __future__ import annotations

import datetime as dt
import threading
import time
from types import SimpleNamespace

import pytest
from kubernetes.client.rest import ApiException

from graphserving.contract.graph_policy import GraphMode
from graphserving.contract.report import (
    RECAPTURE_ANNOTATION,
    REPORT_ANNOTATION,
    Phase,
    Progress,
    RecaptureRequest,
    WorkerIdentity,
    WorkerReport,
    config_hash,
)
from graphserving.contract.worker_config import GraphConfig
from graphserving.dev.pytest_fixtures import wait_for
from graphserving.runtime.lifecycle.publisher import PodReportPublisher

BOUND_S = 30  # only keeps a broken publisher from hanging the suite; no test waits this long when it works
IDENTITY = WorkerIdentity(pod_name="worker-0", namespace="ns", instance="a1b2c3",
                          started_at=dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc))


def report(generation: int, total: int = 100) -> WorkerReport:
    """A contract-valid report of a worker in the middle of capture (progress = generation)."""
    return WorkerReport(
        worker=IDENTITY, model_name="smollm2", graph_config_hash=config_hash(GraphConfig()),
        mode=GraphMode.FULL_AND_PIECEWISE, generation=generation, phase=Phase.CAPTURING,
        progress=Progress(done=min(generation, total), total=total), coverage=0.0,
        updated_at=dt.datetime.now(dt.timezone.utc),
    )


class FakePods:
    """``CoreV1Api``-shaped: records every patched report; fails attempts on demand.

    Args:
        fail: attempt numbers (1-based) that raise ``ApiException(status=500)``; or a callable
            ``attempt -> bool``.
        on_attempt: called with the attempt number before it succeeds or fails.
    """

    def __init__(self, fail=(), on_attempt=None):
        self.fail = fail
        self.on_attempt = on_attempt
        self.attempts = 0
        self.landed: list[WorkerReport] = []
        self.annotations: dict[str, str] = {}
        self.reads = 0
        self._lock = threading.Lock()

    def patch_namespaced_pod(self, name, namespace, body):
        assert (name, namespace) == ("worker-0", "ns")
        assert set(body) == {"metadata"} and set(body["metadata"]) == {"annotations"}
        with self._lock:
            self.attempts += 1
            attempt = self.attempts
        if self.on_attempt:
            self.on_attempt(attempt)
        failing = self.fail(attempt) if callable(self.fail) else attempt in self.fail
        if failing:
            raise ApiException(status=500, reason="Internal Server Error (injected)")
        value = body["metadata"]["annotations"][REPORT_ANNOTATION]
        with self._lock:
            self.annotations[REPORT_ANNOTATION] = value
            self.landed.append(WorkerReport.from_annotation(value))
        return SimpleNamespace(metadata=SimpleNamespace(annotations=dict(self.annotations)))

    def read_namespaced_pod(self, name, namespace):
        self.reads += 1
        return SimpleNamespace(metadata=SimpleNamespace(annotations=dict(self.annotations)))

    def generations(self) -> list[int]:
        return [r.generation for r in self.landed]


def publisher(api, **kwargs) -> PodReportPublisher:
    kwargs.setdefault("min_interval", 0.0)
    kwargs.setdefault("initial_backoff", 0.01)
    kwargs.setdefault("max_backoff", 0.05)
    kwargs.setdefault("poll_interval", 0.0)
    return PodReportPublisher("worker-0", "ns", api, **kwargs)


def test_a_report_lands_as_the_annotation_and_validates():
    api = FakePods()
    pub = publisher(api)
    pub.submit(report(1))
    assert pub.flush(BOUND_S)
    assert api.generations() == [1]
    assert WorkerReport.from_annotation(api.annotations[REPORT_ANNOTATION]) == report(1).model_copy(
        update={"updated_at": api.landed[0].updated_at})
    assert (pub.published, pub.failures) == (1, 0)
    pub.close()


def test_failed_patches_are_retried_until_the_report_lands_and_are_counted():
    api = FakePods(fail={1, 2, 3})
    pub = publisher(api)
    pub.submit(report(7))
    assert pub.flush(BOUND_S)
    assert api.attempts == 4
    assert api.generations() == [7]
    assert (pub.published, pub.failures) == (1, 3)
    assert "500" in pub.last_error
    pub.close()


def test_a_newer_report_supersedes_the_one_being_retried():
    pub_box = []

    def submit_newer_on_first_attempt(attempt):
        if attempt == 1:
            pub_box[0].submit(report(2))

    api = FakePods(fail={1}, on_attempt=submit_newer_on_first_attempt)
    pub = publisher(api)
    pub_box.append(pub)
    pub.submit(report(1))
    assert pub.flush(BOUND_S)
    assert api.generations() == [2]  # generation 1 failed and was never retried once 2 existed
    assert pub.failures == 1
    pub.close()


def test_superseded_reports_never_land_after_newer_ones_under_random_failures():
    api = FakePods(fail=lambda attempt: attempt % 3 == 1)  # every third attempt fails, the first too
    pub = publisher(api)
    for generation in range(1, 61):
        pub.submit(report(generation))
        if generation % 7 == 0:
            time.sleep(0.005)  # let the publisher interleave with the submissions
    assert pub.flush(BOUND_S)
    landed = api.generations()
    assert landed == sorted(set(landed))  # strictly increasing: an older report never overwrites a newer
    assert landed[-1] == 60
    assert WorkerReport.from_annotation(api.annotations[REPORT_ANNOTATION]).generation == 60
    assert pub.failures >= 1
    pub.close()


def test_a_burst_during_a_patch_is_coalesced_into_one_patch_of_the_newest_report():
    in_patch, release = threading.Event(), threading.Event()

    def hold_first(attempt):
        if attempt == 1:
            in_patch.set()
            assert release.wait(BOUND_S)

    api = FakePods(on_attempt=hold_first)
    pub = publisher(api, min_interval=0.2)
    pub.submit(report(1))
    assert in_patch.wait(BOUND_S)
    for generation in range(2, 21):  # capture progress: many reports while one patch is in flight
        pub.submit(report(generation))
    release.set()
    assert pub.flush(BOUND_S)
    assert api.generations() == [1, 20]
    assert pub.published == 2
    pub.close()


def test_close_publishes_what_is_pending_and_stops_the_thread():
    api = FakePods()
    pub = publisher(api, min_interval=0.1)
    pub.submit(report(1))
    pub.submit(report(2))
    pub.close(timeout=BOUND_S)
    assert api.generations()[-1] == 2
    assert not pub._thread.is_alive()


def test_close_stops_the_thread_even_while_the_api_keeps_failing():
    api = FakePods(fail=lambda attempt: True)
    pub = publisher(api, initial_backoff=0.01, max_backoff=0.02)
    pub.submit(report(1))
    wait_for(lambda: api.attempts >= 2, timeout=BOUND_S, message="a retry")
    pub.close(timeout=0.2)
    pub._thread.join(BOUND_S)
    assert not pub._thread.is_alive()
    attempts = api.attempts
    time.sleep(0.1)
    assert api.attempts == attempts  # nothing patches after close
    assert api.landed == []


# ---------------------------------------------------------------------- recapture requests

def recapture_value(sizes: list[int]) -> str:
    graphs = GraphConfig(capture_sizes=sizes)
    return RecaptureRequest(graph_config_hash=config_hash(graphs), graphs=graphs).model_dump_json(by_alias=True)


def test_a_recapture_annotation_reaches_on_recapture_once_per_new_value():
    api = FakePods()
    requests: list[RecaptureRequest] = []
    pub = publisher(api, poll_interval=0.02, on_recapture=requests.append)
    api.annotations[RECAPTURE_ANNOTATION] = recapture_value([1, 2, 4])
    wait_for(lambda: requests, timeout=BOUND_S, message="the first recapture request")
    reads = api.reads
    wait_for(lambda: api.reads >= reads + 3, timeout=BOUND_S, message="more polls")
    assert len(requests) == 1  # the same value is not delivered twice
    assert requests[0].graphs.capture_sizes == [1, 2, 4]
    assert requests[0].graph_config_hash == config_hash(requests[0].graphs)

    api.annotations[RECAPTURE_ANNOTATION] = "{not json"
    reads = api.reads
    wait_for(lambda: api.reads >= reads + 3, timeout=BOUND_S, message="polls of the malformed value")
    assert len(requests) == 1  # malformed: logged and ignored

    api.annotations[RECAPTURE_ANNOTATION] = recapture_value([1, 8])
    wait_for(lambda: len(requests) == 2, timeout=BOUND_S, message="the second recapture request")
    assert requests[1].graphs.capture_sizes == [1, 8]
    pub.close()


def test_a_recapture_request_the_worker_cannot_take_yet_is_delivered_again():
    api = FakePods()
    answers = iter([False, False])  # the engine loop is not serving yet, twice
    calls: list[RecaptureRequest] = []

    def on_recapture(request: RecaptureRequest) -> bool:
        calls.append(request)
        return next(answers, True)

    pub = publisher(api, poll_interval=0.02, on_recapture=on_recapture)
    api.annotations[RECAPTURE_ANNOTATION] = recapture_value([1, 2, 4])
    wait_for(lambda: len(calls) == 3, timeout=BOUND_S, message="the request delivered until taken")
    reads = api.reads
    wait_for(lambda: api.reads >= reads + 3, timeout=BOUND_S, message="more polls")
    assert len(calls) == 3 and all(r.graphs.capture_sizes == [1, 2, 4] for r in calls)  # taken: not again
    pub.close()


def test_polling_survives_api_errors():
    api = FakePods()
    failures = iter([True, True])
    original = api.read_namespaced_pod

    def flaky_read(name, namespace):
        if next(failures, False):
            api.reads += 1
            raise ApiException(status=503)
        return original(name, namespace)

    api.read_namespaced_pod = flaky_read
    api.annotations[RECAPTURE_ANNOTATION] = recapture_value([2])
    requests: list[RecaptureRequest] = []
    pub = publisher(api, poll_interval=0.02, on_recapture=requests.append)
    wait_for(lambda: requests, timeout=BOUND_S, message="the recapture request after two failed reads")
    assert api.reads >= 3
    pub.close()


# ---------------------------------------------------------------------- a real API server

@pytest.mark.cluster
def test_the_report_is_patched_onto_a_real_pod_and_recapture_requests_come_back(kube_api, namespace):
    from kubernetes import client

    core = client.CoreV1Api(kube_api)
    core.create_namespaced_pod(namespace, {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "worker-0"},
        "spec": {"terminationGracePeriodSeconds": 0, "containers": [
            {"name": "main", "image": "busybox", "command": ["sleep", "3600"]}]},
    })
    requests: list[RecaptureRequest] = []
    pub = PodReportPublisher("worker-0", namespace, core, min_interval=0.05, initial_backoff=0.05,
                             max_backoff=0.5, poll_interval=0.1, on_recapture=requests.append)
    try:
        for generation in (1, 2, 3):
            pub.submit(report(generation).model_copy(update={"worker": IDENTITY.model_copy(
                update={"namespace": namespace})}))
        assert pub.flush(BOUND_S)
        pod = core.read_namespaced_pod("worker-0", namespace)
        published = WorkerReport.from_annotation(pod.metadata.annotations[REPORT_ANNOTATION])
        assert published.generation == 3
        assert published.worker.namespace == namespace and published.phase is Phase.CAPTURING

        value = recapture_value([1, 2, 8])
        core.patch_namespaced_pod("worker-0", namespace, {"metadata": {"annotations": {RECAPTURE_ANNOTATION: value}}})
        wait_for(lambda: requests, timeout=BOUND_S, message="the recapture request from the pod annotation")
        assert requests[0].graphs.capture_sizes == [1, 2, 8]
        # the worker's patch touched only its own annotation
        pod = core.read_namespaced_pod("worker-0", namespace)
        assert pod.metadata.annotations[RECAPTURE_ANNOTATION] == value
    finally:
        pub.close()
        core.delete_namespaced_pod("worker-0", namespace, grace_period_seconds=0)


@pytest.mark.cluster
def test_a_worker_in_a_pod_publishes_its_report_and_recaptures_on_the_annotation(
        kube_api, namespace, tiny_model_dir, monkeypatch):
    """The whole loop on a real API server: the Worker publishes, the 'operator' (this test) writes
    the recapture annotation, the worker recaptures in place and publishes the new keys."""
    torch = pytest.importorskip("torch")
    from kubernetes import client

    from graphserving.contract.worker_config import EngineLimits, WorkerConfig
    from graphserving.runtime.model.loader import load_model
    from graphserving.runtime.worker import Worker

    core = client.CoreV1Api(kube_api)
    core.create_namespaced_pod(namespace, {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "worker-0"},
        "spec": {"terminationGracePeriodSeconds": 0, "containers": [
            {"name": "main", "image": "busybox", "command": ["sleep", "3600"]}]},
    })
    # in a Pod, pod_api() loads the in-cluster configuration; here it is the test cluster's admin
    monkeypatch.setattr("graphserving.runtime.lifecycle.publisher.pod_api", lambda: core)
    loaded = load_model(tiny_model_dir("llama3_rope"), revision=None, dtype=torch.float32, device="cpu")
    config = WorkerConfig(model_name="tiny", model_path="tiny",
                          engine=EngineLimits(max_num_seqs=4, max_num_batched_tokens=64, num_kv_blocks=64),
                          graphs=GraphConfig(capture_sizes=[1, 2, 4], piecewise_capture_sizes=[32, 64]))
    worker = Worker(config, loaded, 0.1, environ={"POD_NAME": "worker-0", "POD_NAMESPACE": namespace,
                                                  "GRAPHSERVING_EMULATE_GRAPHS": "1"})
    worker.publisher.poll_interval = 0.2

    def published() -> WorkerReport | None:
        pod = core.read_namespaced_pod("worker-0", namespace)
        value = (pod.metadata.annotations or {}).get(REPORT_ANNOTATION)
        return WorkerReport.from_annotation(value) if value else None

    try:
        worker.start()
        first = wait_for(lambda: (r := published()) and r.phase is Phase.READY and r, timeout=300,
                         message="a Ready report on the pod")
        assert (first.worker.pod_name, first.worker.namespace) == ("worker-0", namespace)
        assert [(m.kind, m.captured) for m in first.modes] == [("FULL", [1, 2, 4]), ("PIECEWISE", [32, 64])]
        wait_for(lambda: worker.async_engine is not None, timeout=60, message="the engine loop")

        graphs = GraphConfig(capture_sizes=[3], piecewise_capture_sizes=[64])
        request = RecaptureRequest(graph_config_hash=config_hash(graphs), graphs=graphs)
        core.patch_namespaced_pod("worker-0", namespace, {"metadata": {"annotations": {
            RECAPTURE_ANNOTATION: request.model_dump_json(by_alias=True)}}})
        after = wait_for(
            lambda: (r := published()) and r.graph_config_hash == config_hash(graphs) and r.phase is Phase.READY and r,
            timeout=300, message="the report of the recaptured graphs on the pod")
        assert [(m.kind, m.captured) for m in after.modes] == [("FULL", [3, 4]), ("PIECEWISE", [64])]
        assert after.generation > first.generation and after.worker.instance == first.worker.instance
        assert Phase.RECAPTURING in [p.phase for p in after.phases]
    finally:
        worker.shutdown()
        core.delete_namespaced_pod("worker-0", namespace, grace_period_seconds=0)
