"""The API-server forwarder relays TCP connections unchanged, many at once, and closes them on stop."""

import socket
import socketserver
import threading

import pytest

from graphserving.dev.tcp_forwarder import TcpForwarder


class EchoServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    request_queue_size = 128  # the default backlog of 5 would make connections wait for SYN retries


class Echo(socketserver.BaseRequestHandler):
    def handle(self):
        while data := self.request.recv(65536):
            self.request.sendall(data.upper())


@pytest.fixture
def echo_server():
    server = EchoServer(("127.0.0.1", 0), Echo)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address
    server.shutdown()
    server.server_close()


@pytest.fixture
def forwarder(echo_server):
    listener = socket.create_server(("127.0.0.1", 0))
    with TcpForwarder(listener, echo_server) as relay:
        yield relay


def recv_exactly(sock, size):
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            break
        data += chunk
    return data


def test_bytes_are_relayed_both_ways(forwarder):
    with socket.create_connection(forwarder.address, timeout=10) as conn:
        payload = bytes(range(97, 123)) * 10_000  # 260 kB, more than one chunk
        conn.sendall(payload)
        assert recv_exactly(conn, len(payload)) == payload.upper()


def test_fifty_connections_are_relayed_at_once(forwarder):
    conns = [socket.create_connection(forwarder.address, timeout=10) for _ in range(50)]
    try:
        for i, conn in enumerate(conns):
            conn.sendall(f"conn-{i}".encode())
        assert [recv_exactly(c, len(f"conn-{i}")) for i, c in enumerate(conns)] == \
               [f"CONN-{i}".encode() for i in range(50)]
    finally:
        for conn in conns:
            conn.close()


def test_a_half_close_from_the_client_still_delivers_the_answer(forwarder):
    with socket.create_connection(forwarder.address, timeout=10) as conn:
        conn.sendall(b"last words")
        conn.shutdown(socket.SHUT_WR)
        assert recv_exactly(conn, 10) == b"LAST WORDS"
        assert conn.recv(10) == b""  # the echo server saw EOF and closed; so did the relay


def test_stop_closes_open_connections_and_the_listener(echo_server):
    relay = TcpForwarder(socket.create_server(("127.0.0.1", 0)), echo_server).start()
    conn = socket.create_connection(relay.address, timeout=10)
    conn.sendall(b"x")
    assert recv_exactly(conn, 1) == b"X"
    relay.stop()
    assert conn.recv(10) == b""
    conn.close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(relay.address, timeout=10)


def test_a_refusing_target_closes_the_client_connection():
    unused = socket.create_server(("127.0.0.1", 0))
    target = unused.getsockname()
    unused.close()
    with TcpForwarder(socket.create_server(("127.0.0.1", 0)), target) as relay:
        with socket.create_connection(relay.address, timeout=10) as conn:
            assert conn.recv(10) == b""
