"""The tiers' shared keep-alive client against a real HTTP server."""

from __future__ import annotations

import http.server
import threading

import pytest

from ddnn.errors import ConfigError
from ddnn.plumbing.http import KeepAliveConnection


class ClosingServer(http.server.BaseHTTPRequestHandler):
    """Answers one request per connection, then closes it without saying so."""

    protocol_version = "HTTP/1.1"
    connections = 0

    def do_GET(self):  # the handler API's name
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")
        self.close_connection = True

    def setup(self):
        type(self).connections += 1
        super().setup()

    def log_message(self, *args):
        pass


def test_a_connection_the_peer_closed_is_reopened_once():
    # Back to back, the next request often goes out before the peer's close arrives (a
    # quarter of them failed before the client retried that case): many requests, no failure.
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), ClosingServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        conn = KeepAliveConnection(f"http://127.0.0.1:{server.server_port}", "test", 5.0)
        for _ in range(300):
            status, body, _ = conn.request("GET", "/", None, {})
            assert (status, body) == (200, b"ok")
        conn.close()
    finally:
        server.shutdown()
        server.server_close()
    assert ClosingServer.connections == 300


class Hangup(http.server.BaseHTTPRequestHandler):
    """Reads a request and closes the connection without an answer."""

    requests = 0

    def do_POST(self):  # the handler API's name
        type(self).requests += 1
        self.close_connection = True

    def log_message(self, *args):
        pass


def test_a_request_a_fresh_connection_lost_is_not_sent_twice():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hangup)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        conn = KeepAliveConnection(f"http://127.0.0.1:{server.server_port}", "test", 5.0)
        with pytest.raises(ConnectionError, match="closed connection without response"):
            conn.request("POST", "/", b"once", {"Content-Length": "4"})
    finally:
        server.shutdown()
        server.server_close()
    assert Hangup.requests == 1


@pytest.mark.parametrize(("url", "ca", "message"), [
    ("ftp://host", None, "test URL 'ftp://host' must be http"),
    ("http://", None, "must be http"),
    ("http://host:1", "ca.pem", "CA file is set but"),
    ("https://host:1", "/nonexistent/ca.pem", "cannot load the test CA file"),
])
def test_bad_configuration_is_a_config_error(url, ca, message):
    with pytest.raises(ConfigError, match=message):
        KeepAliveConnection(url, "test", 1.0, ca)


class HugeAnswer(http.server.BaseHTTPRequestHandler):
    """Answers with a body larger than the client accepts."""

    protocol_version = "HTTP/1.1"

    def do_GET(self):  # the handler API's name
        body = b"x" * 5000
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_an_answer_larger_than_the_bound_is_an_error():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), HugeAnswer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        conn = KeepAliveConnection(f"http://127.0.0.1:{server.server_port}", "test", 5.0,
                                   max_response=4096)
        with pytest.raises(OSError, match="answer over 4096 bytes"):
            conn.request("GET", "/", None, {})
        roomy = KeepAliveConnection(f"http://127.0.0.1:{server.server_port}", "test", 5.0)
        assert roomy.request("GET", "/", None, {})[1] == b"x" * 5000
        conn.close()
        roomy.close()
    finally:
        server.shutdown()
        server.server_close()
