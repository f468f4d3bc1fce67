"""A small wrapper over paho-mqtt shared by the device agent and the edge aggregator.

It adds what both tiers need and paho leaves to the caller: broker URLs, a last will plus a
retained online/offline status, subscriptions restored on every reconnect, reconnection with
exponential backoff (paho's own, started even when the broker is down at start-up), and a
``connected`` event. paho is imported when a client is made, so :mod:`ddnn` stays numpy-only.

MQTT 5 when the broker speaks it (else 3.1.1, found out at the first connection): then each
topic a client publishes on is sent once per connection and a two-byte topic alias after that
(a device's topic is 32 bytes; its score message 16). Persistent sessions (the edge) stay on
3.1.1, whose sessions never expire by themselves.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import ssl
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ddnn.errors import ConfigError, DdnnError
from ddnn.plumbing.options import Option

log = logging.getLogger(__name__)

QOS_SCORES = 1  # a lost score message makes the edge wait for the deadline, then fuse without it
QOS_FEATURES = 1  # a lost feature message degrades the frame's edge exit
# A pull is lost only with the device's connection, and the edge pulls again when the device
# is back online (the frame waits for its features meanwhile); QoS 1 would cost every device a
# PUBACK up the constrained link for every pull.
QOS_REQUESTS = 0
QOS_RESULTS = 1  # results are the product; applications must not miss one
QOS_STATUS = 1  # retained, so late subscribers learn who is alive


class MqttError(DdnnError):
    """The broker cannot be used (bad URL, connection refused for good, timeout)."""


class BrokerRefusedError(MqttError):
    """A refusal that retrying cannot fix: bad credentials, not authorized, or a certificate that
    one side would not accept. The client stops reconnecting and reports it once."""

    exit_code = 78  # EX_CONFIG: systemd units can skip restarting (RestartPreventExitStatus=78)


# CONNACK reason codes (MQTT 5 numbering; paho maps 3.1.1's 4 and 5 onto them) that no retry fixes.
_REFUSED_FOR_GOOD = {134: "bad user name or password", 135: "not authorized",
                     133: "client identifier not valid", 138: "banned"}


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


def status_fields(payload: bytes) -> dict[str, Any]:
    """The fields of a status body (``{"state": ...}`` for the bare word; ``{}`` if unreadable)."""
    text = payload.decode("utf-8", "replace").strip()
    if text in ("online", "offline"):
        return {"state": text}
    try:
        info = json.loads(text)
    except ValueError:
        return {}
    return info if isinstance(info, dict) else {}


@dataclass(frozen=True, kw_only=True)
class MqttSecurity:
    """TLS files and credentials; each overrides what the broker URL says.

    TLS needs an ``mqtts://`` URL. The broker's certificate is always verified (chain and host
    name) against ``ca_file``, or the system's CAs without it; there is no insecure mode.
    """

    ca_file: str | None = None  # CA certificate(s) the broker's certificate must chain to
    cert_file: str | None = None  # this client's certificate (PEM), for brokers requiring one
    key_file: str | None = None  # its private key (PEM); default: inside cert_file
    username: str | None = None
    password: str | None = field(default=None, repr=False)  # never printed

    def describe(self) -> str:
        """For start-up logs: which files and user, never the password."""
        parts = [f"{k}={v}" for k, v in (("ca", self.ca_file), ("cert", self.cert_file),
                                          ("user", self.username)) if v]
        if self.password:
            parts.append("password=***")
        return " ".join(parts) or "none"


class _ClosingSSLSocket(ssl.SSLSocket):
    """Closes itself when the handshake fails: paho leaves the socket open, for the collector."""

    def do_handshake(self, *args, **kwargs):
        try:
            return super().do_handshake(*args, **kwargs)
        except BaseException:
            self.close()
            raise


def tls_context(security: MqttSecurity) -> ssl.SSLContext:
    """A client TLS context verifying the broker against ``ca_file`` (or the system CAs)."""
    try:
        ctx = ssl.create_default_context(cafile=security.ca_file)
        ctx.sslsocket_class = _ClosingSSLSocket
        if security.cert_file:
            ctx.load_cert_chain(security.cert_file, security.key_file)
    except (OSError, ssl.SSLError) as e:  # FileNotFoundError, a PEM that does not parse
        which = ", ".join(f for f in (security.ca_file, security.cert_file, security.key_file)
                          if f)
        raise ConfigError(f"cannot load the MQTT TLS files ({which}): {e}") from None
    return ctx


# The MQTT TLS and credential rows of the device's and the edge's options tables; the
# settings classes have fields of these names and build :class:`MqttSecurity` from them.
SECURITY_OPTIONS = (
    Option("ca-file", str, "FILE",
           "CA certificate (PEM) the broker's certificate must chain to (needs mqtts://)"),
    Option("cert-file", str, "FILE", "client certificate (PEM) for brokers that require one"),
    Option("key-file", str, "FILE", "private key (PEM) of --cert-file"),
    Option("username", str, "NAME", "MQTT username (overrides the URL's)"),
    Option("password", str, "TEXT", "MQTT password; prefer the environment variable (never "
                                    "logged)", secret=True),
)


def security_of(settings) -> MqttSecurity:
    """:class:`MqttSecurity` from settings that have the :data:`SECURITY_OPTIONS` fields."""
    return MqttSecurity(ca_file=settings.ca_file, cert_file=settings.cert_file,
                        key_file=settings.key_file, username=settings.username,
                        password=settings.password)


@dataclass
class MqttOptions:
    """Connection settings common to both tiers."""

    keepalive: int = 10  # seconds; the broker publishes the last will after 1.5× this silence
    reconnect_min: int = 1  # seconds before the first reconnection attempt (paho: whole seconds)
    reconnect_max: int = 30  # cap of the exponential backoff between attempts
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
        self.on_refused = on_refused  # called once, from paho's thread, on a refusal for good
        self.refused: BrokerRefusedError | None = None
        self.connected = threading.Event()
        # Set once the broker acknowledged every subscription of the current connection: a
        # message published before that may never reach this client.
        self.subscribed = threading.Event()
        self._unacked_subscriptions: set[int] = set()
        self.connects = 0  # successful connections, reconnections included
        # When the broker was lost (monotonic), or the client made; None while connected.
        self.disconnected_since: float | None = time.monotonic()
        self._on_published = on_published  # (mid) of each acknowledged publish, paho's thread
        # (mid) of a publish the broker answered with a failure (MQTT 5: not authorized, ...);
        # without this hook such a publish counts as acknowledged, after a warning.
        self._on_publish_refused = on_publish_refused
        self.publishes_refused = 0
        self.delivering: tuple[int, int] = (0, 0)  # (mid, qos) of the message being handled
        self._stopping = False
        persistent = self.options.persistent
        self.mqtt5 = not persistent if self.options.mqtt5 is None else self.options.mqtt5
        if self.mqtt5:
            self._client = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=client_id,
                                       protocol=paho.MQTTv5, manual_ack=persistent)
        else:
            self._client = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=client_id,
                                       protocol=paho.MQTTv311, clean_session=not persistent,
                                       manual_ack=persistent)
        self._aliases = TopicAliases()
        c = self._client
        sec = self.options.security
        username = sec.username if sec.username is not None else self.url.username
        password = sec.password if sec.password is not None else self.url.password
        if password and not username:
            raise ConfigError("an MQTT password needs a username (--username)")
        if username:
            c.username_pw_set(username, password)
        self.username = username
        if sec.key_file and not sec.cert_file:
            raise ConfigError("--key-file needs --cert-file")
        if (sec.ca_file or sec.cert_file) and not self.url.tls:
            raise ConfigError(f"TLS files are set but the broker URL {self.url} is not TLS: "
                              "use mqtts://host:8883")
        if self.url.tls:
            c.tls_set_context(tls_context(sec))
        c.max_inflight_messages_set(self.options.max_inflight)
        c.max_queued_messages_set(self.options.max_queued)
        c.reconnect_delay_set(self.options.reconnect_min, self.options.reconnect_max)
        if status_topic:
            c.will_set(status_topic, status_payload("offline", **self.status_info), QOS_STATUS,
                       retain=True)
        c.on_connect = self._handle_connect
        c.on_disconnect = self._handle_disconnect
        c.on_message = self._handle_message
        c.on_connect_fail = self._handle_connect_fail
        c.on_subscribe = self._handle_subscribe
        if self.url.tls:  # with on_log set, paho formats a log line for every packet
            c.on_log = self._handle_log
        if on_published is not None:
            c.on_publish = self._handle_publish
        self._tls_alert: str | None = None
        self._paho = paho

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
            self._refuse(f"TLS handshake with broker {self.url} failed: {_ssl_reason(error)}")
        elif error is not None:
            log.debug("cannot reach broker %s (%s); retrying", self.url, error)

    def _handle_log(self, client, userdata, level, message: str) -> None:
        # With TLS 1.3 the broker checks our certificate after the handshake, and says no with a
        # TLS alert on the first read; paho only logs that, so it is caught here.
        if level == self._paho.MQTT_LOG_ERR and "alert" in message.lower() and self.url.tls:
            self._tls_alert = message

    def _handle_connect(self, client, userdata, flags, reason_code, properties) -> None:
        if reason_code.value == _UNSUPPORTED_PROTOCOL and client.protocol == self._paho.MQTTv5:
            self._downgrade()
            return
        if reason_code.is_failure:
            why = _REFUSED_FOR_GOOD.get(reason_code.value)
            if why:
                user = f" user {self.username!r}" if self.username else " (no username)"
                self._refuse(f"broker {self.url} refused the connection: {why}{user}")
            else:
                log.warning("broker %s refused the connection: %s", self.url, reason_code)
            return
        self._tls_alert = None
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
        if self.status_topic:
            client.publish(self.status_topic, status_payload("online", **self.status_info),
                           QOS_STATUS, retain=True)
        log.info("connected to %s%s", self.url, " (reconnected)" if self.connects > 1 else "")
        self.connected.set()
        if self._on_connect_cb:
            self._on_connect_cb()

    def _downgrade(self) -> None:
        """The broker speaks MQTT 3.1.1 only: connect again with it (paho reconnects)."""
        log.info("broker %s does not speak MQTT 5; using 3.1.1 (no topic aliases)", self.url)
        c = self._client
        # paho has no public way to change the protocol of a client; these two fields are
        # what its CONNECT packet is built from.
        c._protocol = self._paho.MQTTv311
        c._clean_session = not self.options.persistent

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
                         f"({_ssl_reason(alert)}); check --cert-file, --key-file and their "
                         "expiry")
        if was and not self._stopping:
            log.warning("lost the broker %s (%s); reconnecting with backoff", self.url, reason_code)
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
            if self.publishes_refused == 1 or self.publishes_refused % 1000 == 0:
                log.warning("broker %s refused a publish (%s; %d so far): check this client's "
                            "ACL", self.url, reason_code, self.publishes_refused)
            if self._on_publish_refused is not None:
                self._on_publish_refused(mid)
                return
        self._on_published(mid)  # type: ignore[misc]

    def _handle_message(self, client, userdata, msg) -> None:
        handled = None
        self.delivering = (msg.mid, msg.qos)  # for a handler that acknowledges later
        try:
            if self._on_message is not None:
                handled = self._on_message(msg.topic, msg.payload)
        except Exception:  # a handler bug must not kill paho's network thread
            log.exception("message handler failed on %s", msg.topic)
        # Persistent sessions acknowledge by hand: a message the handler declined (False) stays
        # unacknowledged, so the broker delivers it again to this client id's next session.
        if self.options.persistent and msg.qos > 0 and handled is not False:
            client.ack(msg.mid, msg.qos)

    # --- public API -------------------------------------------------------------------------

    def ack(self, delivery: tuple[int, int]) -> None:
        """Acknowledge a message a persistent session's handler declined (returned False) and
        kept ``delivering`` of: until then the broker holds it for this client id."""
        mid, qos = delivery
        if qos > 0:
            self._client.ack(mid, qos)

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

    def update_status(self, **info: Any) -> None:
        """Change fields of the retained online status, and publish it now when connected."""
        # A new dict, never an update in place: paho's thread reads it on every reconnection.
        self.status_info = {**self.status_info, **info}
        if self.status_topic and self.connected.is_set():
            self.publish(self.status_topic, status_payload("online", **self.status_info),
                         QOS_STATUS, retain=True)

    def alive(self) -> bool:
        """paho's network thread runs (it ends only on :meth:`stop` or a refusal for good)."""
        thread = getattr(self._client, "_thread", None)  # paho has no public accessor
        return thread is not None and thread.is_alive()

    def queued(self, info) -> bool:
        """Whether paho took the message of :meth:`publish`'s ``info`` (sent now, or kept for
        after the reconnection)."""
        return info.rc in (self._paho.MQTT_ERR_SUCCESS, self._paho.MQTT_ERR_NO_CONN)

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
        self.subscribed.clear()


_UNSUPPORTED_PROTOCOL = 132  # CONNACK reason code (paho maps 3.1.1's 1 onto it)
SESSION_EXPIRY = 7 * 24 * 3600  # seconds a broker keeps a persistent session of an absent client


class TopicAliases:
    """MQTT 5 topic aliases of one client: a topic goes on the wire once per connection, then
    its alias (the broker forgets them at each disconnection)."""

    def __init__(self):
        self.lock = threading.Lock()  # held across choosing and queueing a publish
        self.maximum = 0  # the broker's Topic Alias Maximum on this connection (0: none)
        self._ids: dict[str, int] = {}  # topic -> alias (kept across connections)
        self._topics: dict[int, bytes] = {}  # alias -> topic
        self._props: dict[int, object] = {}  # alias -> its PUBLISH properties (paho reads them)
        self._live: set[str] = set()  # topics the broker has learnt on this connection

    def use(self, topic: str):
        """``(topic to send, PUBLISH properties or None)`` for a message on ``topic``."""
        alias = self._ids.get(topic)
        if alias is None or alias > self.maximum:
            if len(self._ids) >= self.maximum:
                return topic, None  # no alias left: the topic in full
            alias = self._ids[topic] = len(self._ids) + 1
            self._topics[alias] = topic.encode()
        props = self._props.get(alias)
        if props is None:  # made and packed once: paho's Properties cost tens of µs each
            from paho.mqtt.packettypes import PacketTypes
            from paho.mqtt.properties import Properties

            props = self._props[alias] = Properties(PacketTypes.PUBLISH)
            props.TopicAlias = alias
            packed = props.pack()  # paho packs a message's properties at every send
            object.__setattr__(props, "pack", lambda: packed)  # (its __setattr__ refuses)
        if topic in self._live:
            return "", props
        self._live.add(topic)
        return topic, props

    def disconnected(self) -> None:
        """The connection is gone: nothing goes out with an alias until the next CONNACK."""
        with self.lock:
            self.maximum = 0
            self._live.clear()

    def connected(self, maximum: int, client) -> None:
        """A (re)connection: aliases start over; stored messages that paho is about to send
        again get their topic back (paho resends after ``on_connect``) and lose an alias the
        broker no longer allows."""
        with self.lock:
            self.maximum = int(maximum or 0)
            self._live.clear()
            if not self._topics:
                return
            with client._out_message_mutex:  # paho has no public access to its stored messages
                for m in client._out_messages.values():
                    alias = getattr(m.properties, "TopicAlias", None)
                    if alias not in self._topics:
                        continue
                    if not m._topic:
                        m._topic = self._topics[alias]
                    if alias > self.maximum:  # the broker allows fewer now (or none)
                        m.properties = None


def _ssl_reason(error: BaseException | str) -> str:
    """``certificate expired`` from ``[SSL: SSLV3_ALERT_CERTIFICATE_EXPIRED] sslv3 alert ...``."""
    if isinstance(error, ssl.SSLError) and error.reason:
        return error.reason.lower().replace("_", " ")
    text = str(error)
    if "]" in text:
        text = text.split("]", 1)[1].split("(_ssl.c", 1)[0]
    return text.strip(" :") or str(error)
