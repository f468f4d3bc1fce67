"""The whole hierarchy as separate processes: V devices, one edge, the cloud, a real broker.

Every frame gets exactly one result; the answers equal ``ddnn evaluate``; the bytes on the wire
equal its accounting; a killed device or a broker outage loses no frame.
"""

from __future__ import annotations

import subprocess
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from ddnn.bundle import load_bundle
from ddnn.dataset import load_dataset
from ddnn.tools.broker import free_port, start_broker
from ddnn.tools.evaluate import evaluate
from tests.support.data import mixed_thresholds
from tests.support.polling import wait_for
from tests.support.processes import ddnn_process, http_ok, metric, read_results, stop_process

pytestmark = pytest.mark.filterwarnings(
    "ignore:Exception ignored in.*broker.log:pytest.PytestUnraisableExceptionWarning")

N = 120  # frames of tiny_data.test


@pytest.fixture(scope="module")
def thresholds(tiny_bundle, tiny_data) -> dict[str, float]:
    return mixed_thresholds(tiny_bundle, tiny_data.test)


class Hierarchy:
    """An edge and V device processes on one broker; logs and results under ``tmp``."""

    def __init__(self, tmp: Path, bundle: Path, data: Path, broker: str, cloud: str, *,
                 fps: float, thresholds: dict[str, float], deadline_ms: int = 3000,
                 expect: bool = True, device_args: tuple[str, ...] = ()):
        self.tmp, self.results_path = tmp, tmp / "results.jsonl"
        self.http = f"http://127.0.0.1:{free_port()}"
        views = load_bundle(bundle).manifest.views
        edge_args = ["edge", "--bundle", str(bundle), "--broker", broker, "--cloud", cloud,
                     "--deployment", "e2e", "--deadline-ms", str(deadline_ms),
                     "--feature-deadline-ms", str(deadline_ms), "--results-out",
                     str(self.results_path), "--http-port", self.http.rsplit(":", 1)[1],
                     "--keepalive", "2", "--reconnect-max", "1", "--local-threshold",
                     repr(thresholds["local"]), "--edge-threshold", repr(thresholds["edge"])]
        if expect:
            edge_args += ["--expect-frames", str(N)]
        self.edge = ddnn_process(edge_args, tmp / "edge.log")
        wait_for(lambda: http_ok(f"{self.http}/healthz"), 60, "edge ready", [self.edge])
        self.devices = [
            ddnn_process(["device", "--bundle", str(bundle), "--broker", broker, "--view",
                          str(v), "--data", str(data), "--fps", str(fps), "--deployment",
                          "e2e", "--wait-peers", "60", "--grace", "1", "--keepalive", "1",
                          "--reconnect-max", "1",
                          # every frame, however late: the answers are compared frame by frame
                          "--max-lag-ms", "0", *device_args], tmp / f"device{v}.log")
            for v in range(views)
        ]

    @property
    def procs(self) -> list[subprocess.Popen]:
        return [self.edge, *self.devices]

    def results(self) -> list[dict]:
        return read_results(self.results_path)

    def wait_results(self, n: int, timeout: float = 120) -> None:
        wait_for(lambda: len(self.results()) >= n, timeout, f"{n} results", self.procs)

    def metrics(self) -> str:
        with urllib.request.urlopen(f"{self.http}/metrics", timeout=5) as r:
            return r.read().decode()

    def stop(self) -> list[int]:
        return [stop_process(p) for p in self.procs]

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")


def assert_each_frame_once(results: list[dict]) -> None:
    frames = [r["frame"] for r in results]
    assert sorted(frames) == list(range(N)), "every frame gets exactly one result"


def test_processes_answer_like_ddnn_evaluate(mosquitto, tiny_bundle, tiny_data, cloud_url,
                                             tmp_path, thresholds):
    h = Hierarchy(tmp_path, tiny_bundle, tiny_data.test, mosquitto.url, cloud_url, fps=200,
                  thresholds=thresholds, expect=False)
    try:
        h.wait_results(N)
        for d in h.devices:
            assert d.wait(60) == 0, h.log("device0")
        text = h.metrics()
    finally:
        codes = h.stop()
    assert codes[0] == 0, "the edge stops cleanly on SIGTERM"
    results = h.results()
    assert_each_frame_once(results)
    expected = evaluate(tiny_bundle, tiny_data.test, thresholds["local"], thresholds["edge"])
    assert all(f > 0 for f in expected["exit_fraction"].values()), "every tier is exercised"
    ds = load_dataset(tiny_data.test)
    by_frame = {r["frame"]: r for r in results}
    pred = np.array([by_frame[i]["class"] for i in range(N)])
    tiers = [by_frame[i]["exit"] for i in range(N)]
    assert float((pred == ds.label).mean()) == pytest.approx(expected["accuracy"]["overall"],
                                                             abs=1e-12)
    for tier in ("local", "edge", "cloud"):
        assert tiers.count(tier) / N == pytest.approx(expected["exit_fraction"][tier], abs=1e-12)
    assert not any(r["degraded"] for r in results)
    payload = sum(metric(text, f'ddnn_edge_received_bytes_total{{kind="{k}",part="payload"}}')
                  for k in ("scores", "features", "absent"))
    assert payload / N == pytest.approx(expected["bytes_per_frame"]["ddnn"], abs=1e-9)
    assert "edge config:" in h.log("edge") and "device config:" in h.log("device0")


def test_a_killed_device_never_blocks_a_frame(mosquitto, tiny_bundle, tiny_data, cloud_url,
                                              tmp_path, thresholds):
    h = Hierarchy(tmp_path, tiny_bundle, tiny_data.test, mosquitto.url, cloud_url, fps=40,
                  thresholds=thresholds, deadline_ms=300)
    try:
        h.wait_results(30)
        h.devices[2].kill()  # no goodbye: the broker's last will tells the edge
        h.devices[2].wait()
        killed_after = max(r["frame"] for r in h.results())
        assert h.edge.wait(90) == 0, h.log("edge")
    finally:
        h.stop()
    results = h.results()
    assert_each_frame_once(results)
    late = [r for r in results if r["frame"] > killed_after + 10]
    assert late and all("cam2" not in r["views"] for r in late)
    # ...and each of those answers says so: cam2 is missing (late, then offline), partial.
    assert all(r["missing"].get("cam2") in ("late", "offline") and r["partial"] for r in late)
    assert any("cam2" in r["views"] for r in results)
    assert "cam2 (view 2) is offline" in h.log("edge")


def test_a_broker_outage_loses_no_frame(mosquitto, tiny_bundle, tiny_data, cloud_url, tmp_path,
                                       thresholds):
    # A broker as deployed (deploy/mosquitto/*.conf): its sessions persist across a restart, so
    # the edge's subscriptions are there again before the devices resend what they kept. (A
    # broker that comes back with no state at all drops what devices publish before the edge
    # has subscribed again: nobody is listening yet.)
    mosquitto.stop()
    db = tmp_path / "broker-db"
    broker = start_broker(mosquitto.host, mosquitto.port, prefer="mosquitto", persist=db)
    h = Hierarchy(tmp_path, tiny_bundle, tiny_data.test, broker.url, cloud_url, fps=40,
                  thresholds=thresholds, deadline_ms=1000)
    try:
        h.wait_results(30)
        broker.stop()  # Mosquitto saves its state as it stops
        time.sleep(2.0)  # the outage itself: devices keep capturing into their outboxes
        broker = start_broker(mosquitto.host, mosquitto.port, prefer="mosquitto", persist=db)
        assert h.edge.wait(120) == 0, h.log("edge")
        for d in h.devices:
            assert d.wait(60) == 0
    finally:
        h.stop()
        broker.stop()
    assert_each_frame_once(h.results())
    assert "reconnect" in h.log("device0").lower() or "connected" in h.log("device0")
