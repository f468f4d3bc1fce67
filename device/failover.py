"""A device with both ``--broker`` and ``--edge-url``: MQTT while the broker can be reached, the
edge's HTTP(S) ingest while it cannot.

The broker stays the uplink until it has been unreachable for ``--failover-after`` seconds;
then messages go over HTTP, and back over MQTT as soon as the broker takes them again. One
sender, oldest message first, whichever the path: a message leaves the outbox once one path
took it, so it is sent over one path only. What paho held unacknowledged when the broker went
away stays with paho (it sends it again on reconnection; with the spool it is on disk too):
never sent over HTTP as well, so the edge sees each message once from this device, and its
duplicate filter covers the at-least-once cases (a restart that recovers the spool).

Over MQTT the topic names the device and its deployment, and its retained status its model, so
an envelope there leaves them out (:mod:`ddnn.envelope`); the HTTP channel names nobody, so a
message that goes there carries that identity (added on the way: the outbox keeps what MQTT
takes).

The HTTP path has no channel for the edge's feature pulls, so such a device runs in push mode
(:func:`ddnn.device.service.for_bundle`). Peers, the agreed replay start, retained statuses and
over-the-air updates stay with MQTT.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from ddnn import envelope as env
from ddnn.device.message import OutMessage, Receipt
from ddnn.device.transport import HttpTransport, MqttTransport

log = logging.getLogger(__name__)


class FailoverTransport:
    """MQTT, failing over to HTTP after ``after`` seconds without the broker, and back.

    ``identity()``: the model name, deployment and device id that a message sent over HTTP
    carries (:meth:`ddnn.envelope.Envelope.bound`).
    """

    def __init__(self, mqtt: MqttTransport, http: HttpTransport, after: float,
                 identity: Callable[[], dict[str, str]]):
        self.mqtt, self.http, self.after = mqtt, http, after
        self._identity = identity
        self.via = "mqtt"  # the path messages take now
        self.sent = {"mqtt": 0, "http": 0}  # messages each path took
        self.failovers = 0  # times the HTTP path took over

    # --- choosing the path (the sender's thread) ---------------------------------------------

    def _choose(self) -> MqttTransport | HttpTransport:
        if self.mqtt.connected:
            if self.via == "http":
                log.info("broker %s reachable again: back to MQTT (%d messages went over "
                         "HTTP)", self.mqtt.client.url, self.sent["http"])
                self.via = "mqtt"
        elif self.via == "mqtt" and (self.mqtt.down_for() or 0.0) >= self.after:
            self.via = "http"
            self.failovers += 1
            log.warning("broker %s unreachable for %.1f s (%s): failing over to the edge's "
                        "HTTP ingest %s", self.mqtt.client.url, self.mqtt.down_for() or 0.0,
                        self.mqtt.last_error() or "disconnected", self.http.describe()["edge"])
        return self.http if self.via == "http" else self.mqtt

    @property
    def active(self) -> MqttTransport | HttpTransport:
        return self.http if self.via == "http" else self.mqtt

    def can_send(self) -> bool:
        return self._choose().can_send()

    def send(self, msg: OutMessage) -> Receipt | bool | None:
        """Over the path :meth:`can_send` chose (the sender calls them in turn, under its
        lock); a path that cannot take it now leaves it in the outbox."""
        via = self.via
        if via == "http" and msg.kind != "results":  # (a result is JSON that names its views)
            msg = OutMessage(msg.kind, env.encode(env.decode(msg.payload).bound(
                **self._identity())), msg.frame)
        receipt = self.active.send(msg)
        if receipt:
            self.sent[via] += 1
        return receipt

    # --- the rest follows MQTT, or the path in use ---------------------------------------------

    @property
    def client(self):
        return self.mqtt.client

    @property
    def connected(self) -> bool:
        return self.active.connected

    def start(self) -> None:
        self.mqtt.start()

    def stop(self) -> None:
        self.mqtt.stop()
        self.http.stop()

    def alive(self) -> bool:
        return self.mqtt.alive()

    def idle(self) -> bool:
        """Everything handed over was acknowledged; on HTTP, what paho holds waits for the
        broker (and in the spool), not for this process's exit."""
        return self.mqtt.idle() if self.via == "mqtt" else self.http.idle()

    def update_status(self, **info) -> None:
        self.mqtt.update_status(**info)

    def wait_peers(self, devices: list[str], timeout: float, stop: threading.Event) -> bool:
        return self.mqtt.wait_peers(devices, timeout, stop)

    def agreed_start(self, devices: list[str]) -> float | None:
        return self.mqtt.agreed_start(devices)

    def down_for(self) -> float | None:
        """Seconds the uplink has been lost: the broker's outage until the HTTP path takes
        over, then the HTTP path's (None while it works)."""
        if self.via == "http":
            return self.http.down_for()
        down = self.mqtt.down_for()
        if down is not None and down >= self.after:  # failing over at the next message
            return self.http.down_for()
        return down

    def last_error(self) -> str | None:
        return self.active.last_error()

    def describe(self) -> dict:
        return {"via": self.via, "failover_after": self.after, "failovers": self.failovers,
                "sent": dict(self.sent), "mqtt": self.mqtt.describe(),
                "http": self.http.describe(), "connected": self.connected,
                "last_error": self.last_error()}
