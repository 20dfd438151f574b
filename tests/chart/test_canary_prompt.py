"""The helm test's canary prompt: finding the Service's endpoints and reporting failures clearly.

The request itself is exercised against a real worker in test_chart_cluster.py (``helm test``).
"""

from __future__ import annotations

import socket

import pytest

from graphserving.canary_prompt import CanaryError, dns_base_url, ready_endpoint_urls, send_canary
from graphserving.cli import main


def _slice(port, *endpoints, port_name="http"):
    return {"ports": [{"name": port_name, "port": port, "protocol": "TCP"}],
            "endpoints": [{"addresses": [a], "conditions": {"ready": r}} for a, r in endpoints]}


def test_the_dns_address_is_service_dot_namespace_dot_svc():
    assert dns_base_url("smollm2", "llm", 8000) == "http://smollm2.llm.svc:8000"


def test_only_ready_endpoints_are_used():
    slices = [_slice(8000, ("10.244.0.5", True), ("10.244.0.6", False)), _slice(8000, ("10.244.1.7", None))]
    assert ready_endpoint_urls(slices, 8000) == ["http://10.244.0.5:8000", "http://10.244.1.7:8000"]


def test_a_slice_with_another_single_port_uses_it_and_ipv6_is_bracketed():
    assert ready_endpoint_urls([_slice(9000, ("fd00::1", True))], 8000) == ["http://[fd00::1]:9000"]


def test_a_slice_with_several_other_ports_is_skipped():
    multi = {"ports": [{"port": 1}, {"port": 2}], "endpoints": [{"addresses": ["10.0.0.1"]}]}
    assert ready_endpoint_urls([multi], 8000) == []


def test_an_unreachable_service_is_an_error_naming_the_address():
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(CanaryError, match=rf"http://127.0.0.1:{port}/v1/models"):
        send_canary(f"http://127.0.0.1:{port}", "hi", 1, timeout=5)


def test_the_command_exits_1_with_one_line_when_the_prompt_is_not_answered(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = main(["canary-prompt", "--service", "127.0.0.1", "--namespace", "x", "--port", str(port),
                 "--resolve", "dns", "--timeout", "3"])
    err = capsys.readouterr().err
    assert code == 1
    assert err.startswith("canary prompt failed: http://127.0.0.1.x.svc:") and err.count("\n") == 1


def test_the_api_key_goes_in_the_authorization_header(monkeypatch, capsys):
    """A worker with an API key answers 401 without it; the command reads it from GRAPHSERVING_API_KEY."""
    import http.server
    import json
    import threading

    seen = []

    class Worker(http.server.BaseHTTPRequestHandler):
        def _answer(self, body):
            seen.append((self.path, self.headers.get("Authorization")))
            if self.headers.get("Authorization") != "Bearer sk-canary":
                self.send_response(401)
                self.end_headers()
                return
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):  # noqa: N802
            self._answer({"data": [{"id": "m"}]})

        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            self._answer({"choices": [{"text": " Paris"}], "usage": {"completion_tokens": 1}})

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Worker)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        with pytest.raises(CanaryError, match="HTTP 401"):
            send_canary(url, "hi", 1, timeout=5)
        assert send_canary(url, "hi", 1, timeout=5, api_key="sk-canary")["text"] == " Paris"
        assert seen[-2:] == [("/v1/models", "Bearer sk-canary"), ("/v1/completions", "Bearer sk-canary")]
    finally:
        server.shutdown()
