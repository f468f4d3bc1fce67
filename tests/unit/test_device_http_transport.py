"""The device's HTTP fallback against a real HTTP server: which answers keep a message for a
retry (the edge could not take it now) and which drop it (the edge refused the message)."""

from __future__ import annotations

import http.server
import threading
from typing import ClassVar

import pytest

from ddnn.device.message import OutMessage
from ddnn.device.transport import HttpTransport


class Edge(http.server.BaseHTTPRequestHandler):
    """Answers each POST with the next status of ``statuses`` and records what it got."""

    statuses: ClassVar[list[int]] = []
    received: ClassVar[list[bytes]] = []

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        status = self.statuses.pop(0)
        if status == 204:
            self.received.append(body)
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def edge():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Edge)
    Edge.statuses, Edge.received = [], []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("status", [401, 429, 503])
def test_a_temporary_refusal_keeps_the_message_for_a_retry(edge, status):
    Edge.statuses = [status, 204]
    t = HttpTransport(f"http://127.0.0.1:{edge.server_port}")
    msg = OutMessage("scores", b"frame-7", 7)
    assert t.send(msg) is False and not t.can_send()  # kept; backing off
    t._backoff.retry_at = 0.0  # the backoff has run
    assert t.send(msg) is True
    assert Edge.received == [b"frame-7"] and t.refused == 0


def test_a_refused_message_is_counted_and_not_resent(edge):
    Edge.statuses = [400, 204]
    t = HttpTransport(f"http://127.0.0.1:{edge.server_port}")
    assert t.send(OutMessage("scores", b"bad", 1)) is True  # done with: resending cannot help
    assert t.refused == 1 and t.can_send()
    assert t.send(OutMessage("scores", b"good", 2)) is True
    assert Edge.received == [b"good"]


def test_an_unreachable_edge_keeps_the_message(edge):
    port = edge.server_port
    edge.shutdown()
    edge.server_close()
    t = HttpTransport(f"http://127.0.0.1:{port}", timeout=1.0)
    assert t.send(OutMessage("scores", b"x", 1)) is False and not t.connected
