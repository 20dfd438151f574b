"""Free loopback ports come from below the ephemeral range, bind, and are not handed out twice."""
from __future__ import annotations

import socket

from graphserving.dev import ports


def test_a_free_port_is_below_the_ephemeral_range_and_binds():
    start = ports.ephemeral_range_start()
    handed = [ports.free_port() for _ in range(50)]
    assert len(set(handed)) == 50
    assert all(ports.LOWEST_PORT <= p < start for p in handed)
    with socket.socket() as s:
        s.bind(("127.0.0.1", handed[0]))
        s.listen()


def test_a_port_in_use_is_never_handed_out(monkeypatch):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", ports.LOWEST_PORT))
        busy.listen()
        monkeypatch.setattr(ports, "ephemeral_range_start", lambda: ports.LOWEST_PORT + 1000)
        handed = {ports.free_port() for _ in range(20)}
    assert ports.LOWEST_PORT not in handed
    assert all(ports.LOWEST_PORT < p < ports.LOWEST_PORT + 1000 for p in handed)


def test_the_ephemeral_range_is_read_from_the_kernel_file(tmp_path):
    f = tmp_path / "ip_local_port_range"
    f.write_text("40000\t60999\n")
    assert ports.ephemeral_range_start(f) == 40000
    assert ports.ephemeral_range_start(tmp_path / "missing") == 32768


def test_a_low_ephemeral_range_falls_back_to_a_kernel_chosen_port(monkeypatch):
    monkeypatch.setattr(ports, "ephemeral_range_start", lambda: 1024)
    port = ports.free_port()
    assert 0 < port < 65536
