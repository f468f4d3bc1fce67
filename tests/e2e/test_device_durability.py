"""A device that runs for months unattended: its spool keeps every message until the broker
acknowledged it, so a SIGKILL while the broker is down (or hung) loses no frame.

Real processes: ``ddnn device --spool DIR`` against a real Mosquitto, and a subscriber that
records which frames reach the broker's other side.
"""

from __future__ import annotations

import os
import signal
import threading

import pytest

from ddnn import envelope as env
from ddnn.envelope import DecodeError
from ddnn.plumbing.mqtt import MqttClient, MqttOptions
from ddnn.tools.broker import start_broker
from ddnn.topics import Topics
from tests.support.polling import wait_for
from tests.support.processes import ddnn_process, stop_process

pytestmark = pytest.mark.filterwarnings(
    "ignore:Exception ignored in.*broker.log:pytest.PytestUnraisableExceptionWarning")

DEPLOYMENT = "durable"
N = 120  # frames of tiny_data.test


class Frames:
    """The frames whose scores (or absent message) of one device reach a subscriber."""

    def __init__(self, broker: str, device: str = "cam0"):
        self.topic = Topics(DEPLOYMENT).device(device, "scores")
        self.seen: list[int] = []
        self.probes = 0
        self._lock = threading.Lock()
        self.client = MqttClient(broker, "durability-listener",
                                 MqttOptions(reconnect_max=1, subscriptions=[(self.topic, 1)]),
                                 on_message=self._on)
        self.client.start()

    def _on(self, topic: str, payload: bytes) -> None:
        with self._lock:
            try:
                self.seen.append(env.decode(payload).frame)
            except DecodeError:
                self.probes += 1

    def frames(self) -> set[int]:
        with self._lock:
            return set(self.seen)

    def subscribed(self) -> bool:
        """A probe went through: the (re)subscription is in place."""
        if not self.client.connected.is_set():
            return False
        before = self.probes
        try:
            self.client.publish(self.topic, b"probe", 1).wait_for_publish(2)
            wait_for(lambda: self.probes > before, 2, "the probe")
        except (AssertionError, RuntimeError):
            return False
        return True


def test_a_device_killed_while_the_broker_is_down_loses_no_frame(mosquitto, tiny_bundle,
                                                                 tiny_data, tmp_path):
    listener = Frames(mosquitto.url)
    wait_for(listener.subscribed, 20, "the listener subscribed")
    spool = tmp_path / "spool"
    args = ["device", "--bundle", str(tiny_bundle), "--broker", mosquitto.url, "--view", "0",
            "--data", str(tiny_data.test), "--deployment", DEPLOYMENT, "--wait-peers", "0",
            "--spool", str(spool), "--keepalive", "1", "--reconnect-max", "1", "--grace", "0.5",
            "--max-lag-ms", "0"]  # (every frame delivered, however late: what is tested)
    first = ddnn_process([*args, "--fps", "40"], tmp_path / "device0.log")
    restarted = None
    try:
        wait_for(lambda: len(listener.frames()) >= 20, 60, "20 frames through", [first])
        # The broker hangs: it takes what the device sends and acknowledges nothing. The
        # device's MQTT client holds those messages in memory only; the spool must keep them.
        os.kill(mosquitto.proc.pid, signal.SIGSTOP)
        log = tmp_path / "device0.log"
        wait_for(lambda: f"replayed {N} frames" in log.read_text(), 60, "the replay's end",
                   [first])
        first.kill()  # SIGKILL: no goodbye, nothing flushed
        first.wait()
        missing_at_kill = set(range(N)) - listener.frames()
        mosquitto.proc.kill()  # the broker dies too, with whatever it held
        mosquitto.proc.wait()
        fresh = start_broker(mosquitto.host, mosquitto.port, prefer="mosquitto")
        mosquitto.proc, mosquitto.workdir = fresh.proc, fresh.workdir
        wait_for(listener.subscribed, 30, "the listener back on the new broker")
        # Started again with the same spool, and no frame of its own to replay.
        restarted = ddnn_process([*args, "--fps", "0", "--start", str(N)],
                                 tmp_path / "device1.log")
        assert restarted.wait(60) == 0, (tmp_path / "device1.log").read_text()
        wait_for(lambda: listener.frames() >= set(range(N)), 20, "every frame")
    finally:
        listener.client.stop()
        stop_process(first)
        if restarted is not None:
            stop_process(restarted)
    assert missing_at_kill, "frames were in flight or queued when the device was killed"
    assert listener.frames() == set(range(N)), "every frame reached the subscriber"
    second_log = (tmp_path / "device1.log").read_text()
    assert "unacknowledged messages recovered" in second_log
    assert not list(spool.glob("*.log")), "everything acknowledged: the spool is empty"
