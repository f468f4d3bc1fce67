"""A device that runs ahead of the others cannot take the frames over (issue 25, item 1).

Five honest devices replay a six-view file at 25 fps. A sixth, an ordinary ``ddnn device``
replaying other scenes (the wrong images) at 5000 fps, runs ahead of them: it joins two seconds
after them at frame 120, or it starts three seconds before them at frame 0. Real processes:
Mosquitto, ``ddnn edge`` and six ``ddnn device``; the cloud serves in this process.

Every frame is answered; at least 90 % of the answers fuse every honest view that saw
something; the live accuracy is at least the offline accuracy without that device, less 5
points; the device is flagged in the metrics and the health answer.

The timing of a scenario is set by a "trigger": the devices that must wait also wait for the
online status of a device id that nothing runs, which the test publishes when the scenario says
(their processes are up by then, so they start on time whatever the load of the machine).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from ddnn.bundle import load_bundle
from ddnn.dataset import load_dataset
from ddnn.plumbing.mqtt import MqttClient
from ddnn.status import status_payload
from ddnn.tools.evaluate import evaluate
from ddnn.topics import Topics
from tests.support.data import SixViews, six_view_bundle
from tests.support.polling import wait_for
from tests.support.processes import Deployment, frames_of, metric

pytestmark = pytest.mark.filterwarnings(
    "ignore:Exception ignored in.*broker.log:pytest.PytestUnraisableExceptionWarning")

HONEST = [f"cam{v}" for v in range(5)]
ATTACKER = "cam5"
TRIGGER = "trigger"  # a device id nothing runs: its status starts the devices waiting for it


@pytest.fixture(scope="module")
def six(tmp_path_factory) -> SixViews:
    return six_view_bundle(tmp_path_factory.mktemp("six"))


@pytest.fixture(scope="module")
def cloud(six) -> str:
    from ddnn.cloud.server import run_server
    from ddnn.cloud.settings import CloudSettings
    from tests.support.cloud import cloud_wait_ready

    with run_server(CloudSettings(bundle=six.bundle, host="127.0.0.1", port=0,
                                  poll_interval=0)) as running:
        cloud_wait_ready(running.url)
        yield running.url


@pytest.fixture(scope="module")
def offline(six, tmp_path_factory) -> float:
    """The offline accuracy of the hierarchy without the hostile device's view."""
    d = dict(np.load(six.test))
    d["X"][:, 5] = 0.0
    d["y"][:, 5] = -1
    path = tmp_path_factory.mktemp("offline") / "honest.npz"
    np.savez_compressed(path, **d)
    return evaluate(six.bundle, path)["accuracy"]["overall"]


def trigger(broker: str, deployment: str, device: str = TRIGGER) -> None:
    """Publish ``device``'s online status (retained): who waits for it starts a moment later
    (the devices' start margin)."""
    client = MqttClient(broker, f"runahead-{device}").start()
    assert client.wait_connected(10)
    topic = Topics(deployment).device(device, "status")
    client.publish(topic, status_payload("online", since=time.time()), 1,
                   retain=True).wait_for_publish(5)
    client.stop()


def deployment(tmp: Path, six: SixViews, broker: str, cloud: str, name: str) -> Deployment:
    thresholds = load_bundle(six.bundle).manifest.thresholds
    return Deployment(tmp, six.bundle, broker, cloud, deployment=name, thresholds=thresholds)


def health_of(url: str) -> dict:
    """The edge's health answer, ready or not (503 once the devices are done and offline)."""
    try:
        with urllib.request.urlopen(f"{url}/healthz", timeout=5) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        return json.loads(e.read())


def honest(d: Deployment, six: SixViews) -> None:
    for v in range(5):
        d.start_device(v, six.test, 25, "--wait-peers", "120",
                       "--peers", ",".join([*HONEST, TRIGGER]))


def check(d: Deployment, six: SixViews, offline: float) -> None:
    """The done-when of the issue, and the hostile device flagged."""
    n = six.frames
    d.wait(lambda r: len(r) >= n, f"{n} results", timeout=120)
    d.wait_devices(timeout=60)
    text = d.metrics()
    health = health_of(d.http)
    results = d.results()
    assert frames_of(results) == list(range(n)), "every frame answered, once"
    ds = load_dataset(six.test)
    fused_all = [set(f"cam{v}" for v in np.flatnonzero(ds.present[r["frame"], :5]))
                 <= set(r["views"]) for r in results]
    assert sum(fused_all) >= 0.9 * n, f"{n - sum(fused_all)} answers left honest views out"
    answered = [r for r in results if r["class"] is not None]
    live = np.mean([r["class"] == ds.label[r["frame"]] for r in answered])
    assert live >= offline - 0.05, f"live accuracy {live:.3f}, offline without it {offline:.3f}"
    assert metric(text, f'ddnn_edge_device_flagged{{device="{ATTACKER}",reason="ahead"}}') == 1
    assert all(metric(text, f'ddnn_edge_device_flagged{{device="{h}",reason="ahead"}}') == 0
               for h in HONEST)
    assert metric(text, f'ddnn_edge_refused_views_total{{device="{ATTACKER}",reason="ahead"}}') > 0
    assert all(metric(text, f'ddnn_edge_late_views_total{{device="{h}"}}') <= 0.1 * n
               for h in HONEST)
    assert ATTACKER in health["flagged_devices"]
    assert "runs ahead" in d.log("edge0")


@pytest.mark.slow
def test_a_device_that_joins_ahead_takes_no_frame(mosquitto, six, cloud, offline, tmp_path):
    d = deployment(tmp_path, six, mosquitto.url, cloud, "ahead1")
    try:
        d.start_edge()
        honest(d, six)
        # Up and waiting for a trigger of its own, published once the others run: it joins
        # them about two seconds after they started, at frame 120, far ahead of them.
        d.start_device(5, six.wrong, 5000, "--start", "120", "--wait-peers", "120",
                       "--peers", ",".join([*HONEST, "late-trigger"]))
        trigger(mosquitto.url, "ahead1")
        d.wait(lambda r: any(x["frame"] >= 25 for x in r), "the honest devices at frame 25")
        trigger(mosquitto.url, "ahead1", "late-trigger")
        check(d, six, offline)
    finally:
        d.stop()


@pytest.mark.slow
def test_a_device_that_starts_first_takes_no_frame(mosquitto, six, cloud, offline, tmp_path):
    d = deployment(tmp_path, six, mosquitto.url, cloud, "ahead2")
    try:
        d.start_edge()
        honest(d, six)
        d.start_device(5, six.wrong, 5000, "--wait-peers", "0")
        # Three seconds after its first view reached the edge, the others start at frame 0.
        wait_for(lambda: metric(d.metrics(), 'ddnn_edge_messages_total{kind="scores"}')
                 + metric(d.metrics(), 'ddnn_edge_messages_total{kind="absent"}') > 0,
                 60, "the hostile device's first view", d.procs)
        time.sleep(3.0)  # the scenario (not a wait for readiness): it runs alone for 3 s
        trigger(mosquitto.url, "ahead2")
        check(d, six, offline)
    finally:
        d.stop()
