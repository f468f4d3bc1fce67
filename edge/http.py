"""The edge's HTTP side: ``/metrics``, health, recent results, and the devices' HTTP fallback.

``GET /metrics`` (Prometheus text), ``GET /healthz``, ``GET /v1/results?since=SEQ`` and
``GET /v1/results/stream`` (the answers, for tools without MQTT: :mod:`ddnn.edge.results_feed`),
``POST /v1/ingest`` (one message envelope, what a device
publishes over MQTT), ``POST /v1/results`` (a one-view device's own local-exit result) and
``POST /v1/feedback`` (an operator's label for an answered frame: :mod:`ddnn.edge.feedback`,
with the operator's token, never a device's).
Standard library only: a threading server in a background thread.

The POST routes take a bearer token (:mod:`ddnn.edge.credentials`): with per-device tokens, a
device's token posts only that device's envelopes and results (``403`` otherwise), as the
broker's ACL lets a device publish only on its own topics. A multi-view bundle's devices never
post results: the edge answers their frames.

The connections are bounded by :class:`ddnn.plumbing.http_server.BoundedHTTPServer` (at most
``max_connections``; one that waits on its client, for a request or to take a response, makes
room for a new one and is closed after ten seconds), so ``/livez`` answers however clients
misbehave. ``GET /v1/results``, its stream and ``/status`` take at most :data:`RESULTS_RATE`
requests a second per client address (``429`` past that).
With a certificate and key (``--http-cert-file``, ``--http-key-file``) every route is served
over TLS (HTTPS) only.
"""

from __future__ import annotations

import json
import logging
import ssl
import threading
import urllib.parse
from pathlib import Path

from ddnn import envelope as env
from ddnn.edge import status_page
from ddnn.edge.aggregator import EdgeAggregator
from ddnn.edge.credentials import ANY_DEVICE, HttpCredentials
from ddnn.edge.device_results import Forbidden, check_device_result
from ddnn.edge.health import EdgeHealth, health_check
from ddnn.edge.results_feed import (
    StreamSlots,
    follow,
    results_query,
    stream_start,
)
from ddnn.envelope import DecodeError
from ddnn.errors import ConfigError
from ddnn.plumbing.http_server import BoundedHandler, BoundedHTTPServer, ConnectionEvents
from ddnn.plumbing.metrics import CONTENT_TYPE
from ddnn.plumbing.rate import RateLimiter
from ddnn.result import ResultError

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 64  # open connections at most (each holds a thread)
# GET /v1/results (and its stream, and /status: 10-50 ms of work each) per second and client
# address (a burst of twice that).
RESULTS_RATE = 50.0
# Drop reasons that mean the sender is wrong (400); the others are normal in a live system.
BAD_REQUEST = {"malformed", "shape", "oversized", "model", "deployment", "unknown_device"}


class HttpMetrics:
    """The HTTP server's series, in the aggregator's registry."""

    def __init__(self, registry) -> None:
        self.refused = registry.counter(
            "ddnn_edge_http_refused_total", "HTTP requests and connections refused, by reason "
            "(unauthorized: 401, forbidden: 403, rate: 429, busy: 503, timeout: a client that kept "
            "the server waiting 10 s, closed)", ("reason",))
        self.evicted = registry.counter(
            "ddnn_edge_http_evicted_total",
            "Waiting HTTP connections (idle, slow or not reading) closed to make room for a "
            "new one")
        self.connections = registry.gauge("ddnn_edge_http_connections",
                                          "Open HTTP connections")


class _Events(ConnectionEvents):
    def __init__(self, metrics: HttpMetrics) -> None:
        self.metrics = metrics

    def evicted(self) -> None:
        self.metrics.evicted.inc()

    def timed_out(self) -> None:
        self.metrics.refused.inc(reason="timeout")

    def refused_busy(self) -> None:
        self.metrics.refused.inc(reason="busy")

    def open_connections(self, n: int) -> None:
        self.metrics.connections.set(n)


class EdgeHttpServer:
    """Serves an :class:`EdgeAggregator` over HTTP on ``host:port`` (port 0: any free port)."""

    def __init__(self, aggregator: EdgeAggregator, host: str = "127.0.0.1", port: int = 0,
                 token: str | None = None, *, tokens: dict[str, str] | None = None,
                 max_connections: int = MAX_CONNECTIONS, health: EdgeHealth | None = None,
                 tls: ssl.SSLContext | None = None):
        credentials = HttpCredentials(token, tokens)
        self.metrics = HttpMetrics(aggregator.metrics.registry)
        handler = _make_handler(aggregator, credentials, health, self.metrics)
        self.server = BoundedHTTPServer((host, port), handler, max_connections,
                                        events=_Events(self.metrics), tls=tls)
        self.port = self.server.server_address[1]
        self.host = host
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"{'https' if self.server.tls else 'http'}://{self.host}:{self.port}"

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


def server_tls(cert_file: str | Path, key_file: str | Path) -> ssl.SSLContext:
    """The TLS side of the edge's HTTP server: its certificate (chain) and key."""
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        tls.load_cert_chain(str(cert_file), str(key_file))
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(f"cannot load the HTTP server's certificate ({cert_file}, "
                          f"{key_file}): {e}") from None
    return tls


def _make_handler(agg: EdgeAggregator, credentials: HttpCredentials,
                  health: EdgeHealth | None, metrics: HttpMetrics) -> type[EdgeHandler]:
    return type("Handler", (EdgeHandler,), {
        "agg": agg, "credentials": credentials, "health": health, "metrics": metrics,
        "results_rate": RateLimiter(RESULTS_RATE, burst=2 * RESULTS_RATE),
        "streams": StreamSlots()})


class EdgeHandler(BoundedHandler):
    """The routes; :func:`_make_handler` binds the aggregator and the credentials."""

    agg: EdgeAggregator
    credentials: HttpCredentials = HttpCredentials()  # who may post, as which device
    health: EdgeHealth | None = None  # without one (a server made alone) the edge counts as able
    metrics: HttpMetrics
    results_rate: RateLimiter
    streams: StreamSlots

    def log_message(self, format, *args):
        log.debug("%s " + format, self.address_string(), *args)

    def _json(self, status: int, obj, headers: dict[str, str] | None = None) -> None:
        self.send(status, json.dumps(obj).encode(), headers=headers)

    def _sender(self) -> str | None:
        """The device this request's token speaks for (ANY_DEVICE: any), else None: refused."""
        given = self.headers.get("Authorization", "").encode("utf-8", "replace")
        sender = self.credentials.identify(given)  # constant time: no timing oracle
        if sender is not None:
            return sender
        why = "missing bearer token" if not given else "invalid bearer token"
        log.warning("refused POST %s from %s: %s", self.path[:100], self.client_address[0], why)
        self.metrics.refused.inc(reason="unauthorized")
        self.close_connection = True  # the body stays unread: the connection is unusable
        self._json(401, {"error": why})
        return None

    def _forbid(self, why: str) -> None:
        log.warning("refused POST %s from %s: %s", self.path[:100], self.client_address[0], why)
        self.metrics.refused.inc(reason="forbidden")
        self._json(403, {"error": why})

    def do_GET(self) -> None:
        if not self.begin():
            return
        agg = self.agg
        url = urllib.parse.urlsplit(self.path)
        if url.path == "/metrics":
            self.send(200, agg.metrics.render().encode(), CONTENT_TYPE)
        elif url.path in ("/healthz", "/readyz", "/livez"):  # edge.health: 503 with reasons
            check = health_check(agg, self.health, url.path)
            self.send(check.status(), check.body())
        elif url.path in ("/status", "/v1/status"):  # edge.status_page: for an operator
            if not self._within_rate():
                return
            data = status_page.status(agg, health_check(agg, self.health, "/readyz"))
            if url.path == "/status":
                self.send(200, status_page.render(data), "text/html; charset=utf-8")
            else:
                self._json(200, data)
        elif url.path == "/v1/results":
            self._results(url.query)
        elif url.path == "/v1/results/stream":
            self._stream(url.query)
        else:
            self._json(404, {"error": f"no route {url.path}"})

    def _within_rate(self) -> bool:
        """True, or a 429 was sent: this client asked too often."""
        if self.results_rate.allow(self.client_address[0]):
            return True
        self.metrics.refused.inc(reason="rate")
        # Closed after the refusal: a client pipelining requests gets one refusal, not one per
        # request it queued (tens of thousands of cheap answers hold the interpreter's lock).
        self._json(429, {"error": f"over {RESULTS_RATE:g} requests a second"},
                   {"Retry-After": "1", "Connection": "close"})
        return False

    def _results(self, query: str) -> None:
        if not self._within_rate():
            return
        try:
            q = results_query(query)
        except ValueError as e:
            self._json(400, {"error": str(e)})
            return
        if q.since is not None:
            self._json(200, self.agg.recent.since(q.since, q.limit).to_dict())
        else:
            self._json(200, self.agg.recent.after(q.after, q.limit))

    def _stream(self, query: str) -> None:
        """Server-Sent Events of the answers (:func:`ddnn.edge.results_feed.follow`)."""
        if not self._within_rate():
            return
        try:
            since = stream_start(query, self.headers.get("Last-Event-ID"), self.agg.recent)
        except ValueError as e:
            self._json(400, {"error": str(e)})
            return
        if not self.streams.take():
            self.metrics.refused.inc(reason="streams")
            self._json(503, {"error": "too many result streams; retry later"},
                       {"Retry-After": "5"})
            return
        try:
            self.close_connection = True  # the stream ends with the connection
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream; charset=utf-8")
            self.send_header("Cache-Control", "no-store")
            self.send_header("Connection", "close")
            self.server.waiting(self.connection)  # a stream waits on its reader, always
            self.end_headers()

            def write(data: bytes) -> None:
                self.server.waiting(self.connection)  # a reader that stops reading is cut off
                self.wfile.write(data)
                self.wfile.flush()

            follow(self.agg.recent, since, write, lambda: not self.server.closing.is_set())
        except OSError:
            pass  # the reader left, or was cut off
        finally:
            self.streams.give_back()

    def do_POST(self) -> None:
        if urllib.parse.urlsplit(self.path).path == "/v1/feedback":  # (the operator's token)
            self._feedback()
            return
        sender = self._sender()
        if sender is None:
            return
        body = self._body()
        if body is None or not self.begin():
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
            self.agg.events.on_dropped("oversized")
            self.close_connection = True  # the unread body makes the connection unusable
            self._json(413, {"error": f"body over {env.MAX_MESSAGE} bytes"})
            return None
        return self.rfile.read(length)

    def _feedback(self) -> None:
        """An operator's label (:mod:`ddnn.edge.feedback`)."""
        route = self.agg.feedback
        if route is None:
            self.close_connection = True
            self._json(404, {"error": "POST /v1/feedback is off: start the edge with "
                                      "--operator-token and --experience"})
            return
        if not self.begin():  # (busy from here: a label may wait for pulled features)
            return
        try:
            length: int | None = int(self.headers.get("Content-Length", "-1"))
        except ValueError:
            length = None
        reply = route.post(self.headers.get("Authorization", "").encode("utf-8", "replace"),
                           self.client_address[0], None if length is None or length < 0
                           else length, self.rfile.read, self.credentials)
        if reply.status in (401, 403, 429):
            self.metrics.refused.inc(reason={401: "unauthorized", 403: "forbidden",
                                             429: "rate"}[reply.status])
        self.close_connection = self.close_connection or reply.close
        self._json(reply.status, reply.body, reply.headers)

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
            speaks_for = None if sender == ANY_DEVICE else (sender,)
            result = check_device_result(body, self.agg.snapshot(), speaks_for,
                                         f"the token of {sender}")
        except Forbidden as e:
            self._forbid(str(e))
            return
        except ResultError as e:  # (also bad JSON, bad UTF-8, too deeply nested)
            self.agg.events.on_dropped("malformed")
            self._json(400, {"error": str(e)})
            return
        self.agg.publish_result(result)
        self._json(202, {"accepted": True})
