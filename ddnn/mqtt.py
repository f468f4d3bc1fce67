"""A small wrapper over paho-mqtt shared by the device agent and the edge aggregator.

It adds what both tiers need and paho leaves to the caller: broker URLs, a last will plus a
retained online/offline status, subscriptions restored on every reconnect, reconnection with
exponential backoff (paho's own, started even when the broker is down at start-up), and a
``connected`` event. paho is imported when a client is made, so :mod:`ddnn` stays numpy-only.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ddnn.errors import ConfigError, DdnnError

log = logging.getLogger(__name__)

QOS_SCORES = 1  # a lost score message makes the edge wait for the deadline, then fuse without it
QOS_FEATURES = 1  # a lost feature message degrades the frame's edge exit
QOS_REQUESTS = 1  # a lost pull stalls a frame until the feature deadline
QOS_RESULTS = 1  # results are the product; applications must not miss one
QOS_STATUS = 1  # retained, so late subscribers learn who is alive


class MqttError(DdnnError):
    """The broker cannot be used (bad URL, connection refused for good, timeout)."""


@dataclass(frozen=True)
class BrokerUrl:
    """``mqtt://[user[:password]@]host[:port]`` (``mqtts://`` for TLS, port 8883 by default)."""

    host: str
    port: int = 1883
    tls: bool = False
    username: str | None = None
    password: str | None = None

    @classmethod
    def parse(cls, url: str) -> BrokerUrl:
        u = urllib.parse.urlsplit(url if "://" in url else f"mqtt://{url}")
        if u.scheme not in ("mqtt", "mqtts", "tcp", "ssl"):
            raise ConfigError(f"broker URL {url!r}: scheme must be mqtt:// or mqtts://")
        tls = u.scheme in ("mqtts", "ssl")
        try:
            port = u.port or (8883 if tls else 1883)
        except ValueError:
            raise ConfigError(f"broker URL {url!r}: invalid port") from None
        if not u.hostname:
            raise ConfigError(f"broker URL {url!r}: no host")
        user = urllib.parse.unquote(u.username) if u.username else None
        pw = urllib.parse.unquote(u.password) if u.password else None
        return cls(u.hostname, port, tls, user, pw)

    def __str__(self) -> str:  # never log the password
        scheme = "mqtts" if self.tls else "mqtt"
        user = f"{self.username}@" if self.username else ""
        return f"{scheme}://{user}{self.host}:{self.port}"


def status_payload(state: str, **info: Any) -> bytes:
    """The JSON body of a retained status message: ``{"state": "online"|"offline", ...}``."""
    return json.dumps({"state": state, **info, "ts": round(time.time(), 3)}).encode()


def parse_status(payload: bytes) -> str | None:
    """``"online"``/``"offline"`` from a status body (JSON or the bare word), else ``None``."""
    state = status_info(payload).get("state")
    return state if state in ("online", "offline") else None


def status_info(payload: bytes) -> dict[str, Any]:
    """The fields of a status body (``{"state": ...}`` for the bare word; ``{}`` if unreadable)."""
    text = payload.decode("utf-8", "replace").strip()
    if text in ("online", "offline"):
        return {"state": text}
    try:
        info = json.loads(text)
    except ValueError:
        return {}
    return info if isinstance(info, dict) else {}


@dataclass
class MqttOptions:
    """Connection settings common to both tiers."""

    keepalive: int = 10  # seconds; the broker publishes the last will after 1.5× this silence
    reconnect_min: int = 1  # seconds before the first reconnection attempt (paho: whole seconds)
    reconnect_max: int = 30  # cap of the exponential backoff between attempts
    max_inflight: int = 100  # unacknowledged QoS 1 messages on the wire at once
    max_queued: int = 100_000  # messages paho holds while disconnected (0 = unbounded)
    subscriptions: list[tuple[str, int]] = field(default_factory=list)


class MqttClient:
    """One paho client running its network loop in a background thread."""

    def __init__(
        self,
        url: str,
        client_id: str,
        options: MqttOptions | None = None,
        *,
        status_topic: str | None = None,
        status_info: dict[str, Any] | None = None,
        on_message: Callable[[str, bytes], None] | None = None,
        on_connect: Callable[[], None] | None = None,
        on_disconnect: Callable[[], None] | None = None,
    ):
        try:
            import paho.mqtt.client as paho
        except ImportError:
            raise ConfigError(
                "paho-mqtt is not installed; install ddnn[device] or ddnn[edge]") from None
        self.url = BrokerUrl.parse(url)
        self.options = options or MqttOptions()
        self.status_topic = status_topic
        self.status_info = status_info or {}
        self._on_message = on_message
        self._on_connect_cb = on_connect
        self._on_disconnect_cb = on_disconnect
        self.connected = threading.Event()
        self.connects = 0  # successful connections, reconnections included
        self.publish_failures = 0
        self._stopping = False
        self._client = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=client_id,
                                   protocol=paho.MQTTv311, clean_session=True)
        c = self._client
        if self.url.username:
            c.username_pw_set(self.url.username, self.url.password)
        if self.url.tls:
            c.tls_set()
        c.max_inflight_messages_set(self.options.max_inflight)
        c.max_queued_messages_set(self.options.max_queued)
        c.reconnect_delay_set(self.options.reconnect_min, self.options.reconnect_max)
        if status_topic:
            c.will_set(status_topic, status_payload("offline", **self.status_info), QOS_STATUS,
                       retain=True)
        c.on_connect = self._handle_connect
        c.on_disconnect = self._handle_disconnect
        c.on_message = self._handle_message
        self._paho = paho

    # --- paho callbacks (network thread) ----------------------------------------------------

    def _handle_connect(self, client, userdata, flags, reason_code, properties) -> None:
        if reason_code.is_failure:
            log.warning("broker %s refused the connection: %s", self.url, reason_code)
            return
        self.connects += 1
        sock = client.socket()
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            # paho leaves Nagle on: small messages would wait for delayed ACKs (~40 ms).
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for topic, qos in self.options.subscriptions:
            client.subscribe(topic, qos)
        if self.status_topic:
            client.publish(self.status_topic, status_payload("online", **self.status_info),
                           QOS_STATUS, retain=True)
        log.info("connected to %s%s", self.url, " (reconnected)" if self.connects > 1 else "")
        self.connected.set()
        if self._on_connect_cb:
            self._on_connect_cb()

    def _handle_disconnect(self, client, userdata, flags, reason_code, properties) -> None:
        was = self.connected.is_set()
        self.connected.clear()
        if was and not self._stopping:
            log.warning("lost the broker %s (%s); reconnecting with backoff", self.url, reason_code)
        if self._on_disconnect_cb:
            self._on_disconnect_cb()

    def _handle_message(self, client, userdata, msg) -> None:
        if self._on_message is None:
            return
        try:
            self._on_message(msg.topic, msg.payload)
        except Exception:  # a handler bug must not kill paho's network thread
            log.exception("message handler failed on %s", msg.topic)

    # --- public API -------------------------------------------------------------------------

    def start(self) -> MqttClient:
        """Connect in the background; paho retries with backoff until the broker answers."""
        self._client.connect_async(self.url.host, self.url.port, self.options.keepalive)
        self._client.loop_start()
        return self

    def wait_connected(self, timeout: float) -> bool:
        return self.connected.wait(timeout)

    def publish(self, topic: str, payload: bytes, qos: int = 1, retain: bool = False):
        """Queue a message; paho sends it now or after the next reconnection (QoS ≥ 1)."""
        info = self._client.publish(topic, payload, qos, retain)
        if info.rc not in (self._paho.MQTT_ERR_SUCCESS, self._paho.MQTT_ERR_NO_CONN):
            self.publish_failures += 1
            log.warning("publish to %s failed: %s", topic, self._paho.error_string(info.rc))
        return info

    def set_on_publish(self, callback: Callable[[int], None]) -> None:
        """Call ``callback(mid)`` when the broker acknowledged a message."""
        self._client.on_publish = lambda client, userdata, mid, rc, props: callback(mid)

    def pending(self) -> int:
        """Messages paho still holds (sent but unacknowledged, or queued)."""
        return len(self._client._out_messages)  # paho has no public accessor for this

    def stop(self, timeout: float = 2.0) -> None:
        """Publish the offline status (when connected), flush and disconnect."""
        self._stopping = True
        if self.status_topic and self.connected.is_set():
            info = self._client.publish(self.status_topic,
                                        status_payload("offline", **self.status_info),
                                        QOS_STATUS, retain=True)
            # Lost the connection meanwhile (RuntimeError/ValueError): the last will says it.
            with contextlib.suppress(RuntimeError, ValueError):
                info.wait_for_publish(timeout)
        self._client.disconnect()
        self._client.loop_stop()
        self.connected.clear()
