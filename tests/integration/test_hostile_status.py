"""Status messages that lie or overflow (issue 25 items 5, 11, 17): any client may publish a
retained status, so its readers bound it. Real broker; the device and edge in this process.

* a peer's ``since`` far in the future (or 1e308) neither stalls nor crashes a device that
  agrees its replay's start from it;
* statuses nested thousands deep, or larger than a status can need, are ignored before
  parsing, with a few warnings and no traceback, and the edge keeps serving.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time

import pytest

from ddnn.device.service import DeviceService
from ddnn.device.settings import DeviceSettings
from ddnn.plumbing.mqtt import MqttClient, MqttOptions
from ddnn.status import MAX_STATUS_BYTES, status_payload
from ddnn.topics import Topics
from tests.support.hierarchy import REPLAY_WAIT, Edge, run_devices
from tests.support.polling import wait_for

pytestmark = pytest.mark.filterwarnings(
    "ignore:Exception ignored in.*broker.log:pytest.PytestUnraisableExceptionWarning")


@contextlib.contextmanager
def vandal(broker: str, deployment: str):
    """A client that publishes as it likes; its retained statuses are cleared after."""
    client = MqttClient(broker, f"vandal-{deployment}", MqttOptions()).start()
    assert client.wait_connected(10)
    retained: list[str] = []

    def publish(topic: str, payload: bytes, retain: bool = False) -> None:
        client.publish(topic, payload, 1, retain=retain).wait_for_publish(10)
        if retain:
            retained.append(topic)

    try:
        yield publish
    finally:
        for topic in retained:
            client.publish(topic, b"", 1, retain=True).wait_for_publish(10)
        client.stop()


@pytest.mark.parametrize("ahead", [1e6, 1e308])
def test_a_status_from_the_future_neither_stalls_nor_crashes_its_peers(
        mosquitto, tiny_bundle, tiny_data, ahead):
    deployment = f"future{len(str(ahead))}"
    t = Topics(deployment)
    with vandal(mosquitto.url, deployment) as publish:
        publish(t.edge_status("edge0"), status_payload("online"), retain=True)
        publish(t.device("cam1", "status"),
                status_payload("online", since=time.time() + ahead), retain=True)
        s = DeviceSettings(bundle=tiny_bundle, view=0, broker=mosquitto.url,
                           deployment=deployment, data=tiny_data.test, limit=5, fps=0,
                           grace=0.2, drain_timeout=10, keepalive=5, reconnect_max=1,
                           peers=("cam0", "cam1"), wait_peers=20)
        failed: list[BaseException] = []
        with DeviceService.from_settings(s) as device:
            def replay() -> None:
                try:
                    device.run()
                except BaseException as e:
                    failed.append(e)

            runner = threading.Thread(target=replay)
            runner.start()
            runner.join(30)  # five frames at once: well under a second
            stalled = runner.is_alive()
            if stalled:
                device.stop_event.set()
                runner.join(10)
    assert not failed, failed
    assert not stalled, "the replay waited for a start far in the future"
    assert device.agent.stats.frames == 5


def test_deep_and_huge_statuses_are_ignored_with_a_few_warnings(mosquitto, tiny_bundle,
                                                                tiny_data, caplog):
    deployment = "statusbomb"
    t = Topics(deployment)
    deep = b'{"state": "online", "x": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
    huge = json.dumps({"state": "online", "pad": "x" * (MAX_STATUS_BYTES + 1)}).encode()
    edge = Edge(tiny_bundle, mosquitto.url, None, deployment=deployment, local_threshold=1.0,
                edge_threshold=1.0)
    try:
        with caplog.at_level(logging.WARNING), vandal(mosquitto.url, deployment) as publish:
            for _ in range(100):
                publish(t.device("cam0", "status"), deep)
                publish(t.device("cam1", "status"), huge)
            run_devices(tiny_bundle, tiny_data.test, mosquitto.url, deployment=deployment,
                        limit=20)
            wait_for(lambda: edge.agg.answered >= 20, REPLAY_WAIT, "20 results")
    finally:
        edge.stop()
    statuses = [r for r in caplog.records if "status" in r.getMessage()
                and "ignored" in r.getMessage()]
    assert 2 <= len(statuses) <= 2 * 8, [r.getMessage() for r in statuses]  # 1, 2, 4, ... 64
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert sorted(r["frame"] for r in edge.agg.results) == list(range(20))
