"""A threading HTTP server that hostile clients cannot fill: the edge's and every tier's
monitoring server (``/livez``, ``/metrics``) are built on it. Standard library only.

A connection is *waiting* while the server waits on its client: no request under way (idle
keep-alive), its request line, headers or body still arriving, or its response not yet taken
(a client that pipelines requests and never reads blocks the write). It is *busy* only while a
route computes its answer. So:

* at most ``max_connections`` connections are open, one thread each; a new one past the bound
  closes the connection that has waited longest (its thread ends at once), and only when every
  one is busy inside a route is it answered ``503`` and closed, from the accepting thread;
* a connection may wait at most ``wait_timeout`` seconds at a time: a client trickling its head
  a byte at a time (slowloris), sending nothing, or not reading its response is closed then;
* a connection's send buffer is fixed at :data:`SEND_BUFFER`: a client that pipelines requests
  and never reads makes the server compute a few answers ahead, not megabytes of them (the
  kernel's autotuning grows a loopback buffer to 4 MiB: hundreds of answers, each computed
  holding the interpreter's lock that ``/livez`` waits for).

So a probe of ``/livez`` always gets a slot at once, however many clients misbehave.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from ddnn.plumbing.throttle import LogThrottle

log = logging.getLogger(__name__)

WAIT_TIMEOUT = 10.0  # seconds a connection may wait on its client at a time (head, body, read)
# Bytes of answers the kernel takes ahead of a client (Linux doubles it for its bookkeeping):
# a connection that pipelines requests and reads nothing makes the server compute an answer or
# two ahead. 32 KiB let the first /livez probe under 80 such clients wait 1.2-1.8 s on the
# loaded shared machine, 8 KiB 0.4-0.7 s (the interpreter's lock: every computing thread
# delays the accepting one); a reading client only waits a round trip more for a 20 KB page.
SEND_BUFFER = 8 * 1024
BUSY_LOG_EVERY = 10.0  # seconds between log lines about refused connections

_BUSY = b'{"error": "too many connections; retry later"}'
_BUSY_RESPONSE = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                  b"Retry-After: 1\r\nConnection: close\r\nContent-Length: "
                  + str(len(_BUSY)).encode() + b"\r\n\r\n" + _BUSY)


class ConnectionEvents:
    """What the server tells its owner (the edge counts them; a monitoring server need not)."""

    def evicted(self) -> None:
        """A waiting connection was closed to make room for a new one."""

    def timed_out(self) -> None:
        """A connection waited longer than ``wait_timeout`` and was closed."""

    def refused_busy(self) -> None:
        """A new connection was answered 503: every open one was busy."""

    def open_connections(self, n: int) -> None:
        """The number of open connections changed."""


class BoundedHTTPServer(ThreadingHTTPServer):
    """A thread per connection, at most ``max_connections`` of them (see the module)."""

    daemon_threads = True
    request_queue_size = 128  # the listen backlog (socketserver's default is 5)

    def __init__(self, address, handler, max_connections: int, *,
                 wait_timeout: float = WAIT_TIMEOUT, events: ConnectionEvents | None = None,
                 tls: ssl.SSLContext | None = None):
        self.max_connections = max_connections
        self.tls = tls  # serve HTTPS only
        self.wait_timeout = wait_timeout
        self.events = events or ConnectionEvents()
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        # connection -> deadline; insertion order: longest waiting first
        self._waiting: dict[socket.socket, float] = {}
        self._busy_log = LogThrottle(period=BUSY_LOG_EVERY)  # a flood: a line per period
        self.closing = threading.Event()  # set when the server closes: long routes end
        super().__init__(address, handler)

    def get_request(self):
        request, client_address = super().get_request()
        with contextlib.suppress(OSError):  # (a connection reset since: its thread finds out)
            request.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
        if self.tls is not None:
            # The handshake runs on the connection's first read, in its own thread (under its
            # wait timeout): a slow or silent client never holds the accepting thread.
            request = self.tls.wrap_socket(request, server_side=True,
                                           do_handshake_on_connect=False)
        return request, client_address

    @property
    def open_connections(self) -> int:
        return len(self._open)

    @property
    def busy_connections(self) -> int:
        """Connections whose request a route is computing an answer to."""
        with self._lock:
            return len(self._open) - len(self._waiting)

    def process_request(self, request, client_address) -> None:
        with self._lock:
            admitted = len(self._open) < self.max_connections or self._make_room()
            if admitted:
                self._open.add(request)
                self._waiting[request] = time.monotonic() + self.wait_timeout
                self.events.open_connections(len(self._open))
        if not admitted:
            self._refuse(request, client_address)
            return
        try:
            super().process_request(request, client_address)  # starts the connection's thread
        except BaseException:
            self._forget(request)
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._forget(request)

    def service_actions(self) -> None:
        """Between two accepts (every half second at most): close the connections that have
        waited on their client past their deadline."""
        now = time.monotonic()
        with self._lock:
            late = [c for c, deadline in self._waiting.items() if deadline < now]
            for c in late:
                self._close(c)
                self.events.timed_out()

    def _close(self, request: socket.socket) -> None:
        del self._waiting[request]
        self._open.discard(request)
        with contextlib.suppress(OSError):
            request.shutdown(socket.SHUT_RDWR)  # wakes its thread's read or write

    def _make_room(self) -> bool:
        """Close the longest-waiting connection (its thread then ends); False if none waits."""
        if not self._waiting:
            return False
        self._close(next(iter(self._waiting)))
        self.events.evicted()
        return True

    def _refuse(self, request: socket.socket, client_address) -> None:
        self.events.refused_busy()
        if refused := self._busy_log():
            log.warning("refused %d connection(s) (the last from %s): %d connections open, "
                        "all busy", refused, client_address[0], self.max_connections)
        try:
            request.settimeout(1.0)  # a fresh socket's send buffer is empty: this never waits
            request.sendall(_BUSY_RESPONSE)
        except OSError:
            pass
        self.shutdown_request(request)

    def _forget(self, request: socket.socket) -> None:
        with self._lock:
            self._open.discard(request)
            self._waiting.pop(request, None)
            self.events.open_connections(len(self._open))

    def waiting(self, request: socket.socket) -> None:
        """The server waits on the client again: the connection may be closed to make room,
        and is closed if it still waits ``wait_timeout`` seconds from now."""
        with self._lock:
            if request in self._open:
                self._waiting.pop(request, None)  # to the end of the line
                self._waiting[request] = time.monotonic() + self.wait_timeout

    def busy(self, request: socket.socket) -> bool:
        """A route takes the connection's request; False if it was closed meanwhile."""
        with self._lock:
            self._waiting.pop(request, None)
            return request in self._open

    def server_close(self) -> None:
        # Waiting connections would hold their threads (and this close) until their deadline.
        self.closing.set()
        with self._lock:
            for request in self._open:
                with contextlib.suppress(OSError):
                    request.shutdown(socket.SHUT_RDWR)
        super().server_close()

    def handle_error(self, request, client_address) -> None:
        # A client gone mid-request (or a connection closed to make room) is routine.
        log.debug("connection from %s ended with an error", client_address[0], exc_info=True)


class BoundedHandler(BaseHTTPRequestHandler):
    """A handler for :class:`BoundedHTTPServer`: routes call :meth:`begin` before computing an
    answer and :meth:`send` to answer."""

    server: BoundedHTTPServer
    protocol_version = "HTTP/1.1"  # keep-alive
    disable_nagle_algorithm = True  # headers and body are two writes: no 40 ms stalls
    timeout = 30.0  # socket timeout of one read or write (the server's deadline comes first)

    def handle_one_request(self) -> None:
        self.server.waiting(self.connection)  # until a route takes the next request
        super().handle_one_request()

    def begin(self) -> bool:
        """A route takes this request; False if its connection was closed meanwhile."""
        if self.server.busy(self.connection):
            return True
        self.close_connection = True
        return False

    def send(self, status: int, body: bytes, ctype: str = "application/json",
             headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.server.waiting(self.connection)  # the client may not read: it must not hold a slot
        self.end_headers()
        self.wfile.write(body)
