"""Health that can fail, with reasons, and a small HTTP server to expose it.

A tier answers three questions over HTTP, the way Kubernetes and load balancers ask them:

* ``/livez`` — is the process alive (its threads running)? 503 means "restart me".
* ``/readyz`` (also ``/healthz``) — can it do its work now? 503 lists why not (the broker
  unreachable for longer than a grace period, work stalled, nobody to serve), for an operator
  or a probe; it recovers by itself when the cause goes away.
* ``/metrics`` — the Prometheus text of the tier's :class:`~ddnn.plumbing.metrics.Registry`.

Both health answers are JSON: ``{"status": "ok"|"unhealthy", "reasons": [...], ...details}``.
Standard library only.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

from ddnn.errors import ConfigError

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 16  # of the monitoring server: Prometheus, a supervisor, an operator


@dataclass(frozen=True, kw_only=True)
class MonitorHttp:
    """Where a tier's own HTTP server listens (``--http-host``, ``--http-port``): /metrics,
    /healthz, /livez. No port, no server; port 0: any free one."""

    host: str = "127.0.0.1"  # loopback by default: exposing a tier is a deliberate choice
    port: int | None = None

    def __post_init__(self) -> None:
        if self.port is not None and not 0 <= self.port <= 65535:
            raise ConfigError(f"http_port must be in 0..65535, got {self.port}")


@dataclass
class Check:
    """The outcome of a health check: healthy when nothing is wrong."""

    reasons: list[str] = field(default_factory=list)  # what is wrong, one sentence each
    details: dict = field(default_factory=dict)  # numbers worth showing either way

    @property
    def ok(self) -> bool:
        return not self.reasons

    def status(self) -> int:
        return 200 if self.ok else 503

    def body(self) -> bytes:
        return json.dumps({"status": "ok" if self.ok else "unhealthy",
                           "reasons": self.reasons, **self.details}).encode()


Route = Callable[[], tuple[int, str, bytes]]  # () -> (status, content type, body)


def check_route(check: Callable[[], Check]) -> Route:
    """A route answering a :class:`Check` as JSON (200 or 503)."""
    def route() -> tuple[int, str, bytes]:
        c = check()
        return c.status(), "application/json", c.body()
    return route


class _CappedServer(ThreadingHTTPServer):
    """A thread per connection, at most ``max_connections`` at once: past that a new connection
    is closed unanswered (scrapers and probes retry; a flood cannot pile up threads)."""

    max_connections = MAX_CONNECTIONS

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._slots = threading.BoundedSemaphore(self.max_connections)

    def process_request(self, request, client_address):
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class MonitorServer:
    """GET-only HTTP server of a few routes (path -> :data:`Route`) in a background thread."""

    def __init__(self, routes: dict[str, Route], host: str = "127.0.0.1", port: int = 0,
                 name: str = "monitor"):
        handler = type("Handler", (_Handler,), {"routes": dict(routes)})
        self.server = _CappedServer((host, port), handler)
        self.server.daemon_threads = True
        self.host, self.port = host, self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, name=f"{name}-http",
                                        daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def alive(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> MonitorServer:
        self._thread.start()
        log.info("HTTP on %s (%s)", self.url, ", ".join(self.server.RequestHandlerClass.routes))
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=5)


class _Handler(BaseHTTPRequestHandler):
    routes: ClassVar[dict[str, Route]] = {}
    protocol_version = "HTTP/1.1"
    timeout = 30.0  # an idle or trickling client frees its thread

    def log_message(self, format, *args):
        log.debug("%s " + format, self.address_string(), *args)

    def do_GET(self) -> None:
        route = self.routes.get(self.path.split("?", 1)[0])
        if route is None:
            status, ctype, body = 404, "application/json", b'{"error": "no such route"}'
        else:
            try:
                status, ctype, body = route()
            except Exception:  # a failing check is itself unhealthy, never a dead server
                log.exception("health route %s failed", self.path)
                status, ctype, body = 500, "application/json", b'{"error": "check failed"}'
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
