"""A device against a flood of feature pulls, with a real Mosquitto broker.

Whoever may publish on the edge's requests topic (the edge, or a client where the broker has
no ACL) must not make a device send a frame's features again and again: a device answers a
frame's pull once, and again only after it reconnected (the edge re-pulls what it still waits
for after an outage) or after ``REPULL_AFTER`` seconds.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from ddnn import envelope as env
from ddnn.dataset import load_dataset
from ddnn.device import agent as device_agent
from ddnn.device.service import DeviceService
from ddnn.device.settings import DeviceSettings
from ddnn.envelope import MessageType
from ddnn.plumbing.mqtt import MqttClient, MqttOptions
from ddnn.tools.broker import start_broker
from ddnn.topics import Topics
from tests.support.polling import wait_for

# ddnn.tools.broker leaves the broker's log file open for the garbage collector (reported upstream).
pytestmark = pytest.mark.filterwarnings(
    "ignore:Exception ignored in.*broker.log:pytest.PytestUnraisableExceptionWarning")

DEPLOYMENT = "flood"
TOPICS = Topics(DEPLOYMENT)


def pull(frame: int, views: int = 3) -> bytes:
    """The edge's feature request for ``frame``, asking every view (as edge.aggregator does)."""
    return env.encode(env.pack(MessageType.REQUEST, model="tiny", version="1",
                               deployment=DEPLOYMENT, device="edge0", frame=frame,
                               tensor=np.ones(views, np.float32), codec="binary"))


class Listener:
    """Counts the features cam0 publishes, per frame, and sees cam0 come online."""

    def __init__(self, broker: str):
        self.frames: list[int] = []
        self.online = threading.Event()  # cam0 said online: its subscriptions are live
        self._probed = threading.Event()
        self.features = TOPICS.device("cam0", "features")
        subscriptions = [(self.features, 1), (TOPICS.device("cam0", "status"), 1)]
        self.client = MqttClient(broker, "listener", MqttOptions(
            subscriptions=subscriptions, reconnect_max=1), on_message=self._on)
        self.client.start()
        self.wait_subscribed()

    def wait_subscribed(self) -> None:
        """Return once a message of our own came back: the subscriptions are live."""
        assert self.client.wait_connected(20)
        self._probed.clear()
        deadline = time.monotonic() + 10
        while not self._probed.wait(0.1):
            assert time.monotonic() < deadline, "the subscription never became active"
            self.client.publish(self.features, b"probe", 1)

    def _on(self, topic: str, payload: bytes) -> None:
        if payload == b"probe":
            self._probed.set()
        elif topic == self.features:
            self.frames.append(env.decode(payload).frame)
        elif b'"online"' in payload:
            self.online.set()

    def count(self, frame: int) -> int:
        return self.frames.count(frame)


def test_a_flood_of_pulls_gets_one_answer_per_frame(mosquitto, tiny_bundle, tiny_data,
                                                   monkeypatch):
    monkeypatch.setattr(device_agent, "REPULL_AFTER", 60.0)  # no resend by time in this part
    ds = load_dataset(tiny_data.test)
    present = [int(f) for f in np.flatnonzero(ds.present[:, 0])][:4]
    frame, sentinels = present[0], present[1:]
    settings = DeviceSettings(bundle=tiny_bundle, view=0, broker=mosquitto.url,
                              deployment=DEPLOYMENT, data=tiny_data.test, keepalive=5,
                              reconnect_max=1)
    listener = Listener(mosquitto.url)
    flooder = MqttClient(mosquitto.url, "flooder", MqttOptions(reconnect_max=1)).start()
    try:
        with DeviceService.from_settings(settings) as device:
            assert listener.online.wait(10)  # the device's subscriptions are live
            for f in present:  # pull mode: the features are kept for the edge's pulls
                device.agent.process(f, ds.X[f, 0])
            stats = device.agent.stats

            # 1000 pulls of one frame, then one of another frame: its answer comes after all.
            assert flooder.wait_connected(10)
            for _ in range(1000):
                flooder.publish(TOPICS.requests("edge0"), pull(frame), 1)
            flooder.publish(TOPICS.requests("edge0"), pull(sentinels[0]), 1)
            wait_for(lambda: listener.count(sentinels[0]) == 1, what="the sentinel's features")
            assert listener.count(frame) == 1
            assert stats.pulls_repeated == 999 and stats.pulls_answered == 2

            # After a reconnection (the broker restarted), the edge's re-pull is answered ...
            mosquitto.stop()
            listener.online.clear()
            fresh = start_broker(mosquitto.host, mosquitto.port, prefer="mosquitto")
            mosquitto.proc, mosquitto.workdir = fresh.proc, fresh.workdir
            listener.wait_subscribed()
            assert listener.online.wait(20)  # the device is back, subscribed again
            assert device.transport.client.connects == 2
            assert flooder.wait_connected(20)
            for _ in range(10):
                flooder.publish(TOPICS.requests("edge0"), pull(frame), 1)
            flooder.publish(TOPICS.requests("edge0"), pull(sentinels[1]), 1)
            wait_for(lambda: listener.count(sentinels[1]) == 1, what="the sentinel's features")
            assert listener.count(frame) == 2  # ... once
            assert stats.pulls_repeated == 999 + 9

            # ... and so is a pull repeated after REPULL_AFTER seconds (made 0: that time has
            # passed at once, no sleep).
            monkeypatch.setattr(device_agent, "REPULL_AFTER", 0.0)
            flooder.publish(TOPICS.requests("edge0"), pull(frame), 1)
            flooder.publish(TOPICS.requests("edge0"), pull(sentinels[2]), 1)
            wait_for(lambda: listener.count(sentinels[2]) == 1, what="the sentinel's features")
            assert listener.count(frame) == 3
    finally:
        flooder.stop()
        listener.client.stop()
