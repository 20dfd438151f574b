"""A TCP relay: every connection accepted on one socket is piped to a fixed target address.

The development node agent uses it to let pods, which live in their own network namespace,
reach the API server on the machine's loopback: the listening socket is created inside the pods'
namespace (at the ``kubernetes`` Service's ClusterIP, so the API server's certificate matches)
and each accepted connection is relayed to ``127.0.0.1:<apiserver port>`` from the root
namespace. Bytes are relayed unchanged (TLS stays end to end); half-closes are passed on, so
long-lived watches and request/response streams both work.

One asyncio event loop in a daemon thread serves every connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading

log = logging.getLogger("graphserving.tcp_forwarder")

#: Bytes read per chunk from either side.
CHUNK_BYTES = 64 * 1024


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
    """Copy ``reader`` to ``writer`` until EOF, then half-close ``writer``; False on a socket error."""
    try:
        while True:
            data = await reader.read(CHUNK_BYTES)
            if not data:
                break
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof() and not writer.is_closing():
            writer.write_eof()
        return True
    except (OSError, RuntimeError):  # reset by peer, or writing to a transport closed meanwhile
        return False


class TcpForwarder:
    """Relays connections accepted on ``listener`` (a listening socket it takes over) to ``target``.

    :meth:`start` returns once connections are accepted; :meth:`stop` closes the listener and
    every open connection (both sides) and returns when the loop has ended. A connection whose
    target refuses is closed at once.
    """

    def __init__(self, listener: socket.socket, target: tuple[str, int], name: str = "tcp-forwarder") -> None:
        self.listener = listener
        self.target = target
        self.address: tuple[str, int] = listener.getsockname()[:2]
        self._name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping: asyncio.Event | None = None
        self._ready = threading.Event()
        self._writers: set[asyncio.StreamWriter] = set()
        self._connections = 0

    @property
    def connections(self) -> int:
        """Connections being relayed right now."""
        return self._connections

    def start(self) -> TcpForwarder:
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()
        self._ready.wait()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        if self._loop is None or self._stopping is None:
            self.listener.close()
            return
        with contextlib.suppress(RuntimeError):  # the loop already ended
            self._loop.call_soon_threadsafe(self._stopping.set)
        if self._thread is not None:
            self._thread.join(timeout)

    def __enter__(self) -> TcpForwarder:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _run(self) -> None:
        self._loop = asyncio.new_event_loop()
        try:
            self._loop.run_until_complete(self._serve())
        finally:
            self._loop.close()
            self._ready.set()

    async def _serve(self) -> None:
        self._stopping = asyncio.Event()
        server = await asyncio.start_server(self._relay, sock=self.listener)
        self._ready.set()
        try:
            await self._stopping.wait()
        finally:
            server.close()
            for writer in list(self._writers):
                writer.close()
            await server.wait_closed()
            # Let the relays see their closed sockets and finish.
            for _ in range(50):
                if not self._connections:
                    break
                await asyncio.sleep(0.01)

    async def _relay(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        self._connections += 1
        self._writers.add(client_writer)
        upstream_writer = None
        try:
            try:
                upstream_reader, upstream_writer = await asyncio.open_connection(*self.target)
            except OSError as exc:
                log.warning("%s: cannot reach %s:%d: %s", self._name, *self.target, exc)
                return
            self._writers.add(upstream_writer)
            tasks = [asyncio.create_task(_pipe(client_reader, upstream_writer)),
                     asyncio.create_task(_pipe(upstream_reader, client_writer))]
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            if not all(task.result() for task in done):
                # One side failed: end the other direction too instead of waiting for its peer.
                client_writer.close()
                upstream_writer.close()
            await asyncio.gather(*tasks)
        finally:
            for writer in (client_writer, upstream_writer):
                if writer is not None:
                    self._writers.discard(writer)
                    writer.close()
            self._connections -= 1
