"""The results HTTP callback against a real HTTP receiver: every result once and in order, kept
while the receiver is down, and a refusal counted rather than retried forever."""

from __future__ import annotations

import http.server
import json
import threading

import pytest

from ddnn.edge.callback import ResultsCallback
from ddnn.plumbing.metrics import Registry
from ddnn.plumbing.retry import RetryPolicy
from ddnn.tools.broker import free_port
from tests.support.hierarchy import Edge, run_devices
from tests.support.polling import wait_for


class Receiver:
    """An HTTP server on a fixed loopback port that answers POSTs with ``status``."""

    def __init__(self, port: int, status: int = 204):
        received, self.status = [], status
        self.received: list[dict] = received
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):  # the handler API's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                assert self.headers["Authorization"] == "Bearer s3cret"
                if receiver.status < 300:
                    received.append(json.loads(body))
                self.send_response(receiver.status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def outcomes():
    return Registry().counter("callback_total", "test", ("outcome",))


def test_every_result_once_in_order_across_a_receiver_outage(outcomes):
    port = free_port()
    cb = ResultsCallback(f"http://127.0.0.1:{port}/hook", outcomes, token="s3cret",
                         retry=RetryPolicy(initial=0.25, maximum=0.25)).start()
    try:
        for i in range(10):  # nobody listens yet: they wait
            cb.post(json.dumps({"frame": i}).encode())
        wait_for(lambda: outcomes.value(outcome="retry") >= 2)
        receiver = Receiver(port)
        for i in range(10, 20):
            cb.post(json.dumps({"frame": i}).encode())
        wait_for(lambda: len(receiver.received) == 20)
    finally:
        cb.stop()
    receiver.stop()
    assert [r["frame"] for r in receiver.received] == list(range(20))
    assert outcomes.value(outcome="sent") == 20


def test_a_refused_result_is_counted_and_not_resent(outcomes):
    port = free_port()
    receiver = Receiver(port, status=422)
    cb = ResultsCallback(f"http://127.0.0.1:{port}/", outcomes, token="s3cret").start()
    try:
        cb.post(b'{"frame": 1}')
        wait_for(lambda: outcomes.value(outcome="refused") == 1)
        receiver.status = 204
        cb.post(b'{"frame": 2}')
        wait_for(lambda: len(receiver.received) == 1)
    finally:
        cb.stop()
        receiver.stop()
    assert receiver.received == [{"frame": 2}]


def test_a_full_queue_drops_the_oldest_counted(outcomes):
    port = free_port()  # nobody listens: everything waits in the queue
    cb = ResultsCallback(f"http://127.0.0.1:{port}/", outcomes, capacity=3)
    for i in range(5):
        cb.post(json.dumps({"frame": i}).encode())
    assert cb.pending() == 3 and outcomes.value(outcome="overflow") == 2
    cb.start()
    cb.stop(timeout=5)
    assert outcomes.value(outcome="unsent_at_stop") >= 1


def test_the_edge_posts_every_frames_result(mosquitto, tiny_bundle, tiny_data):

    port = free_port()
    receiver = Receiver(port)
    edge = Edge(tiny_bundle, mosquitto.url, None, deployment="hook",
                results_url=f"http://127.0.0.1:{port}/results", results_token="s3cret")
    try:
        run_devices(tiny_bundle, tiny_data.test, mosquitto.url, deployment="hook", limit=25)
        wait_for(lambda: len(receiver.received) >= 25)
    finally:
        edge.stop()
        receiver.stop()
    assert sorted(r["frame"] for r in receiver.received) == list(range(25))
    assert receiver.received == list(edge.agg.results)  # the same JSON, in the same order
