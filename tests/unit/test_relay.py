"""The loopback relays the tests and the latency benchmark share (ddnn.tools.relay)."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from ddnn.tools.relay import DelayingRelay, TcpRelay


@pytest.fixture
def echo():
    """A loopback server that sends back whatever each connection sends it."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve(conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)

    def accept() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    yield server.getsockname()
    server.close()


def _round_trip(port: int, payload: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
        c.sendall(payload)
        got = b""
        while len(got) < len(payload):
            chunk = c.recv(65536)
            if not chunk:
                break
            got += chunk
        return got


def test_bytes_pass_unchanged_and_in_order(echo):
    relay = TcpRelay(echo)
    try:
        payload = bytes(range(256)) * 1024  # 256 KiB: several reads each way
        assert _round_trip(relay.port, payload) == payload
    finally:
        relay.cut()


def test_cut_closes_connections_and_refuses_new_ones_until_restored(echo):
    relay = TcpRelay(echo)
    conn = socket.create_connection(("127.0.0.1", relay.port), timeout=10)
    assert _round_trip(relay.port, b"before") == b"before"
    relay.cut()
    conn.settimeout(10)
    assert conn.recv(10) == b""  # the open connection was closed
    conn.close()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", relay.port), timeout=2)
    relay.restore()
    try:
        assert _round_trip(relay.port, b"after") == b"after"
    finally:
        relay.cut()


def test_the_delay_holds_every_answer_back_and_can_change(echo):
    relay = DelayingRelay(echo, delay=0.4)
    try:
        start = time.monotonic()
        assert _round_trip(relay.port, b"slow") == b"slow"
        # Half the delay each way: the answer cannot come sooner than the whole delay.
        assert time.monotonic() - start >= 0.4
        relay.delay = 0.0
        assert _round_trip(relay.port, b"fast") == b"fast"
        assert relay.http_url == f"http://127.0.0.1:{relay.port}"
    finally:
        relay.stop()
