"""Devices and an edge in this process (threads), a real Mosquitto broker, a real v2 endpoint.

The live hierarchy must answer every frame exactly once with the answers ``ddnn evaluate``
computes offline, and count on the wire the bytes the offline accounting predicts.
"""

from __future__ import annotations

import contextlib
import functools
import json
import shutil
import threading
import time

import httpx
import numpy as np
import pytest

from ddnn import envelope as env
from ddnn.envelope import MessageType
from ddnn.plumbing.mqtt import MqttClient, MqttOptions
from ddnn.tools.broker import free_port
from ddnn.topics import Topics
from tests.support.cloud import real_cloud
from tests.support.data import mixed, mixed_thresholds
from tests.support.hierarchy import REPLAY_WAIT, Edge, check_against_evaluate, run_devices
from tests.support.polling import wait_for

# ddnn.tools.broker leaves the broker's log file open for the garbage collector (reported upstream).
pytestmark = pytest.mark.filterwarnings(
    "ignore:Exception ignored in.*broker.log:pytest.PytestUnraisableExceptionWarning")


# Whole replays through a broker: a longer wait than the other integration tests'.
wait_for = functools.partial(wait_for, timeout=REPLAY_WAIT)


class ResultsListener:
    """Subscribes to a deployment's results topic."""

    def __init__(self, broker: str, deployment="it"):
        self.results: list[dict] = []
        self.probed = threading.Event()
        topic = Topics(deployment).results
        opts = MqttOptions(subscriptions=[(topic, 1)])
        self.client = MqttClient(broker, f"listener-{deployment}", opts, on_message=self._on)
        self.client.start()
        assert self.client.wait_connected(10)
        # The subscription is live once a message of our own comes back through the broker.
        deadline = time.monotonic() + 10
        while not self.probed.wait(0.1):
            assert time.monotonic() < deadline, "the results subscription never became active"
            self.client.publish(topic, b'{"probe": true}', 1)

    def _on(self, topic: str, payload: bytes) -> None:
        result = json.loads(payload)
        if result == {"probe": True}:
            self.probed.set()
        else:
            self.results.append(result)

    def stop(self) -> None:
        self.client.stop()


@pytest.fixture(scope="module")
def thresholds(tiny_bundle, tiny_data) -> dict[str, float]:
    return mixed_thresholds(tiny_bundle, tiny_data.test)


@pytest.fixture
def cloud(tiny_bundle):
    with real_cloud(tiny_bundle) as server:
        yield server


def test_live_hierarchy_equals_offline_evaluation(mosquitto, tiny_bundle, tiny_data, cloud,
                                                  thresholds):
    listener = ResultsListener(mosquitto.url)
    edge = Edge(tiny_bundle, mosquitto.url, cloud.url, **mixed(thresholds))
    try:
        run_devices(tiny_bundle, tiny_data.test, mosquitto.url)
        wait_for(lambda: edge.agg.answered >= 120, what="120 results")
        edge.service.flush()
        wait_for(lambda: len(listener.results) >= 120, what="results on MQTT")
    finally:
        edge.stop()
        listener.stop()
    expected = check_against_evaluate(listener.results, tiny_bundle, tiny_data.test, thresholds)
    assert sorted(r["frame"] for r in listener.results) == list(range(120))
    m = edge.agg.metrics
    payload = sum(m.bytes.value(kind=k, part="payload") for k in ("scores", "features", "absent"))
    assert payload / 120 == pytest.approx(expected["bytes_per_frame"]["ddnn"], abs=1e-9)
    assert m.dropped.value(reason="late") == 0 and m.missing.value(stage="scores") == 0
    if expected["exit_fraction"]["cloud"] > 0:
        assert m.cloud.value(outcome="ok") > 0
    text = m.render()
    assert 'ddnn_edge_frames_total{degraded="false",exit="local"}' in text
    assert "ddnn_edge_latency_seconds_bucket" in text


def test_push_mode_sends_more_bytes_for_the_same_answers(mosquitto, tiny_bundle, tiny_data,
                                                         cloud, thresholds):
    edge = Edge(tiny_bundle, mosquitto.url, cloud.url, deployment="push", **mixed(thresholds))
    try:
        run_devices(tiny_bundle, tiny_data.test, mosquitto.url, mode="push", deployment="push")
        wait_for(lambda: edge.agg.answered >= 120, what="120 results")
    finally:
        edge.stop()
    expected = check_against_evaluate(list(edge.agg.results), tiny_bundle, tiny_data.test,
                                      thresholds)
    m = edge.agg.metrics
    assert m.requests.value() == 0  # no round trips
    payload = sum(m.bytes.value(kind=k, part="payload") for k in ("scores", "features"))
    assert payload / 120 > expected["bytes_per_frame"]["ddnn"]


def test_bad_messages_are_counted_and_dropped(mosquitto, tiny_bundle, tiny_data, cloud):
    edge = Edge(tiny_bundle, mosquitto.url, cloud.url, deployment="bad")
    t = Topics("bad")
    pub = MqttClient(mosquitto.url, "vandal", MqttOptions()).start()
    assert pub.wait_connected(10)
    good = dict(model="tiny", version="1", deployment="bad", device="cam0")
    scores = np.zeros((1, 3), np.float32)
    bad = {
        "malformed": b"not an envelope",
        "oversized": bytes(env.MAX_MESSAGE + 10),
        "shape": env.encode(env.pack(MessageType.SCORES, frame=1000, tensor=np.zeros((1, 5)),
                                     codec="float16", **good)),
        "model": env.encode(env.pack(MessageType.SCORES, frame=1000, tensor=scores,
                                     codec="float16", **{**good, "version": "2"})),
        "unknown_device": env.encode(env.pack(MessageType.SCORES, frame=1000, tensor=scores,
                                              codec="float16", **{**good, "device": "cam9"})),
    }
    try:
        for reason, payload in bad.items():
            device = "cam9" if reason == "unknown_device" else "cam0"
            pub.publish(t.device(device, "scores"), payload, 1)
        wait_for(lambda: all(edge.agg.metrics.dropped.value(reason=r) >= 1 for r in bad),
                 what="every bad message counted")
        run_devices(tiny_bundle, tiny_data.test, mosquitto.url, deployment="bad", limit=30)
        wait_for(lambda: edge.agg.answered >= 30, what="30 results")
        # A duplicate and a very late view of an answered frame: dropped, nothing else lost.
        dup = env.encode(env.pack(MessageType.SCORES, frame=3, tensor=scores, codec="float16",
                                  **good))
        pub.publish(t.device("cam0", "scores"), dup, 1)
        wait_for(lambda: edge.agg.metrics.dropped.value(reason="late") >= 1, what="late view")
    finally:
        pub.stop()
        edge.stop()
    assert sorted(r["frame"] for r in edge.agg.results) == list(range(30))


def test_cloud_outage_degrades_then_recovers(mosquitto, tiny_bundle, tiny_data):
    port = free_port()
    edge = Edge(tiny_bundle, mosquitto.url, f"http://127.0.0.1:{port}", deployment="outage",
                local_threshold=0.0, edge_threshold=0.0)  # every frame needs the cloud
    try:
        run_devices(tiny_bundle, tiny_data.test, mosquitto.url, deployment="outage", limit=40)
        wait_for(lambda: edge.agg.answered >= 40, what="40 results")
        first = list(edge.agg.results)
        assert all(r["degraded"] and r["exit"] == "edge" for r in first)
        with real_cloud(tiny_bundle, port=port):
            run_devices(tiny_bundle, tiny_data.test, mosquitto.url, deployment="outage",
                        start=40, limit=40)
            wait_for(lambda: edge.agg.answered >= 80, what="80 results")
            later = [r for r in edge.agg.results if r["frame"] >= 40]
            assert edge.agg.metrics.cloud.value(outcome="ok") > 0
    finally:
        edge.stop()
    # The circuit reopens within its backoff: the last frames went to the cloud again.
    tail = sorted(later, key=lambda r: r["frame"])[-5:]
    assert all(r["exit"] == "cloud" and not r["degraded"] for r in tail)
    assert edge.agg.metrics.cloud.value(outcome="error") >= 1


def test_http_fallback_without_a_broker(tiny_bundle, tiny_data, cloud, thresholds):
    port = free_port()
    edge = Edge(tiny_bundle, None, cloud.url, deployment="http", http_port=port,
                **mixed(thresholds))
    try:
        run_devices(tiny_bundle, tiny_data.test, None, mode="push", deployment="http",
                    edge_url=f"http://127.0.0.1:{port}")
        wait_for(lambda: edge.agg.answered >= 120, what="120 results")
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics") as r:
            assert b"ddnn_edge_frames_total" in r.read()
        with contextlib.closing(urllib.request.urlopen(
                f"http://127.0.0.1:{port}/v1/results?after=100")) as r:
            assert sorted(x["frame"] for x in json.loads(r.read())) == list(range(101, 120))
    finally:
        edge.stop()
    check_against_evaluate(list(edge.agg.results), tiny_bundle, tiny_data.test, thresholds)


def test_cloud_calls_are_pinned_to_the_frames_bundle_version(mosquitto, tiny_bundle, tiny_data,
                                                             cloud, tmp_path):
    # The edge runs version 99, which the cloud does not serve: its features must not be
    # classified by another version's cloud segment; the edge answers, degraded.
    v99 = tmp_path / "tiny-99"
    shutil.copytree(tiny_bundle, v99)
    manifest = json.loads((v99 / "manifest.json").read_text())
    manifest["model"]["version"] = "99"
    (v99 / "manifest.json").write_text(json.dumps(manifest))
    edge = Edge(v99, mosquitto.url, cloud.url, deployment="pinned", local_threshold=0.0,
                edge_threshold=0.0)
    try:
        run_devices(v99, tiny_data.test, mosquitto.url, deployment="pinned", limit=20)
        wait_for(lambda: edge.agg.answered >= 20, what="20 results")
    finally:
        edge.stop()
    assert all(r["degraded"] and r["exit"] == "edge" for r in edge.agg.results)
    assert edge.agg.metrics.cloud.value(outcome="unknown_version") >= 1
    assert edge.agg.metrics.cloud.value(outcome="ok") == 0
    assert edge.agg.metrics.cloud.value(outcome="error") == 0  # the cloud is up: no outage
    assert edge.agg.cloud.up


def test_a_frame_that_fails_inside_the_edge_is_counted_and_the_rest_go_on(
        mosquitto, tiny_bundle, tiny_data):
    edge = Edge(tiny_bundle, mosquitto.url, None, deployment="broken", local_threshold=0.0,
                edge_threshold=1.0)  # every frame runs the edge segment and exits there
    real_edge, calls = edge.runtime.edge, []

    def edge_segment_failing_once(*args):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected failure")
        return real_edge(*args)

    edge.runtime.edge = edge_segment_failing_once
    try:
        run_devices(tiny_bundle, tiny_data.test, mosquitto.url, deployment="broken", limit=30)
        wait_for(lambda: edge.agg.answered >= 29, what="29 results")
        wait_for(lambda: len(edge.agg.assembler) == 0, what="no frame pending")
    finally:
        edge.stop()
    assert edge.agg.answered == 29
    assert edge.agg.metrics.dropped.value(reason="processing_failed") == 1


@pytest.mark.parametrize(("change", "why"), [
    ({"frame": "7"}, "frame must be"),
    ({"class": 9}, "class must be"),
    ({"label": "bus"}, "label must be 'car'"),
    ({"exit": "cloud"}, "exits at 'local'"),
    ({"entropy": -1}, "entropy must be"),
    ({"degraded": "no"}, "degraded must be"),
    ({"views": ["intruder"]}, "views must list"),
    ({"extra": 1}, "exactly the keys"),
    ({"partial": True}, "partial must be"),
    ({"missing": {"cam1": "late"}, "partial": True}, "views must list"),
])
def test_posted_device_results_are_checked(one_view_bundle, change, why):
    # (only a one-view bundle's device posts its results: tests/integration/
    # test_hostile_edge_http.py::test_a_multi_view_bundles_devices_cannot_post_results)
    port = free_port()
    edge = Edge(one_view_bundle, None, None, deployment="posted", http_port=port)
    good = {"frame": 7, "class": 0, "label": "car", "exit": "local", "entropy": 0.1,
            "views": ["cam0"], "missing": {}, "partial": False, "degraded": False,
            "latency_ms": 2.5}
    url = f"http://127.0.0.1:{port}/v1/results"
    try:
        r = httpx.post(url, content=json.dumps({**good, **change}))
        assert r.status_code == 400 and why in r.json()["error"]
        assert httpx.post(url, content=b"\xff{").status_code == 400
        # Nesting past the parser's recursion limit is a 400 too, not a dropped connection.
        deep = httpx.post(url, content=b"[" * 50_000)
        assert deep.status_code == 400 and "not JSON" in deep.json()["error"]
        assert httpx.post(url, content=json.dumps(good)).status_code == 202
        kept = httpx.get(url).json()  # the bad ones never reached the results
        assert [{k: v for k, v in r.items() if k != "seq"} for r in kept] == [good]
        assert type(kept[0]["seq"]) is int  # numbered by the edge as it published it
    finally:
        edge.stop()
    assert edge.agg.metrics.dropped.value(reason="malformed") == 3


def test_a_frame_no_camera_saw_is_answered_unclassified(mosquitto, tiny_bundle, tiny_data, cloud,
                                                        thresholds, tmp_path):
    # Devices replay a file in which some scenes are blank in every view (sent "absent"); the
    # edge answers those frames exit "none", never a class made from nothing.
    with np.load(tiny_data.test) as f:
        arrays = dict(f)
    blank = [3, 50, 119]
    arrays["X"][blank] = 0.0
    data = tmp_path / "blank.npz"
    np.savez(data, **arrays)
    edge = Edge(tiny_bundle, mosquitto.url, cloud.url, deployment="blank", **mixed(thresholds))
    try:
        run_devices(tiny_bundle, data, mosquitto.url, deployment="blank")
        wait_for(lambda: edge.agg.answered >= 120, what="120 results")
    finally:
        edge.stop()
    by_frame = {r["frame"]: r for r in edge.agg.results}
    assert sorted(by_frame) == list(range(120))
    views = [f"cam{v}" for v in range(3)]
    for i in blank:
        assert by_frame[i] == {**by_frame[i], "class": None, "label": None, "exit": "none",
                               "entropy": None, "views": [], "partial": False,
                               "missing": dict.fromkeys(views, "absent")}
    assert all(by_frame[i]["exit"] != "none" and by_frame[i]["class"] is not None
               for i in by_frame if i not in blank)
    assert edge.agg.metrics.frames.value(exit="none", degraded="false") == len(blank)


def test_stacked_exits_answer_live_as_offline(mosquitto, tiny_bundle, tiny_data, tmp_path):
    """A bundle whose edge and cloud stack their answers on the tier below (ddnn.stacking):
    the live edge stacks as ``ddnn evaluate`` does, the cloud's scores on the edge's answer;
    the experience it records is labelled with the cloud's own answer, which does not contain
    the early answers it would teach."""
    from ddnn.bundle import load_bundle
    from ddnn.dataset import load_dataset
    from ddnn.experience import chunks, read_experience
    from ddnn.runtime import BundleRuntime
    from ddnn.stacking import log_probs

    bundle = tmp_path / "stacked"
    shutil.copytree(tiny_bundle, bundle)
    mf = bundle / "manifest.json"
    d = json.loads(mf.read_text())
    d["stacking"] = {"edge": 0.5, "cloud": 0.3}  # strictly between: both answers count
    mf.write_text(json.dumps(d))
    thresholds = mixed_thresholds(bundle, tiny_data.test)
    ds = load_dataset(tiny_data.test)
    rt = BundleRuntime(load_bundle(bundle), threads=1)
    stacked, own = (rt.run_dataset(ds.X, ds.present, stacked=s) for s in (True, False))
    # Not a vacuous check: stacking changes answers of this barely trained bundle.
    assert any((stacked[t].argmax(1) != own[t].argmax(1)).any() for t in ("edge", "cloud"))
    recorded = tmp_path / "experience"
    with real_cloud(bundle) as cloud:
        edge = Edge(bundle, mosquitto.url, cloud.url, deployment="stacked", **mixed(thresholds),
                    experience=recorded, experience_max_mb=16.0)
        try:
            run_devices(bundle, tiny_data.test, mosquitto.url, deployment="stacked")
            wait_for(lambda: edge.agg.answered >= 120, what="120 results")
        finally:
            edge.stop()
    results = list(edge.agg.results)
    check_against_evaluate(results, bundle, tiny_data.test, thresholds)
    for r in results:
        assert r["class"] == int(np.argmax(stacked[r["exit"]][r["frame"]]))
    # Each recorded label is the cloud segment's own softmax for one of the frames it answered,
    # and far from the stacked answer of a frame where stacking moved the cloud's.
    wait_for(lambda: chunks(recorded), what="experience chunks")
    labels = read_experience(recorded).soft_label
    to_cloud = [r["frame"] for r in results if r["exit"] == "cloud"]
    assert 0 < len(labels) == len(to_cloud)
    own_p, stacked_p = (np.exp(log_probs(x["cloud"][to_cloud])) for x in (own, stacked))
    gap = np.abs(labels[:, None, :] - own_p[None]).max(-1)  # (recorded, answered)
    nearest = gap.argmin(1)
    assert (gap.min(1) < 1e-3).all() and len(set(nearest)) == len(labels)
    moved = np.abs(own_p - stacked_p).max(-1) > 0.05
    assert moved.any()  # the check below is not vacuous
    assert (np.abs(labels - stacked_p[nearest]).max(-1)[moved[nearest]] > 0.01).all()
