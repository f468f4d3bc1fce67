"""Faults against real processes: the cloud stopped and restarted, the edge restarted while its
devices keep producing, a device whose views always arrive late.

``test_hierarchy.py`` covers a killed device and a broker outage. Each test here counts frames
in and results out: every frame the design says must be answered is answered, and every loss
the design allows (a view past its deadline, a cloud that cannot answer) is in the metrics.
Waits are on results and readiness, never on a guessed duration.
"""

from __future__ import annotations

import collections
import subprocess
from pathlib import Path

import numpy as np
import pytest

from ddnn.dataset import load_dataset
from ddnn.tools.broker import free_port
from ddnn.tools.evaluate import evaluate
from tests.support.data import STREAM, mixed_thresholds
from tests.support.polling import wait_for
from tests.support.processes import (
    Deployment,
    ddnn_process,
    frames_of,
    http_ok,
    metric,
    stop_process,
)

pytestmark = pytest.mark.filterwarnings(
    "ignore:Exception ignored in.*broker.log:pytest.PytestUnraisableExceptionWarning")

def start_cloud(bundle: Path, port: int, log: Path) -> subprocess.Popen:
    proc = ddnn_process(["cloud", "--bundle", str(bundle), "--host", "127.0.0.1", "--port",
                         str(port), "--ort-threads", "1", "--poll-interval", "0"], log)
    wait_for(lambda: http_ok(f"http://127.0.0.1:{port}/v2/health/ready"), 60,
               "cloud ready", [proc])
    return proc


@pytest.mark.slow
def test_cloud_stop_and_restart_degrades_then_recovers(mosquitto, tiny_bundle, stream_data,
                                                       tmp_path):
    port = free_port()
    cloud = start_cloud(tiny_bundle, port, tmp_path / "cloud0.log")
    d = Deployment(tmp_path, tiny_bundle, mosquitto.url, f"http://127.0.0.1:{port}",
                   thresholds={"local": 0.0, "edge": 0.0})  # every frame needs the cloud
    try:
        d.start_edge()
        for v in range(3):
            d.start_device(v, stream_data, 25, "--wait-peers", "60")
        d.wait(lambda r: len(r) >= 20, "20 results from the cloud")
        assert stop_process(cloud) == 0, "the cloud stops cleanly on SIGTERM"
        d.wait(lambda r: any(x["degraded"] for x in r), "a degraded result")
        cloud = start_cloud(tiny_bundle, port, tmp_path / "cloud1.log")
        d.wait(lambda r: len(r) >= STREAM, f"{STREAM} results")
        d.wait_devices()
        text = d.metrics()
    finally:
        stop_process(cloud)
        d.stop()
    results = d.results()
    assert frames_of(results) == list(range(STREAM)), "every frame exactly once"
    degraded = [r for r in results if r["degraded"]]
    assert degraded and all(r["exit"] == "edge" for r in degraded)
    assert all(r["exit"] == "cloud" for r in results if not r["degraded"])
    last_degraded = max(r["frame"] for r in degraded)
    assert any(r["exit"] == "cloud" and r["frame"] > last_degraded for r in results), \
        "answers return to the cloud once it is back"
    # Every degraded answer is counted as such, and the failed calls too.
    assert metric(text, 'ddnn_edge_frames_total{exit="edge",degraded="true"}') == len(degraded)
    assert metric(text, 'ddnn_edge_frames_total{exit="cloud",degraded="false"}') == \
        STREAM - len(degraded)
    assert metric(text, 'ddnn_edge_cloud_requests_total{outcome="error"}') >= 1
    assert "cloud failed" in d.log("edge0") and "is back" in d.log("edge0")


@pytest.mark.slow
def test_edge_restart_while_devices_produce_loses_no_frame(mosquitto, tiny_bundle, stream_data,
                                                          cloud_url, tmp_path):
    thresholds = mixed_thresholds(tiny_bundle, stream_data)
    d = Deployment(tmp_path, tiny_bundle, mosquitto.url, cloud_url, thresholds=thresholds)
    try:
        d.start_edge()
        for v in range(3):
            d.start_device(v, stream_data, 25, "--wait-peers", "60")
        d.wait(lambda r: len(r) >= 40, "40 results")
        # A graceful restart: the old edge finishes the frames under way and declines new ones,
        # which its persistent session keeps (with everything published meanwhile) for the next.
        assert stop_process(d.edge) == 0
        by_old_edge = len(d.results())
        assert by_old_edge < STREAM, "the restart happened while devices were producing"
        d.start_edge()
        d.wait(lambda r: set(frames_of(r)) == set(range(STREAM)), "every frame answered")
        d.wait_devices()
        text = d.metrics()
    finally:
        d.stop()
    results = d.results()
    counts = collections.Counter(r["frame"] for r in results)
    assert frames_of(results) == list(range(STREAM)), \
        f"every frame exactly once; duplicates: {[f for f, n in counts.items() if n > 1]}"
    assert metric(text, 'ddnn_edge_frames_total{exit="local",degraded="false"}') > 0
    # The frames straddling the restart were answered with every view, like all the others:
    # the live answers still equal the offline evaluation's.
    expected = evaluate(tiny_bundle, stream_data, thresholds["local"], thresholds["edge"])
    ds = load_dataset(stream_data)
    by_frame = {r["frame"]: r for r in results}
    pred = np.array([by_frame[i]["class"] for i in range(STREAM)])
    assert float((pred == ds.label).mean()) == pytest.approx(expected["accuracy"]["overall"],
                                                             abs=1e-12)
    for tier in ("local", "edge", "cloud"):
        share = sum(r["exit"] == tier for r in results) / STREAM
        assert share == pytest.approx(expected["exit_fraction"][tier], abs=1e-12)
    assert "drained: 0 frames left unanswered" in d.log("edge0")


def test_a_slow_device_is_fused_without_and_counted_late(mosquitto, tiny_bundle, tiny_data,
                                                         cloud_url, tmp_path):
    n = 120
    thresholds = mixed_thresholds(tiny_bundle, tiny_data.test)
    d = Deployment(tmp_path, tiny_bundle, mosquitto.url, cloud_url, thresholds=thresholds,
                   deadline_ms=300)
    try:
        d.start_edge()
        for v in (0, 1):
            d.start_device(v, tiny_data.test, 20, "--wait-peers", "60", "--peers", "cam0,cam1")
        d.wait(lambda r: len(r) >= 15, "15 results")
        # cam2 replays the same frames at the same rate, seconds behind the others: every one
        # of its views arrives after its frame's deadline.
        d.start_device(2, tiny_data.test, 20)
        d.wait(lambda r: len(r) >= n, f"{n} results")
        d.wait_devices()
        text = d.metrics()
    finally:
        d.stop()
    results = d.results()
    assert frames_of(results) == list(range(n)), "a late device never blocks a frame"
    ds = load_dataset(tiny_data.test)
    assert not any("cam2" in r["views"] for r in results)
    # Nothing was lost on the way: every message of every device reached the edge ...
    present = int(ds.present.sum())
    assert metric(text, 'ddnn_edge_messages_total{kind="scores"}') == present
    assert metric(text, 'ddnn_edge_messages_total{kind="absent"}') == 3 * n - present
    # ... the on-time views were fused, and every view of the slow device is counted late.
    assert sum(len(r["views"]) for r in results) == int(ds.present[:, :2].sum())
    assert metric(text, 'ddnn_edge_late_views_total{device="cam2"}') >= n
    assert metric(text, 'ddnn_edge_dropped_total{reason="late"}') >= n
    assert metric(text, 'ddnn_edge_missing_views_total{stage="scores"}') > 0
    assert "device cam2: a view came" in d.log("edge0")  # the warning names it, once

