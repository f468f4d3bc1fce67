"""TCP relays on loopback: one that a test or a benchmark can cut and restore (an outage of one
client's path to a broker while the others keep theirs), and one that delays what it relays (a
slow or far cloud). Bounded: 64 KiB reads, a 5 s connect to the target, daemon threads that end
with their connection."""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
import time

from ddnn.tools.broker import free_port


class TcpRelay:
    """Listens on a free loopback port and relays each connection to ``target`` (host, port).

    :meth:`cut` closes every relayed connection and stops listening (a client's reconnection
    is refused, as with a server that went away); :meth:`restore` listens again on the same
    port.
    """

    def __init__(self, target: tuple[str, int]):
        self.target = target
        self.port = free_port()
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        self.restore()

    @property
    def url(self) -> str:
        return f"mqtt://127.0.0.1:{self.port}"

    def restore(self) -> None:
        listener = socket.create_server(("127.0.0.1", self.port), reuse_port=False)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True,
                         name="relay-accept").start()

    def cut(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(OSError):  # wakes the accepting thread (Linux)
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        with self._lock:
            sockets, self._sockets = self._sockets, set()
        for s in sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    stop = cut

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # cut
            try:
                server = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            # Each end forwards a chunk as it comes: Nagle's algorithm against a delayed ACK
            # would add ~40 ms to a request written in two parts (headers, then body).
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                if self._listener is not listener:  # cut meanwhile
                    client.close()
                    server.close()
                    return
                self._sockets |= {client, server}
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True,
                                 name="relay-pipe").start()

    def _close_pair(self, src: socket.socket, dst: socket.socket) -> None:
        """Forget and close both ends of a relayed connection (either side ended it)."""
        with self._lock:
            self._sockets -= {src, dst}
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            self._close_pair(src, dst)


class DelayingRelay(TcpRelay):
    """A :class:`TcpRelay` that holds every byte :attr:`delay` seconds (half on the way in, half
    on the way out): a server that answers that much later, as over a long or congested link.
    The delay can change while connections are open; bytes keep their order."""

    def __init__(self, target: tuple[str, int], delay: float = 0.0):
        self.delay = delay
        super().__init__(target)

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        due: queue.SimpleQueue[tuple[float, bytes]] = queue.SimpleQueue()
        threading.Thread(target=self._deliver, args=(due, src, dst), daemon=True,
                         name="relay-delay").start()
        try:
            while data := src.recv(65536):
                due.put((time.monotonic() + self.delay / 2, data))
        except OSError:
            pass
        due.put((0.0, b""))  # the end: the deliverer closes both

    def _deliver(self, due: queue.SimpleQueue, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := (item := due.get())[1]:
                time.sleep(max(item[0] - time.monotonic(), 0.0))
                dst.sendall(data)
        except OSError:
            pass
        finally:
            self._close_pair(src, dst)
