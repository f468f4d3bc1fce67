"""Answers nobody loses: at 40 fps on a bundle that escalates (so frames are answered out of
frame order), an application paging ``GET /v1/results?since=SEQ`` every 0.1 s and one following
``GET /v1/results/stream`` (Server-Sent Events) each receive every answer exactly once, across a
reconnect of the stream's consumer and a restart of the edge (``--state-dir``). The ground truth
is every answer the edges published (their ``--results-out`` file)."""

from __future__ import annotations

import itertools
import json
import threading

import httpx
import pytest

from tests.support.cloud import real_cloud
from tests.support.data import at_level, mixed, mixed_thresholds
from tests.support.hierarchy import Edge, run_devices
from tests.support.polling import wait_for

pytestmark = pytest.mark.filterwarnings(
    "ignore:Exception ignored in.*broker.log:pytest.PytestUnraisableExceptionWarning")


class Consumer(threading.Thread):
    """Reads the answers of whichever edge ``url()`` names now, by seq, until stopped."""

    def __init__(self, url):
        super().__init__(daemon=True)
        self.url, self.got, self.last = url, [], -1
        self.stop = threading.Event()
        self.failures = 0
        self.error: BaseException | None = None  # what ended the thread, re-raised by check()

    def run(self) -> None:
        try:
            self.consume()
        except BaseException as e:  # an assertion in this thread: the test says it
            self.error = e

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def take(self, result: dict) -> None:
        self.got.append(result)
        self.last = result["seq"]


class Pager(Consumer):
    """Pages ``?since=`` every 0.1 s, as the docs say."""

    def consume(self) -> None:
        with httpx.Client(timeout=5) as client:
            while not self.stop.wait(0.1):
                try:
                    while True:
                        page = client.get(f"{self.url()}/v1/results",
                                          params={"since": self.last}).json()
                        assert not page["gap"]
                        for r in page["results"]:
                            self.take(r)
                        if len(page["results"]) < 100:
                            break
                except httpx.HTTPError:
                    self.failures += 1  # the edge is restarting: the next poll goes on


class Follower(Consumer):
    """Follows the SSE stream, resuming with Last-Event-ID; drops its connection on purpose
    after ``drop_after`` events (a consumer's reconnect)."""

    def __init__(self, url, drop_after: int):
        super().__init__(url)
        self.drop_after, self.connections = drop_after, []  # (url, events before it)

    def consume(self) -> None:
        while not self.stop.is_set():
            try:
                self._follow()
            except httpx.HTTPError:
                self.failures += 1
            self.stop.wait(0.1)

    def _follow(self) -> None:
        headers, url = {"Last-Event-ID": str(self.last)}, self.url()
        with httpx.stream("GET", f"{url}/v1/results/stream", headers=headers,
                          timeout=httpx.Timeout(5, read=10)) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith(
                "text/event-stream")
            self.connections.append((url, len(self.got)))
            event: dict[str, str] = {}
            for line in r.iter_lines():
                if self.stop.is_set():
                    return
                if line:
                    field, _, value = line.partition(": ")
                    event[field] = value
                    continue
                if "data" in event:
                    assert "event" not in event, event  # no gap: it keeps up
                    result = json.loads(event["data"])
                    assert int(event["id"]) == result["seq"]
                    self.take(result)
                    if len(self.got) == self.drop_after:
                        return  # reconnect
                event = {}


def test_a_pager_and_a_stream_get_every_answer_once_across_reconnects_and_restarts(
        mosquitto, kinds_repository, tiny_data, tmp_path):
    bundle = at_level(kinds_repository / "esc", tmp_path / "esc", 1)
    thresholds = mixed_thresholds(bundle, tiny_data.test)
    out, state = tmp_path / "results.jsonl", tmp_path / "state"
    frames = 120
    settings = {"deployment": "gaps", "http_port": 0, "state_dir": state, "results_out": out,
                **mixed(thresholds)}
    with real_cloud(bundle) as cloud:
        edge = Edge(bundle, mosquitto.url, cloud.url, **settings)
        current = {"url": edge.service.http.url}
        pager, follower = Pager(lambda: current["url"]), Follower(lambda: current["url"], 5)
        pager.start()
        follower.start()
        devices = threading.Thread(target=run_devices, args=(bundle, tiny_data.test,
                                                             mosquitto.url),
                                   kwargs={"deployment": "gaps", "fps": 40}, daemon=True)
        devices.start()
        try:
            wait_for(lambda: edge.agg.answered >= 40, 60, "40 answers before the restart")
            edge.stop()  # a graceful restart while the devices produce
            first_run = edge.agg.answered
            edge = Edge(bundle, mosquitto.url, cloud.url, **settings)
            current["url"] = edge.service.http.url
            devices.join(120)
            wait_for(lambda: first_run + edge.agg.answered >= frames, 60, "every frame answered")
            published = [json.loads(line) for line in out.read_text().splitlines()]
            last = published[-1]["seq"]
            def caught_up() -> bool:
                pager.check()
                follower.check()
                return pager.last == last and follower.last == last

            wait_for(caught_up, 30, "both consumers caught up")
        finally:
            pager.stop.set()
            follower.stop.set()
            edge.stop()
    seqs = [r["seq"] for r in published]
    assert seqs == sorted(set(seqs)), "answers are numbered in the order they are made"
    assert seqs[first_run] > seqs[first_run - 1], "and on across the restart"
    assert sorted(r["frame"] for r in published) == list(range(frames))
    # Frames came out of frame order (escalated frames answered after later local exits):
    # what a consumer paging by frame id misses.
    assert any(b["frame"] < a["frame"] for a, b in itertools.pairwise(published))
    assert {r["exit"] for r in published} >= {"local", "cloud"}
    for consumer in (pager, follower):
        assert [r["seq"] for r in consumer.got] == seqs  # every answer, once, in order
        assert [r["frame"] for r in consumer.got] == [r["frame"] for r in published]
    # The first connection, its own reconnect, and one to the new edge after the restart.
    urls = [url for url, _ in follower.connections]
    assert len(urls) >= 3 and len(set(urls)) == 2, follower.connections
