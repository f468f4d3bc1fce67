"""A running device: agent, outbox, transport and the sender thread between them.

``DeviceService.run(source)`` replays a source, delivers everything queued, keeps answering
pulls for a grace period, then stops; the CLI and the tests use it alike.
"""

from __future__ import annotations

import logging
import threading
import time

from ddnn.device.agent import DeviceAgent
from ddnn.device.buffer import Outbox

log = logging.getLogger(__name__)


class DeviceService:
    """Wires a :class:`DeviceAgent` to a transport through a bounded :class:`Outbox`."""

    def __init__(self, agent: DeviceAgent, outbox: Outbox, transport):
        self.agent, self.outbox, self.transport = agent, outbox, transport
        self.stop_event = threading.Event()
        self._sender = threading.Thread(target=self._send_loop, name="device-sender", daemon=True)
        self._sender_done = threading.Event()
        self._send_lock = threading.Lock()
        agent.emit = self.deliver

    def _send_loop(self) -> None:
        # Order matters (the edge sees scores before the features they announce): one sender,
        # oldest first, and a message leaves the outbox only once the transport took it.
        while not self._sender_done.is_set():
            msg = self.outbox.peek(timeout=0.1)
            if msg is None:
                continue
            if not self.transport.can_send():
                self._sender_done.wait(0.005)  # broker down or paho's window full: wait a tick
                continue
            with self._send_lock:
                if self.transport.send(msg):
                    self.outbox.pop()

    def deliver(self, msg) -> None:
        """Send at once when nothing older waits (saves a thread hop), else queue in order."""
        with self._send_lock:
            if len(self.outbox) == 0 and self.transport.can_send() and self.transport.send(msg):
                return
        self.outbox.put(msg)

    def start(self) -> DeviceService:
        self.transport.start()
        self._sender.start()
        return self

    def wait_peers(self, devices: list[str], timeout: float) -> bool:
        ok = self.transport.wait_peers(devices, timeout)
        if not ok:
            log.warning("not every peer came online within %.0f s; starting anyway", timeout)
        return ok

    def run(self, source) -> None:
        """Replay ``source``, then drain and linger for pulls; returns when done or stopped."""
        cfg = self.agent.config
        if cfg.wait_peers > 0:
            self.wait_peers(cfg.peers, cfg.wait_peers)
        t0 = time.monotonic()
        self.agent.replay(source, self.stop_event)
        log.info("replayed %d frames in %.2f s", self.agent.stats.frames, time.monotonic() - t0)
        self.drain(cfg.drain_timeout)
        # The edge pulls features of the last frames after it has their scores: keep serving
        # until it has been quiet for the grace period.
        deadline = time.monotonic() + cfg.drain_timeout
        while not self.stop_event.is_set() and time.monotonic() < deadline:
            quiet = self.agent.seconds_since_request()
            if quiet >= cfg.grace and len(self.outbox) == 0:
                break
            self.stop_event.wait(min(0.05, max(cfg.grace - quiet, 0.01)))
        self.drain(cfg.drain_timeout)

    def drain(self, timeout: float) -> bool:
        """Wait until the outbox is empty and the broker acknowledged everything."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self.stop_event.is_set():
            if len(self.outbox) == 0 and self.transport.idle():
                return True
            self.stop_event.wait(0.01)
        left = len(self.outbox)
        if left:
            log.warning("%d messages still undelivered at exit", left)
        return left == 0

    def stop(self) -> None:
        self.stop_event.set()
        self._sender_done.set()
        self._sender.join(timeout=2)
        self.transport.stop()
        s = self.agent.stats
        log.info(
            "device %s done: %d frames (%d absent, %d local exits), sent %s, %d payload + %d "
            "header bytes, pulls answered %d missed %d, bad requests %d, outbox dropped %d",
            self.agent.config.device_id, s.frames, s.absent, s.local_exits, dict(s.sent),
            s.payload_bytes, s.header_bytes, s.pulls_answered, s.pulls_missed, s.bad_requests,
            self.outbox.dropped,
        )
