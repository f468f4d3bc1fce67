"""One keep-alive HTTP(S) connection to a service: the client side the tiers share.

The edge's cloud client, the edge's results callback and the device's HTTP fallback each talk
to one peer, request after request, from one thread at a time. This wraps a one-connection
``urllib3`` pool: the URL checked once, TLS with the system's or a private CA (chain and host
name always verified) and, for peers that require one, a client certificate (mutual TLS), a
fresh connection when the peer closed the idle one, no redirects (a credential never follows
one to another host). Failures surface as ``OSError``.
"""

from __future__ import annotations

import http.client
import ssl
import urllib.parse

import urllib3

from ddnn.errors import ConfigError

# One retry to connect; never after a request went out (a POST must not run twice, and a read
# timeout must mean one timeout). urllib3 replaces a kept-alive connection the peer closed
# before reusing it, when it can tell; the race it cannot tell (the peer closes while our
# request is on its way) is handled in ``request``. Statuses and redirects are the caller's.
_RETRY = urllib3.Retry(total=1, connect=1, read=0, status=0, other=0, redirect=False,
                       raise_on_redirect=False, raise_on_status=False)


MAX_RESPONSE = 16 << 20  # bytes of an answer; a larger one is an error (cloud scores are small)


class KeepAliveConnection:
    """Requests to the host of ``url``; every failure to get an answer is an ``OSError``."""

    def __init__(self, url: str, what: str, timeout: float, ca_file: str | None = None, *,
                 cert_file: str | None = None, key_file: str | None = None,
                 max_response: int = MAX_RESPONSE):
        u = urllib.parse.urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ConfigError(f"{what} URL {url!r} must be http(s)://host[:port]")
        self.url, self.timeout, self.max_response = url, timeout, max_response
        self.host, self.port, self.netloc = u.hostname, u.port, u.netloc
        self.scheme, self.path, self.query = u.scheme, u.path, u.query
        timeouts = urllib3.Timeout(connect=timeout, read=timeout)
        pool_args = dict(host=self.host, port=self.port, maxsize=1, block=False,
                         timeout=timeouts, retries=_RETRY)
        if u.scheme == "https":
            try:
                tls = ssl.create_default_context(cafile=ca_file)
            except (OSError, ssl.SSLError) as e:
                raise ConfigError(f"cannot load the {what} CA file {ca_file}: {e}") from None
            if cert_file:  # a client certificate, for a peer that requires one (mutual TLS)
                try:
                    tls.load_cert_chain(cert_file, key_file)
                except (OSError, ssl.SSLError) as e:
                    which = ", ".join(f for f in (cert_file, key_file) if f)
                    raise ConfigError(f"cannot load the {what} client certificate ({which}): "
                                      f"{e}") from None
            elif key_file:
                raise ConfigError(f"a {what} key file needs its certificate file")
            self._new_pool = lambda: urllib3.HTTPSConnectionPool(**pool_args, ssl_context=tls)
        else:
            if ca_file:
                raise ConfigError(f"a {what} CA file is set but {url!r} is not https://")
            if cert_file or key_file:
                raise ConfigError(f"a {what} client certificate is set but {url!r} is not "
                                  "https://")
            self._new_pool = lambda: urllib3.HTTPConnectionPool(**pool_args)
        self._pool: urllib3.HTTPConnectionPool = self._new_pool()
        self._kept_alive = False  # the pool holds a connection that answered before

    def request(self, method: str, path: str, body: bytes | None, headers: dict[str, str]
                ) -> tuple[int, bytes, dict[str, str]]:
        """``(status, body, headers)`` of one request."""
        try:
            return self._request(method, path, body, headers)
        except _ClosedWhileIdle:
            # The peer closed the kept-alive connection as our request went out, before any
            # answer: it never handled it (an idle timeout, a restart). Once, on a fresh one.
            return self._request(method, path, body, headers)

    def _request(self, method, path, body, headers):
        reused, self._kept_alive = self._kept_alive, False
        try:
            resp = self._pool.urlopen(method, path, body=body, headers=headers,
                                      redirect=False, preload_content=False)
            data = resp.read(self.max_response + 1)  # a peer may not fill our memory
        except urllib3.exceptions.HTTPError as e:  # refused, reset, timed out, TLS failed
            self.close()
            if reused and _closed_before_answer(e):
                raise _ClosedWhileIdle from None
            raise ConnectionError(f"{self.netloc}: {_reason(e)}") from None
        if len(data) > self.max_response:
            self.close()  # the rest of the body is unread: the connection is unusable
            raise ConnectionError(f"{self.netloc}: answer over {self.max_response} bytes")
        resp.release_conn()
        self._kept_alive = (resp.version == 11
                            and "close" not in resp.headers.get("Connection", "").lower())
        return resp.status, data, dict(resp.headers)

    def close(self) -> None:
        """Drop the connection; the next request opens a fresh one."""
        self._pool.close()
        self._pool = self._new_pool()  # (a closed pool refuses requests; a new one is cheap)
        self._kept_alive = False


class _ClosedWhileIdle(Exception):
    """A reused connection was closed by the peer before it answered."""


def _closed_before_answer(e: Exception) -> bool:
    # urllib3 wraps it: ProtocolError("Connection aborted.", RemoteDisconnected | reset | pipe).
    cause = e.reason if isinstance(e, urllib3.exceptions.MaxRetryError) else e
    if not isinstance(cause, urllib3.exceptions.ProtocolError):
        return False
    inner = cause.args[1] if len(cause.args) > 1 else None
    return isinstance(inner, http.client.RemoteDisconnected | ConnectionResetError
                      | BrokenPipeError)


def _reason(e: Exception) -> str:
    # MaxRetryError wraps the error that ended the last attempt.
    return str(getattr(e, "reason", None) or e)
