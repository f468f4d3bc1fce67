"""The edge's HTTP side: ``/metrics``, health, recent results, and the devices' HTTP fallback.

``GET /metrics`` (Prometheus text), ``GET /healthz``, ``GET /v1/results?after=N`` (recent
results, for tools without MQTT), ``POST /v1/ingest`` (one message envelope, what a device
publishes over MQTT) and ``POST /v1/results`` (a one-view device's own local-exit result).
Standard library only: a threading server in a background thread.

The POST routes take a bearer token (:mod:`ddnn.edge.credentials`): with per-device tokens, a
device's token posts only that device's envelopes and results (``403`` otherwise), as the
broker's ACL lets a device publish only on its own topics. A multi-view bundle's devices never
post results: the edge answers their frames. At most ``max_connections`` connections are open,
one thread each: past that, the connection that has waited longest for a request is closed to
make room, and when every one is busy inside a route the new one gets ``503``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from ddnn import envelope as env
from ddnn.edge import status_page
from ddnn.edge.aggregator import EdgeAggregator, EdgeSnapshot
from ddnn.edge.credentials import ANY_DEVICE, HttpCredentials
from ddnn.edge.health import EdgeHealth, health_check
from ddnn.envelope import DecodeError
from ddnn.plumbing.metrics import CONTENT_TYPE
from ddnn.plumbing.throttle import LogThrottle
from ddnn.result import Result, ResultError

log = logging.getLogger(__name__)

IDLE_TIMEOUT = 30.0  # seconds a connection may sit idle or trickle before it is closed
MAX_CONNECTIONS = 64  # open connections at most (each holds a thread)
BUSY_LOG_EVERY = 10.0  # seconds between log lines about refused connections
# Drop reasons that mean the sender is wrong (400); the others are normal in a live system.
BAD_REQUEST = {"malformed", "shape", "oversized", "model", "deployment", "unknown_device"}


class Forbidden(Exception):
    """A request whose token may not post what it carries (``403``)."""


def check_device_result(body: bytes, agg: EdgeSnapshot, sender: str = ANY_DEVICE) -> Result:
    """A one-view device's posted result, checked (a ResultError says what is off, Forbidden
    that ``sender`` may not post it).

    It is republished to every consumer of the results topic, so it must be exactly what the
    edge itself would publish: a result by the contract, of a known device, with a class of
    this bundle and its label, from the device's own (local) exit, posted by that device.
    Only a one-view bundle's device answers for itself.
    """
    if not agg.single_view:
        raise Forbidden(f"the bundle has {agg.manifest.views} views: its devices do not post "
                        "results, the edge answers their frames")
    result = Result.from_json(body)
    classes = agg.manifest.classes
    if result.cls >= len(classes):
        raise ResultError(f"class must be an integer in 0..{len(classes) - 1}")
    if result.label != classes[result.cls]:
        raise ResultError(f"label must be {classes[result.cls]!r}, the name of class {result.cls}")
    if result.exit != "local":
        raise ResultError("a device's own result exits at 'local'")
    if len(result.views) != 1 or result.views[0] not in agg.devices or result.missing:
        raise ResultError("views must list the one device of this deployment that answered")
    if sender not in (ANY_DEVICE, result.views[0]):
        raise Forbidden(f"the token of {sender} cannot post a result of {result.views[0]}")
    return result


class HttpMetrics:
    """The HTTP server's series, in the aggregator's registry."""

    def __init__(self, registry) -> None:
        self.refused = registry.counter(
            "ddnn_edge_http_refused_total", "HTTP requests and connections refused, by reason "
            "(unauthorized: 401, forbidden: 403, busy: 503)", ("reason",))
        self.evicted = registry.counter(
            "ddnn_edge_http_evicted_total",
            "Idle HTTP connections closed to make room for a new one")
        self.connections = registry.gauge("ddnn_edge_http_connections",
                                          "Open HTTP connections")


_BUSY = json.dumps({"error": "too many connections; retry later"}).encode()
_BUSY_RESPONSE = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                  b"Retry-After: 1\r\nConnection: close\r\nContent-Length: "
                  + str(len(_BUSY)).encode() + b"\r\n\r\n" + _BUSY)


class BoundedHTTPServer(ThreadingHTTPServer):
    """A thread per connection, at most ``max_connections`` of them.

    A connection is *waiting* while it has no request under way (idle keep-alive, or its
    request line, headers or body still arriving) and *busy* while a route handles its request.
    A new connection past the bound closes the connection that has waited longest; when every
    one is busy it is answered ``503`` and closed, from the accepting thread.
    """

    daemon_threads = True
    request_queue_size = 128  # the listen backlog (socketserver's default is 5)

    def __init__(self, address, handler, max_connections: int, metrics: HttpMetrics):
        self.max_connections = max_connections
        self.metrics = metrics
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._waiting: dict[socket.socket, None] = {}  # insertion order: longest waiting first
        self._busy_log = LogThrottle(period=BUSY_LOG_EVERY)  # a flood: a line per period
        super().__init__(address, handler)

    @property
    def open_connections(self) -> int:
        return len(self._open)

    def process_request(self, request, client_address) -> None:
        with self._lock:
            if len(self._open) >= self.max_connections and not self._make_room():
                admitted = False
            else:
                admitted = True
                self._open.add(request)
                self._waiting[request] = None
                self.metrics.connections.set(len(self._open))
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

    def _make_room(self) -> bool:
        """Close the longest-waiting connection (its thread then ends); False if none waits."""
        if not self._waiting:
            return False
        victim = next(iter(self._waiting))
        del self._waiting[victim]
        self._open.discard(victim)
        with contextlib.suppress(OSError):
            victim.shutdown(socket.SHUT_RDWR)  # wakes its thread's read with end-of-file
        self.metrics.evicted.inc()
        return True

    def _refuse(self, request: socket.socket, client_address) -> None:
        self.metrics.refused.inc(reason="busy")
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
            self.metrics.connections.set(len(self._open))

    def waiting(self, request: socket.socket) -> None:
        """The connection has no request under way: it may be closed to make room."""
        with self._lock:
            if request in self._open:
                self._waiting[request] = None

    def busy(self, request: socket.socket) -> bool:
        """A route takes the connection's request; False if it was closed to make room."""
        with self._lock:
            self._waiting.pop(request, None)
            return request in self._open

    def server_close(self) -> None:
        # Idle keep-alive connections would hold their threads (and this close) for up to
        # IDLE_TIMEOUT: end them now.
        with self._lock:
            for request in self._open:
                with contextlib.suppress(OSError):
                    request.shutdown(socket.SHUT_RDWR)
        super().server_close()

    def handle_error(self, request, client_address) -> None:
        # A client gone mid-request (or a connection closed to make room) is routine.
        log.debug("connection from %s ended with an error", client_address[0], exc_info=True)


class EdgeHttpServer:
    """Serves an :class:`EdgeAggregator` over HTTP on ``host:port`` (port 0: any free port)."""

    def __init__(self, aggregator: EdgeAggregator, host: str = "127.0.0.1", port: int = 0,
                 token: str | None = None, *, tokens: dict[str, str] | None = None,
                 max_connections: int = MAX_CONNECTIONS, health: EdgeHealth | None = None):
        credentials = HttpCredentials(token, tokens)
        handler = _make_handler(aggregator, credentials, health)
        self.metrics = HttpMetrics(aggregator.metrics.registry)
        self.server = BoundedHTTPServer((host, port), handler, max_connections, self.metrics)
        self.port = self.server.server_address[1]
        self.host = host
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> EdgeHttpServer:
        self._thread = threading.Thread(target=self.server.serve_forever, name="edge-http",
                                        daemon=True)
        self._thread.start()
        log.info("edge HTTP on %s (/metrics, /healthz, /v1/ingest, /v1/results)", self.url)
        return self

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        if self._thread is not None:
            self.server.shutdown()
            self._thread.join(timeout=5)
        self.server.server_close()


def _make_handler(agg: EdgeAggregator, credentials: HttpCredentials,
                  health: EdgeHealth | None) -> type[EdgeHandler]:
    return type("Handler", (EdgeHandler,), {"agg": agg, "credentials": credentials,
                                            "health": health})


class EdgeHandler(BaseHTTPRequestHandler):
    """The routes; :func:`_make_handler` binds the aggregator and the credentials."""

    agg: EdgeAggregator
    credentials: HttpCredentials = HttpCredentials()  # who may post, as which device
    health: EdgeHealth | None = None  # without one (a server made alone) the edge counts as able
    server: BoundedHTTPServer
    protocol_version = "HTTP/1.1"  # keep-alive for devices posting every frame
    disable_nagle_algorithm = True  # headers and body are two writes: no 40 ms stalls
    # Socket timeout: an idle or trickling client frees its thread after this many seconds.
    timeout = IDLE_TIMEOUT

    def log_message(self, format, *args):
        log.debug("%s " + format, self.address_string(), *args)

    def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _json(self, status: int, obj) -> None:
        self._send(status, json.dumps(obj).encode())

    def handle_one_request(self) -> None:
        self.server.waiting(self.connection)  # until a route takes the next request
        super().handle_one_request()

    def _begin(self) -> bool:
        """A route takes this request; False if its connection was closed to make room."""
        if self.server.busy(self.connection):
            return True
        self.close_connection = True
        return False

    def _sender(self) -> str | None:
        """The device this request's token speaks for (ANY_DEVICE: any), else None: refused."""
        given = self.headers.get("Authorization", "").encode("utf-8", "replace")
        sender = self.credentials.identify(given)  # constant time: no timing oracle
        if sender is not None:
            return sender
        why = "missing bearer token" if not given else "invalid bearer token"
        log.warning("refused POST %s from %s: %s", self.path[:100], self.client_address[0], why)
        self.server.metrics.refused.inc(reason="unauthorized")
        self.close_connection = True  # the body stays unread: the connection is unusable
        self._json(401, {"error": why})
        return None

    def _forbid(self, why: str) -> None:
        log.warning("refused POST %s from %s: %s", self.path[:100], self.client_address[0], why)
        self.server.metrics.refused.inc(reason="forbidden")
        self._json(403, {"error": why})

    def do_GET(self) -> None:
        if not self._begin():
            return
        agg = self.agg
        url = urllib.parse.urlsplit(self.path)
        if url.path == "/metrics":
            self._send(200, agg.metrics.render().encode(), CONTENT_TYPE)
        elif url.path in ("/healthz", "/readyz", "/livez"):  # edge.health: 503 with reasons
            check = health_check(agg, self.health, url.path)
            self._send(check.status(), check.body())
        elif url.path in ("/status", "/v1/status"):  # edge.status_page: for an operator
            data = status_page.status(agg, health_check(agg, self.health, "/readyz"))
            if url.path == "/status":
                self._send(200, status_page.render(data), "text/html; charset=utf-8")
            else:
                self._json(200, data)
        elif url.path == "/v1/results":
            q = urllib.parse.parse_qs(url.query)
            try:
                after = int(q.get("after", ["-1"])[0])
            except ValueError:
                self._json(400, {"error": "after must be an integer frame id"})
                return
            self._json(200, agg.recent.after(after))
        else:
            self._json(404, {"error": f"no route {url.path}"})

    def do_POST(self) -> None:
        sender = self._sender()
        if sender is None:
            return
        body = self._body()
        if body is None or not self._begin():
            return
        path = urllib.parse.urlsplit(self.path).path
        if path == "/v1/ingest":
            self._ingest(body, sender)
        elif path == "/v1/results":
            self._device_result(body, sender)
        else:
            self._json(404, {"error": f"no route {path}"})

    def _body(self) -> bytes | None:
        """The request body, or None once a refusal was sent (no length, too long)."""
        try:
            length = int(self.headers.get("Content-Length", "-1"))
        except ValueError:
            length = -1
        if length < 0:
            self.close_connection = True  # a body may follow unread: the connection is unusable
            self._json(411, {"error": "Content-Length required"})
            return None
        if length > env.MAX_MESSAGE:
            self.agg.metrics.dropped.inc(reason="oversized")
            self.close_connection = True  # the unread body makes the connection unusable
            self._json(413, {"error": f"body over {env.MAX_MESSAGE} bytes"})
            return None
        return self.rfile.read(length)

    def _ingest(self, body: bytes, sender: str) -> None:
        device = None if sender == ANY_DEVICE else sender
        if device is not None:
            try:
                claimed = env.decode(body).device
            except DecodeError:
                claimed = device  # the ingest counts it as malformed
            # As a device's MQTT topic must match its envelopes (a compact one names nobody).
            if claimed not in (None, device):
                self._forbid(f"the token of {device} cannot post a message of {claimed}")
                return
        reason = self.agg.accept(body, device)
        if reason in BAD_REQUEST:
            self._json(400, {"accepted": False, "reason": reason})
        else:  # taken, or valid but not wanted (late, duplicate): nothing to fix
            self._json(202, {"accepted": reason is None, "reason": reason})

    def _device_result(self, body: bytes, sender: str) -> None:
        try:
            result = check_device_result(body, self.agg.snapshot(), sender)
        except Forbidden as e:
            self._forbid(str(e))
            return
        except ResultError as e:  # (also bad JSON, bad UTF-8, too deeply nested)
            self.agg.metrics.dropped.inc(reason="malformed")
            self._json(400, {"error": str(e)})
            return
        self.agg.publish_result(result)
        self._json(202, {"accepted": True})
