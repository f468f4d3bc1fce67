"""Connection guards under the HTTP parser: bounded request heads, bounded read times.

uvicorn bounds neither the request line and headers nor the time a client takes to send them
when it parses with httptools (its ``h11_max_incomplete_event_size`` applies to h11 only): one
GET with a 100 MB header costs the event loop seconds of CPU before any route or token check
runs, and a client sending a header byte every few seconds holds its connection open forever.
:func:`guarded_protocol` makes a subclass of uvicorn's httptools protocol that

* counts the bytes of each request's head (request line and headers) as they arrive and stops
  feeding the parser at ``max_head`` bytes: ``431`` and the connection is closed;
* gives a client ``header_timeout`` seconds from its first byte (or from connecting) to the end
  of the headers — else ``408`` and close — and ``body_timeout`` seconds from there to the end
  of the body, else the connection is closed (the route sees a disconnected client).

On ddnn's lean route (:data:`ddnn.oip.LEAN_ROUTE`) the answer goes without uvicorn's ``date``
header: a client that opted in to the lean form reads its length alone.

It also hands the routes what TLS says of the client, as the ASGI TLS extension
(``scope["extensions"]["tls"]``, its ``client_cert_name`` in RFC 4514 form): whose client
certificate this connection presented, for :mod:`ddnn.cloud.access`'s role checks.

Idle keep-alive connections are closed by uvicorn's own ``timeout_keep_alive``. The parser stays
httptools, the fast one (docs/cloud.md has the measurement); without httptools installed the
server falls back to h11 with ``h11_max_incomplete_event_size`` (the head bound only).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from dataclasses import dataclass

from ddnn.oip import JSON_TYPE, LEAN_ROUTE, error_body

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConnectionLimits:
    """What one client connection may take from the server."""

    max_head: int = 64 << 10  # bytes of request line + headers
    header_timeout: float = 10.0  # seconds from the first byte (or the connection) to the headers
    body_timeout: float = 60.0  # seconds from the end of the headers to the end of the body


class _RateLimitedLog:
    """One warning per ``period`` at most: hostile clients must not flood the log either."""

    def __init__(self, period: float = 10.0):
        self.period = period
        self._last = -period
        self._suppressed = 0

    def warning(self, message: str, *args) -> None:
        now = time.monotonic()
        if now - self._last < self.period:
            self._suppressed += 1
            return
        more = f" ({self._suppressed} more since the last such line)" if self._suppressed else ""
        self._last, self._suppressed = now, 0
        log.warning(message + more, *args)


_refusals = _RateLimitedLog()


def _response(status: int, phrase: str, message: str) -> bytes:
    body = error_body(message)
    return (f"HTTP/1.1 {status} {phrase}\r\ncontent-type: {JSON_TYPE}\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode() + body


_SHORT = {"commonName": "CN", "organizationalUnitName": "OU", "organizationName": "O",
          "countryName": "C", "localityName": "L", "stateOrProvinceName": "ST"}


def _escape(value: str) -> str:
    out = "".join("\\" + ch if ch in ',+"\\<>;=' else ch for ch in value)
    return "\\" + out if out[:1] in ("#", " ") else out


def rfc4514(subject) -> str:
    """The RFC 4514 string of a subject as :meth:`ssl.SSLSocket.getpeercert` gives it."""
    return ",".join("+".join(f"{_SHORT.get(k, k)}={_escape(v)}" for k, v in rdn)
                    for rdn in reversed(subject))


def tls_extension(transport) -> dict | None:
    """The ASGI TLS extension of a connection (None over plain TCP): the client certificate,
    if it presented one that was verified, and its subject."""
    tls: ssl.SSLObject | None = transport.get_extra_info("ssl_object")
    if tls is None:
        return None
    cert = tls.getpeercert()  # verified (the server asked for it), else None or {}
    der = tls.getpeercert(binary_form=True) if cert else None
    return {"server_cert": None, "client_cert_chain": [ssl.DER_cert_to_PEM_cert(der)] if der
            else [], "client_cert_name": rfc4514(cert["subject"]) if cert else None,
            "client_cert_error": None, "tls_version": None, "cipher_suite": None}


def _lean(scope) -> bool:
    """Whether a request is for ddnn's lean route (:data:`ddnn.oip.LEAN_ROUTE`)."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root):].startswith(LEAN_ROUTE + "/") if path.startswith(root) else False


def httptools_available() -> bool:
    try:
        import httptools  # noqa: F401
    except ImportError:
        return False
    return True


class _Guard:
    """The guard, mixed in before uvicorn's ``HttpToolsProtocol`` by :func:`guarded_protocol`."""

    limits: ConnectionLimits

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._in_head = True  # waiting for the end of a request's headers
        self._head_bytes = 0
        self._timer: asyncio.TimerHandle | None = None
        self._tls: dict | None = None  # the connection's ASGI TLS extension

    # --- timers ---------------------------------------------------------------------------

    def _arm(self, seconds: float, callback) -> None:
        self._disarm()
        self._timer = self.loop.call_later(seconds, callback)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _peer(self) -> str:
        return self.client[0] if self.client else "?"

    def _refuse(self, status: int, phrase: str, message: str) -> None:
        """Answer ``status`` unless a response is under way, then close the connection."""
        self._disarm()
        if self.transport.is_closing():
            return
        _refusals.warning("refused a request from %s: %s", self._peer(), message)
        if self.cycle is None or self.cycle.response_complete:
            self.transport.write(_response(status, phrase, message))
        self.transport.close()

    def _head_timed_out(self) -> None:
        self._timer = None
        self._refuse(408, "Request Timeout",
                     f"the request line and headers did not arrive within "
                     f"{self.limits.header_timeout:g} s")

    def _body_timed_out(self) -> None:
        self._timer = None
        if not self.transport.is_closing():
            _refusals.warning("closed the connection of %s: the request body did not "
                              "arrive within %g s", self._peer(), self.limits.body_timeout)
            self.transport.close()

    # --- asyncio.Protocol -----------------------------------------------------------------

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._tls = tls_extension(transport)  # the handshake is over when this is called
        self._arm(self.limits.header_timeout, self._head_timed_out)  # a silent client too

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._in_head:
            room = self.limits.max_head - self._head_bytes
            if len(data) > room:
                # Feed the parser no more than the bound: it may end the head in time.
                head, rest = data[:max(room, 0)], data[max(room, 0):]
                self._head_bytes += len(head)
                if head:
                    super().data_received(head)
                if self.transport.is_closing():
                    return
                if self._in_head:
                    self._refuse(431, "Request Header Fields Too Large",
                                 f"the request line and headers exceed {self.limits.max_head} "
                                 "bytes")
                    return
                if rest:
                    self.data_received(rest)
                return
            self._head_bytes += len(data)
        super().data_received(data)

    # --- parser callbacks -----------------------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._tls is not None:
            self.scope["extensions"] = {**self.scope.get("extensions", {}), "tls": self._tls}
        if self._timer is None:  # the first byte of a request after a keep-alive pause
            self._arm(self.limits.header_timeout, self._head_timed_out)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._arm(self.limits.body_timeout, self._body_timed_out)
        super().on_headers_complete()
        cycle = self.cycle  # the request's, unless the parser answered or upgraded it
        if cycle is not None and cycle.scope is self.scope and _lean(self.scope):
            # The lean route answers with its length alone: every byte crosses the edge's WAN
            # link, and a client that opted in reads no date (the v2 routes keep theirs).
            cycle.default_headers = [h for h in cycle.default_headers if h[0] != b"date"]

    def on_message_complete(self) -> None:
        self._disarm()
        self._in_head, self._head_bytes = True, 0
        super().on_message_complete()


def guarded_protocol(limits: ConnectionLimits) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol with ``limits`` enforced (pass it as ``Config(http=...)``)."""
    # Imported here: uvicorn's httptools module needs httptools, which is optional.
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    return type("GuardedHttpToolsProtocol", (_Guard, HttpToolsProtocol), {"limits": limits})
