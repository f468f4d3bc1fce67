"""The edge's HTTP side: ``/metrics``, health, recent results, and the devices' HTTP fallback.

``GET /metrics`` (Prometheus text), ``GET /healthz``, ``GET /v1/results?after=N`` (recent
results, for tools without MQTT), ``POST /v1/ingest`` (one message envelope, what a device
publishes over MQTT) and ``POST /v1/results`` (a one-view device's own local-exit result).
Standard library only: a threading server in a background thread.
"""

from __future__ import annotations

import hmac
import json
import logging
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from ddnn import envelope as env
from ddnn.edge.aggregator import EdgeAggregator
from ddnn.plumbing.metrics import CONTENT_TYPE
from ddnn.result import Result, ResultError

log = logging.getLogger(__name__)

IDLE_TIMEOUT = 30.0  # seconds a connection may sit idle or trickle before it is closed
# Drop reasons that mean the sender is wrong (400); the others are normal in a live system.
BAD_REQUEST = {"malformed", "shape", "oversized", "model", "deployment", "unknown_device"}


def check_device_result(body: bytes, agg: EdgeAggregator) -> Result:
    """A one-view device's posted result, checked (a ResultError says what is off).

    It is republished to every consumer of the results topic, so it must be exactly what the
    edge itself would publish: a result by the contract, of a known device, with a class of
    this bundle and its label, from the device's own (local) exit.
    """
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
    return result


class EdgeHttpServer:
    """Serves an :class:`EdgeAggregator` over HTTP on ``host:port`` (port 0: any free port)."""

    def __init__(self, aggregator: EdgeAggregator, host: str = "127.0.0.1", port: int = 0,
                 token: str | None = None):
        handler = _make_handler(aggregator, token)
        self.server = ThreadingHTTPServer((host, port), handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.host = host
        self._thread = threading.Thread(target=self.server.serve_forever, name="edge-http",
                                        daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> EdgeHttpServer:
        self._thread.start()
        log.info("edge HTTP on %s (/metrics, /healthz, /v1/ingest, /v1/results)", self.url)
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=5)


def _make_handler(agg: EdgeAggregator, token: str | None) -> type[EdgeHandler]:
    expected = f"Bearer {token}".encode() if token else None
    return type("Handler", (EdgeHandler,), {"agg": agg, "expected": expected})


class EdgeHandler(BaseHTTPRequestHandler):
    """The routes; :func:`_make_handler` binds the aggregator and the expected token."""

    agg: EdgeAggregator
    expected: bytes | None = None  # "Bearer TOKEN" required on POST routes, if set
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

    def _authorized(self) -> bool:
        if self.expected is None:
            return True
        given = self.headers.get("Authorization", "").encode("utf-8", "replace")
        if hmac.compare_digest(given, self.expected):  # constant time: no timing oracle
            return True
        why = "missing bearer token" if not given else "invalid bearer token"
        log.warning("refused POST %s from %s: %s", self.path[:100], self.client_address[0], why)
        self.close_connection = True  # the body stays unread: the connection is unusable
        self._json(401, {"error": why})
        return False

    def do_GET(self) -> None:
        agg = self.agg
        url = urllib.parse.urlsplit(self.path)
        if url.path == "/metrics":
            self._send(200, agg.metrics.render().encode(), CONTENT_TYPE)
        elif url.path == "/healthz":
            self._json(200, {"status": "ok", "results": agg.answered,
                             "pending_frames": len(agg.assembler),
                             "cloud_up": bool(agg.cloud and agg.cloud.up)})
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
        if not self._authorized():
            return
        body = self._body()
        if body is None:
            return
        path = urllib.parse.urlsplit(self.path).path
        if path == "/v1/ingest":
            self._ingest(body)
        elif path == "/v1/results":
            self._device_result(body)
        else:
            self._json(404, {"error": f"no route {path}"})

    def _body(self) -> bytes | None:
        """The request body, or None once a refusal was sent (no length, too long)."""
        try:
            length = int(self.headers.get("Content-Length", "-1"))
        except ValueError:
            length = -1
        if length < 0:
            self._json(411, {"error": "Content-Length required"})
            return None
        if length > env.MAX_MESSAGE:
            self.agg.metrics.dropped.inc(reason="oversized")
            self.close_connection = True  # the unread body makes the connection unusable
            self._json(413, {"error": f"body over {env.MAX_MESSAGE} bytes"})
            return None
        return self.rfile.read(length)

    def _ingest(self, body: bytes) -> None:
        reason = self.agg.ingest.accept(body)
        if reason in BAD_REQUEST:
            self._json(400, {"accepted": False, "reason": reason})
        else:  # taken, or valid but not wanted (late, duplicate): nothing to fix
            self._json(202, {"accepted": reason is None, "reason": reason})

    def _device_result(self, body: bytes) -> None:
        try:
            result = check_device_result(body, self.agg)
        except ResultError as e:  # (also bad JSON, bad UTF-8, too deeply nested)
            self.agg.metrics.dropped.inc(reason="malformed")
            self._json(400, {"error": str(e)})
            return
        self.agg.publish_result(result)
        self._json(202, {"accepted": True})
