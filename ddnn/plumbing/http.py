"""One keep-alive HTTP(S) connection to a service: the client side the tiers share.

The edge's cloud client, the edge's results callback and the device's HTTP fallback each talk
to one peer, request after request, from one thread at a time. This holds that connection: the
URL checked once, TLS with the system's or a private CA (chain and host name always verified),
a fresh connection after any failure, and one retry when the peer had closed the idle one.
"""

from __future__ import annotations

import http.client
import ssl
import urllib.parse

from ddnn.errors import ConfigError

# What a peer's close of an idle keep-alive connection looks like on the next request.
_STALE = (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError)


class KeepAliveConnection:
    """Requests to the host of ``url``; errors are ``OSError`` or ``http.client.HTTPException``."""

    def __init__(self, url: str, what: str, timeout: float, ca_file: str | None = None):
        u = urllib.parse.urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ConfigError(f"{what} URL {url!r} must be http(s)://host[:port]")
        self.url, self.timeout = url, timeout
        self.host, self.port, self.netloc = u.hostname, u.port, u.netloc
        self.scheme, self.path, self.query = u.scheme, u.path, u.query
        self._tls: ssl.SSLContext | None = None
        if u.scheme == "https":
            try:
                self._tls = ssl.create_default_context(cafile=ca_file)
            except (OSError, ssl.SSLError) as e:
                raise ConfigError(f"cannot load the {what} CA file {ca_file}: {e}") from None
        elif ca_file:
            raise ConfigError(f"a {what} CA file is set but {url!r} is not https://")
        self._conn: http.client.HTTPConnection | None = None

    def request(self, method: str, path: str, body: bytes | None, headers: dict[str, str]
                ) -> tuple[int, bytes, dict[str, str]]:
        """``(status, body, headers)`` of one request."""
        for attempt in (0, 1):
            if self._conn is None:
                if self._tls is not None:
                    self._conn = http.client.HTTPSConnection(
                        self.host, self.port, timeout=self.timeout, context=self._tls)
                else:
                    self._conn = http.client.HTTPConnection(self.host, self.port,
                                                            timeout=self.timeout)
            try:
                self._conn.request(method, path, body, headers)
                resp = self._conn.getresponse()
                return resp.status, resp.read(), dict(resp.getheaders())
            except (OSError, http.client.HTTPException) as e:
                self.close()
                if attempt or not isinstance(e, _STALE):
                    raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        """Drop the connection; the next request opens a fresh one."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None
