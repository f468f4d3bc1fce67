"""The client: one paho client, its network loop in a background thread.

It adds what the tiers need and paho leaves to the caller: a last will plus a retained
online/offline status (:mod:`~ddnn.plumbing.mqtt.presence`), subscriptions restored on every
reconnect (and a wait for their SUBACKs), reconnection with exponential backoff (paho's own,
started even when the broker is down at start-up), every failed attempt logged (throttled) and
kept for health, a bounded wait for the CONNACK (:mod:`~ddnn.plumbing.mqtt.attempts`), a
refusal for good reported once, and ``connected``/``subscribed`` events.
"""

from __future__ import annotations

import logging
import socket
import ssl
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ddnn.errors import ConfigError
from ddnn.plumbing.mqtt import _paho
from ddnn.plumbing.mqtt.aliases import TopicAliases
from ddnn.plumbing.mqtt.attempts import CONNECT_TIMEOUT, ConnectAttempts
from ddnn.plumbing.mqtt.broker import BrokerUrl, MqttSecurity, tls_context
from ddnn.plumbing.mqtt.errors import (
    REFUSED_FOR_GOOD,
    UNSUPPORTED_PROTOCOL,
    BrokerRefusedError,
    ssl_reason,
)
from ddnn.plumbing.mqtt.inbox import Inbox
from ddnn.plumbing.mqtt.presence import Presence
from ddnn.plumbing.throttle import LogThrottle

log = logging.getLogger("ddnn.plumbing.mqtt")  # one logger for the package (operators filter on it)

SESSION_EXPIRY = 7 * 24 * 3600  # seconds a broker keeps a persistent session of an absent client


@dataclass
class MqttOptions:
    """Connection settings common to both tiers."""

    keepalive: int = 10  # seconds; the broker publishes the last will after 1.5× this silence
    reconnect_min: int = 1  # seconds before the first reconnection attempt (paho: whole seconds)
    reconnect_max: int = 30  # cap of the exponential backoff between attempts
    # Seconds for each step of a connection: TCP, TLS's handshake, the broker's CONNACK. A
    # broker that accepts TCP and never answers CONNECT is given up on after this long.
    connect_timeout: float = CONNECT_TIMEOUT
    max_inflight: int = 100  # unacknowledged QoS 1 messages on the wire at once
    max_queued: int = 100_000  # messages paho holds while disconnected (0 = unbounded)
    # A persistent session (clean_session off): the broker keeps this client's subscriptions
    # and queues its QoS 1 messages while it is away (an edge restart loses nothing), and a
    # handler may leave a message unacknowledged (return False) for the next session to get.
    persistent: bool = False
    # MQTT 5 (topic aliases) or 3.1.1; None: 5 for clean sessions, 3.1.1 for persistent ones.
    # The publishers on a constrained uplink (devices, a gateway) gain from aliases; a
    # persistent session over MQTT 5 needs a session-expiry property in its CONNECT, which a
    # 3.1.1-only broker (amqtt) does not answer at all, so no fallback could follow.
    mqtt5: bool | None = None
    subscriptions: list[tuple[str, int]] = field(default_factory=list)
    security: MqttSecurity = field(default_factory=MqttSecurity)


def _import_paho():
    try:
        import paho.mqtt.client as paho
    except ImportError:
        raise ConfigError(
            "paho-mqtt is not installed; install ddnn[device] or ddnn[edge]") from None
    return paho


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
        on_message: Callable[[str, bytes], bool | None] | None = None,
        on_connect: Callable[[], None] | None = None,
        on_disconnect: Callable[[], None] | None = None,
        on_refused: Callable[[BrokerRefusedError], None] | None = None,
        on_published: Callable[[int], None] | None = None,
        on_publish_refused: Callable[[int], None] | None = None,
    ):
        self._paho = _import_paho()
        self.url = BrokerUrl.parse(url)
        self.options = options or MqttOptions()
        self.connected = threading.Event()
        # The retained status (online, offline, the last will), its fields changed by callers.
        self.presence = Presence(status_topic, status_info, self.publish, self.connected)
        self._on_message = on_message
        self._on_connect_cb = on_connect
        self._on_disconnect_cb = on_disconnect
        self.on_refused = on_refused  # called once, from paho's thread, on a refusal for good
        self._on_published = on_published  # (mid) of each acknowledged publish, paho's thread
        # (mid) of a publish the broker answered with a failure (MQTT 5: not authorized, ...);
        # without this hook such a publish counts as acknowledged, after a warning.
        self._on_publish_refused = on_publish_refused
        self.refused: BrokerRefusedError | None = None
        # Set once the broker acknowledged every subscription of the current connection: a
        # message published before that may never reach this client.
        self.subscribed = threading.Event()
        self._unacked_subscriptions: set[int] = set()
        self.connects = 0  # successful connections, reconnections included
        # When the broker was lost (monotonic), or the client made; None while connected.
        self.disconnected_since: float | None = time.monotonic()
        self.publishes_refused = 0
        self._refusals_log = LogThrottle(every=1000)  # the first, then one in a thousand
        self._stopping = False
        self._tls_alert: str | None = None
        self._aliases = TopicAliases()
        o = self.options
        # Every failed attempt to connect: counted, its reason kept (health), logged throttled.
        self.attempts = ConnectAttempts(self.url, o.connect_timeout,
                                        f"retrying with backoff ({o.reconnect_min} s doubling "
                                        f"to {o.reconnect_max} s)")
        persistent = self.options.persistent
        self.mqtt5 = not persistent if self.options.mqtt5 is None else self.options.mqtt5
        self._client = self._paho_client(client_id)

    def _paho_client(self, client_id: str):
        """The paho client, with credentials, TLS, limits, the last will and the callbacks."""
        paho, sec, o = self._paho, self.options.security, self.options
        if self.mqtt5:
            c = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=client_id,
                            protocol=paho.MQTTv5, manual_ack=o.persistent)
        else:
            c = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=client_id,
                            protocol=paho.MQTTv311, clean_session=not o.persistent,
                            manual_ack=o.persistent)
        username, password = sec.credentials(self.url)
        if username:
            c.username_pw_set(username, password)
        self.username = username
        sec.check(self.url)
        if self.url.tls:
            c.tls_set_context(tls_context(sec))
        c.max_inflight_messages_set(o.max_inflight)
        c.max_queued_messages_set(o.max_queued)
        c.reconnect_delay_set(o.reconnect_min, o.reconnect_max)
        c.connect_timeout = o.connect_timeout  # TCP and TLS (paho's default: 5 s)
        self.presence.will(c)
        c.on_connect = self._handle_connect
        c.on_disconnect = self._handle_disconnect
        # What arrives, on to on_message (``inbox.delivering``, ``inbox.ack`` for a
        # persistent session's handler that acknowledges later).
        self.inbox = Inbox(c, self._on_message, o.persistent)
        c.on_message = self.inbox.deliver
        c.on_connect_fail = self._handle_connect_fail
        c.on_socket_open = lambda client, userdata, sock: self.attempts.opened(sock)
        c.on_subscribe = self._handle_subscribe
        if self.url.tls:  # with on_log set, paho formats a log line for every packet
            c.on_log = self._handle_log
        if self._on_published is not None:
            c.on_publish = self._handle_publish
        return c

    # --- paho callbacks (network thread) ----------------------------------------------------

    def _refuse(self, message: str) -> None:
        """Give up for good: one clear log line, no more reconnection attempts."""
        if self.refused is not None:
            return
        self.refused = BrokerRefusedError(message)
        log.error("%s; not retrying", message)
        # End paho's loop instead of reconnecting forever. Called from paho's own thread,
        # loop_stop() only flags the loop to end (disconnect() alone is undone when paho is
        # handling a lost connection).
        self._client.disconnect()
        self._client.loop_stop()
        if self.on_refused:
            self.on_refused(self.refused)

    def _handle_connect_fail(self, client, userdata) -> None:
        # paho calls this inside its `except OSError` around the connection attempt.
        error = sys.exc_info()[1]
        if isinstance(error, ssl.SSLCertVerificationError):
            self._refuse(f"TLS: the certificate of broker {self.url} is not trusted "
                         f"({error.verify_message}); check --ca-file and the broker's host name")
        elif isinstance(error, ssl.SSLError) and not isinstance(
                error, ssl.SSLEOFError | ssl.SSLZeroReturnError):
            self._refuse(f"TLS handshake with broker {self.url} failed: {ssl_reason(error)}")
        elif error is not None:
            self.attempts.failed(f"cannot connect to broker {self.url} ({error})")

    def _handle_log(self, client, userdata, level, message: str) -> None:
        # With TLS 1.3 the broker checks our certificate after the handshake, and says no with a
        # TLS alert on the first read; paho only logs that, so it is caught here.
        if level == self._paho.MQTT_LOG_ERR and "alert" in message.lower() and self.url.tls:
            self._tls_alert = message

    def _handle_connect(self, client, userdata, flags, reason_code, properties) -> None:
        self.attempts.answered()
        if reason_code.value == UNSUPPORTED_PROTOCOL and client.protocol == self._paho.MQTTv5:
            # The broker speaks MQTT 3.1.1 only: connect again with it (paho reconnects).
            log.info("broker %s does not speak MQTT 5; using 3.1.1 (no topic aliases)", self.url)
            _paho.set_protocol(client, self._paho.MQTTv311,
                               clean_session=not self.options.persistent)
            return
        if reason_code.is_failure:
            why = REFUSED_FOR_GOOD.get(reason_code.value)
            if why:
                user = f" user {self.username!r}" if self.username else " (no username)"
                self._refuse(f"broker {self.url} refused the connection: {why}{user}")
            else:
                self.attempts.failed(f"broker {self.url} refused the connection ({reason_code})")
            return
        self._tls_alert = None
        failures = self.attempts.succeeded()
        self.connects += 1
        self.disconnected_since = None
        self._aliases.connected(getattr(properties, "TopicAliasMaximum", 0), client)
        sock = client.socket()
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            # paho leaves Nagle on: small messages would wait for delayed ACKs (~40 ms).
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        mids = {client.subscribe(topic, qos)[1] for topic, qos in self.options.subscriptions}
        self._unacked_subscriptions = mids
        if not mids:
            self.subscribed.set()
        self.presence.online(client)
        log.info("connected to %s%s%s", self.url, " (reconnected)" if self.connects > 1 else "",
                 f" after {failures} failed attempts" if failures else "")
        self.connected.set()
        if self._on_connect_cb:
            self._on_connect_cb()

    def _handle_disconnect(self, client, userdata, flags, reason_code, properties) -> None:
        was = self.connected.is_set()
        self.connected.clear()
        self.subscribed.clear()
        # Until the next CONNACK no alias is known: paho may send on the new socket before it.
        self._aliases.disconnected()
        if was:
            self.disconnected_since = time.monotonic()
        alert, self._tls_alert = self._tls_alert, None
        if alert and not was and not self._stopping:
            self._refuse(f"broker {self.url} refused this client's TLS certificate "
                         f"({ssl_reason(alert)}); check --cert-file, --key-file and their "
                         "expiry")
        if was and not self._stopping:
            log.warning("lost the broker %s (%s); reconnecting with backoff", self.url, reason_code)
        elif not was and not self._stopping and self.refused is None:
            self.attempts.ended(f"the connection to broker {self.url} ended before its CONNACK "
                                f"({reason_code})")
        if self._on_disconnect_cb:
            self._on_disconnect_cb()

    def _handle_subscribe(self, client, userdata, mid, reason_codes, properties) -> None:
        self._unacked_subscriptions.discard(mid)
        if not self._unacked_subscriptions and self.connected.is_set():
            self.subscribed.set()

    def _handle_publish(self, client, userdata, mid, reason_code, properties) -> None:
        # Called by paho with its message lock held: the hooks must only record the mid.
        if getattr(reason_code, "is_failure", False):
            self.publishes_refused += 1
            if self._refusals_log():
                log.warning("broker %s refused a publish (%s; %d so far): check this client's "
                            "ACL", self.url, reason_code, self.publishes_refused)
            if self._on_publish_refused is not None:
                self._on_publish_refused(mid)
                return
        self._on_published(mid)  # type: ignore[misc]

    # --- public API -------------------------------------------------------------------------

    def start(self) -> MqttClient:
        """Connect in the background; paho retries with backoff until the broker answers."""
        args = {}
        if self.mqtt5:
            from paho.mqtt.packettypes import PacketTypes
            from paho.mqtt.properties import Properties

            args["clean_start"] = not self.options.persistent
            if self.options.persistent:  # MQTT 5 ends a session at disconnection by default
                props = Properties(PacketTypes.CONNECT)
                props.SessionExpiryInterval = SESSION_EXPIRY
                args["properties"] = props
        self._client.connect_async(self.url.host, self.url.port, self.options.keepalive, **args)
        self._client.loop_start()
        return self

    def wait_connected(self, timeout: float) -> bool:
        """True once connected; raises :class:`BrokerRefusedError` after a refusal for good."""
        deadline = time.monotonic() + timeout
        while not self.connected.wait(min(0.05, max(deadline - time.monotonic(), 0))):
            if self.refused is not None:
                raise self.refused
            if time.monotonic() >= deadline:
                return False
        return True

    def wait_subscribed(self, timeout: float) -> bool:
        """True once connected and every subscription acknowledged by the broker (SUBACK)."""
        deadline = time.monotonic() + timeout
        if not self.wait_connected(timeout):
            return False
        return self.subscribed.wait(max(deadline - time.monotonic(), 0))

    def publish(self, topic: str, payload: bytes, qos: int = 1, retain: bool = False):
        """Queue a message; paho sends it now or after the next reconnection (QoS ≥ 1)."""
        with self._aliases.lock:  # the alias is set up on the wire before it is used
            wire_topic, props = self._aliases.use(topic)
            info = self._client.publish(wire_topic, payload, qos, retain, props)
        if info.rc not in (self._paho.MQTT_ERR_SUCCESS, self._paho.MQTT_ERR_NO_CONN):
            log.warning("publish to %s failed: %s", topic, self._paho.error_string(info.rc))
        return info

    def alive(self) -> bool:
        """paho's network thread runs (it ends only on :meth:`stop` or a refusal for good)."""
        return _paho.network_thread_alive(self._client)

    def queued(self, info) -> bool:
        """Whether paho took the message of :meth:`publish`'s ``info`` (sent now, or kept for
        after the reconnection)."""
        return info.rc in (self._paho.MQTT_ERR_SUCCESS, self._paho.MQTT_ERR_NO_CONN)

    def pending(self) -> int:
        """Messages paho still holds (sent but unacknowledged, or queued)."""
        return _paho.stored_count(self._client)

    def stop(self, timeout: float = 2.0) -> None:
        """Publish the offline status (when connected), flush and disconnect."""
        self._stopping = True
        self.attempts.stop()
        was_connected = self.connected.is_set()
        if was_connected:
            self.presence.offline(self._client, timeout)
        self._client.disconnect()
        # Bounded: paho's own loop_stop() waits for its thread however long it is inside a
        # connection attempt (TCP and TLS take up to connect_timeout each) or its backoff's
        # sleep (a second at a time), and a stopping process must not (SIGTERM ends a device
        # within 2 s). Without a connection there is nothing to flush: the daemon is left.
        if not _paho.stop_loop(self._client, timeout if was_connected else 0.1):
            log.debug("paho's thread is still inside a connection attempt; not waiting for it")
        self.connected.clear()
        self.subscribed.clear()
