"""Clients that hold a tier's HTTP server instead of using it, against the real servers on
loopback ports (issue 25 items 6, 7, 16):

* clients that pipeline GETs and never read their responses cannot take the edge's connection
  slots: ``/livez`` still answers (a connection blocked writing to a client that does not read
  waits on that client, and makes room for a new one);
* ``GET /v1/results`` costs a bounded page, validates its cursor and is rate-limited per client;
* a slowloris client cannot hold a device's monitoring server: a connection waiting on its
  client makes room for a new one and is closed after ``wait_timeout`` seconds.
"""

from __future__ import annotations

import contextlib
import re
import socket

import httpx
import pytest

from ddnn.edge.results_feed import RESULTS_PAGE
from ddnn.edge.service import EdgeService
from ddnn.edge.settings import EdgeSettings
from ddnn.result import Result
from tests.support.polling import wait_for

RCVBUF = 4096  # the attackers' receive buffer: their kernel takes little of a response


@contextlib.contextmanager
def edge(bundle, results: int = 0):
    """An edge serving HTTP on a free port, its ring of recent results filled with
    ``results`` results of six views each (frames 0, 1, ...)."""
    service = EdgeService.from_settings(EdgeSettings(bundle=bundle, http_port=0))
    with service:
        views = tuple(f"cam{i}" for i in range(6))
        for frame in range(results):
            service.aggregator.recent.publish(Result(
                frame=frame, cls=frame % 3, label="car", exit="cloud", entropy=0.25,
                views=views[:5], missing={"cam5": "late"}, latency_ms=12.5))
        yield service


def pipelining_clients(port: int, n: int, path: str, requests: int) -> list[socket.socket]:
    """``n`` connections, each sending ``requests`` GETs of ``path`` at once and reading
    nothing."""
    out = []
    for _ in range(n):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF)
        s.settimeout(10)
        s.connect(("127.0.0.1", port))
        s.setblocking(False)  # the server stops reading once its writes block: send what fits
        with contextlib.suppress(BlockingIOError):
            s.send(f"GET {path} HTTP/1.1\r\nHost: edge\r\n\r\n".encode() * requests)
        out.append(s)
    return out


# --- item 6: pipelined GETs that are never read -----------------------------------------------

@pytest.mark.parametrize("path,results", [
    ("/metrics", 0),  # the reported case: did not reproduce (the text fits the buffers)
    ("/v1/results?after=-1", 1000),  # larger answers: the writes block, every slot was held
])
def test_livez_answers_while_clients_pipeline_gets_and_never_read(tiny_bundle, path, results):
    with edge(tiny_bundle, results) as service:
        http = service.http
        http.server.wait_timeout = 600  # what is tested here is making room, not the deadline
        clients = pipelining_clients(http.port, 80, path, 400)
        try:
            # Every slot is taken by a client that does not read; the routes are done (the
            # server waits on the clients: to write, or for another request).
            wait_for(lambda: http.server.open_connections == 64, what="64 connections open")
            wait_for(lambda: http.server.busy_connections == 0, 60, "no route under way")
            busy, evicted = http.metrics.refused.value(reason="busy"), http.metrics.evicted.value()
            for _ in range(3):
                r = httpx.get(f"{http.url}/livez", timeout=5)
                assert r.status_code == 200, r.text
            assert http.metrics.refused.value(reason="busy") == busy
            # The first probe made its own room; the next ones may take the slot the one before
            # freed when it closed (on an idle machine its thread is gone by then).
            assert http.metrics.evicted.value() >= evicted + 1
        finally:
            for s in clients:
                s.close()


def test_livez_answers_at_once_in_every_round_of_clients_that_pipeline_and_never_read(
        tiny_bundle):
    # Issue 40 (round 3): probed as the 80 connections arrive, not once they settle, /livez
    # timed out in some runs (each non-reading connection let the kernel take hundreds of
    # answers before its write blocked; each 429 answered every pipelined request). 5 s is the
    # spec's bound, not a timing measurement: `ddnn bench --only livez_under_load` reports it.
    from ddnn.plumbing.http_server import SEND_BUFFER

    with edge(tiny_bundle, results=1000) as service:
        http = service.http
        for _ in range(3):
            clients = pipelining_clients(http.port, 80, "/v1/results?after=-1", 400)
            try:
                for _ in range(3):
                    r = httpx.get(f"{http.url}/livez", timeout=5)
                    assert r.status_code == 200, r.text
            finally:
                for s in clients:
                    s.close()
        # What bounds the answers computed ahead of a client: the fixed send buffer.
        with socket.create_connection(("127.0.0.1", http.port), timeout=5) as s:
            s.sendall(b"GET /livez HTTP/1.1\r\nHost: edge\r\n\r\n")
            assert s.recv(4096).startswith(b"HTTP/1.1 200")
            def peer(c: socket.socket) -> int | None:
                with contextlib.suppress(OSError):  # (an attacker's, shut down meanwhile)
                    return c.getpeername()[1]
                return None

            served = [c for c in list(http.server._open) if peer(c) == s.getsockname()[1]]
            assert len(served) == 1
            # (Linux doubles what is asked, for its bookkeeping; autotuning would be MiBs)
            assert served[0].getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) <= 2 * SEND_BUFFER


def test_a_client_over_its_rate_gets_one_refusal_and_its_connection_closed(tiny_bundle):
    # A 429 closes the connection: 400 pipelined requests past the rate cost one refusal, not
    # 400 cheap answers (together tens of thousands of them held the interpreter's lock).
    with edge(tiny_bundle, results=10) as service:
        with socket.create_connection(("127.0.0.1", service.http.port), timeout=10) as s:
            s.sendall(b"GET /v1/results?after=-1 HTTP/1.1\r\nHost: edge\r\n\r\n" * 400)
            answers = b""
            while chunk := s.recv(65536):  # until the server closes
                answers += chunk
        statuses = [int(code) for code in re.findall(rb"HTTP/1\.1 (\d{3}) ", answers)]
        assert statuses[-1] == 429 and statuses.count(429) == 1, statuses[-5:]
        assert 0 < statuses.count(200) < 400 and b"Connection: close" in answers
        assert service.http.metrics.refused.value(reason="rate") == 1


# --- item 7: GET /v1/results?after=-1 in a loop ------------------------------------------------

def test_results_come_in_bounded_pages_with_a_validated_cursor(tiny_bundle):
    with edge(tiny_bundle, results=1000) as service:
        url = f"{service.http.url}/v1/results"
        with httpx.Client(timeout=5) as client:
            first = client.get(url, params={"after": -1}).json()
            assert [r["frame"] for r in first] == list(range(RESULTS_PAGE))
            page = client.get(url, params={"after": first[-1]["frame"], "limit": 10}).json()
            assert [r["frame"] for r in page] == list(range(RESULTS_PAGE, RESULTS_PAGE + 10))
            assert client.get(url, params={"after": 998}).json()[0]["frame"] == 999
            for bad in ({"after": -2}, {"after": 2**63}, {"after": "1" * 5000},
                        {"after": "x"}, {"limit": 0}, {"limit": RESULTS_PAGE + 1}):
                r = client.get(url, params=bad)
                assert r.status_code == 400, (bad, r.text)


def test_a_client_polling_results_in_a_loop_is_rate_limited(tiny_bundle):
    with edge(tiny_bundle, results=1000) as service:
        url, metrics = f"{service.http.url}/v1/results", service.http.metrics
        with httpx.Client(timeout=5) as client:
            # The refusals are read from the loop's own answers: a request sent after it may
            # find a token refilled (50 a second) on a busy machine.
            answers = [client.get(url, params={"after": -1}) for _ in range(300)]
            statuses = [r.status_code for r in answers]
            assert statuses[0] == 200 and 429 in statuses
            refused = [r for r in answers if r.status_code == 429]
            assert all(r.headers["Retry-After"] == "1" for r in refused)
            # Other routes are not limited; the limit is per client address.
            assert client.get(f"{service.http.url}/livez").status_code == 200
        assert metrics.refused.value(reason="rate") == len(refused)


def test_a_client_polling_the_status_page_in_a_loop_is_rate_limited(tiny_bundle):
    # /status costs 10-50 ms a request (round 3): limited like /v1/results, per address.
    with edge(tiny_bundle, results=20) as service, httpx.Client(timeout=5) as client:
        statuses = [client.get(f"{service.http.url}/v1/status").status_code
                    for _ in range(300)]
        assert statuses[0] == 200 and 429 in statuses
        assert client.get(f"{service.http.url}/livez").status_code == 200


def test_result_streams_are_capped_and_a_stream_that_is_not_read_holds_no_slot(tiny_bundle):
    from ddnn.edge.results_feed import MAX_STREAMS

    with edge(tiny_bundle, results=1000) as service:
        http = service.http
        http.server.wait_timeout = 600  # the cap is tested here, not the cut-off
        path = "/v1/results/stream?since=-1"  # 1000 answers at once: their writes block
        clients = pipelining_clients(http.port, MAX_STREAMS, path, 1)
        try:
            def one_more() -> int:
                with httpx.stream("GET", f"{http.url}{path}", timeout=5) as r:
                    return r.status_code

            wait_for(lambda: one_more() == 503, 30, "a stream past the cap refused")
            assert http.metrics.refused.value(reason="streams") >= 1
            # Every stream waits on its reader: none is busy, so a probe always gets a slot.
            assert http.server.busy_connections == 0
            assert httpx.get(f"{http.url}/livez", timeout=5).status_code == 200
        finally:
            for s in clients:
                s.close()


# --- item 16: slowloris on a device's monitoring server ----------------------------------------

@pytest.fixture
def device_http(mosquitto, tiny_bundle, tiny_data):
    from ddnn.device.service import DeviceService
    from ddnn.device.settings import DeviceSettings

    with DeviceService.from_settings(DeviceSettings(
            bundle=tiny_bundle, view=0, broker=mosquitto.url, deployment="slow",
            data=tiny_data.test, limit=1, http_port=0)) as device:
        yield device.http


def test_a_slowloris_cannot_hold_a_devices_health_server(device_http):
    from ddnn.plumbing.health import MAX_CONNECTIONS

    server = device_http.server
    server.wait_timeout = 1.0  # (10 s in service: the test need not wait that long)
    trickling = []
    try:
        for _ in range(MAX_CONNECTIONS + 8):  # a head a byte at a time, on every slot and more
            s = socket.create_connection(("127.0.0.1", device_http.port), timeout=10)
            trickling.append(s)
            with contextlib.suppress(OSError):  # (before: the ones past the cap were closed)
                s.sendall(b"GET /livez HTTP/1.1\r\nX-")
        for _ in range(3):
            r = httpx.get(f"{device_http.url}/livez", timeout=5)
            assert r.status_code == 200, r.text

        def all_cut_off() -> bool:
            for s in trickling:
                with contextlib.suppress(OSError):
                    s.sendall(b"a")  # still trickling: a reset or a closed pipe means cut off
            return server.open_connections == 0

        wait_for(all_cut_off, what="every trickling connection closed after wait_timeout")
    finally:
        for s in trickling:
            s.close()
