"""The operator's API client never waits for ever on an API server that does not answer.

A real TCP listener on loopback that accepts connections and never replies stands in for a hung
API server connection (no fake of the client: its own urllib3 pool makes the request).
"""

from __future__ import annotations

import socket
import threading
import time

import pytest
import urllib3
from kubernetes import client

from graphserving.operator.kube import Clients, bounded_api_client


@pytest.fixture()
def silent_server():
    """``http://127.0.0.1:PORT`` of a listener that accepts and reads, but never answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    stop.set()
    thread.join()
    for conn in accepted:
        conn.close()
    listener.close()


def _configured(host: str) -> client.Configuration:
    config = client.Configuration()
    config.host = host
    config.retries = False
    return config


def test_a_request_without_its_own_timeout_fails_after_the_default(silent_server, monkeypatch):
    monkeypatch.setattr(client.Configuration, "get_default_copy", staticmethod(lambda: _configured(silent_server)))
    core = Clients.from_api_client(bounded_api_client(timeout=0.5)).core
    start = time.monotonic()
    with pytest.raises(urllib3.exceptions.ReadTimeoutError):
        core.list_namespaced_pod("default")
    assert 0.4 < time.monotonic() - start < 5


def test_a_request_that_names_its_timeout_keeps_it(silent_server, monkeypatch):
    monkeypatch.setattr(client.Configuration, "get_default_copy", staticmethod(lambda: _configured(silent_server)))
    core = Clients.from_api_client(bounded_api_client(timeout=30)).core
    start = time.monotonic()
    with pytest.raises(urllib3.exceptions.ReadTimeoutError):
        core.list_namespaced_pod("default", _request_timeout=0.3)
    assert time.monotonic() - start < 5
