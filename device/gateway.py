"""``ddnn gateway``: devices behind one uplink, their messages of a frame sent as one.

Devices on a site (one board with several cameras, or boards on one LAN) publish to a local
broker as usual. The gateway forwards their messages to the edge's broker over the constrained
uplink in batches (:mod:`ddnn.batch`): the scores of a frame go as one message once every
online device sent its own (or after ``--coalesce-ms``), pulled features likewise. Their
statuses go up as one retained gateway status. Down, it repeats the edge's pulls, its status
and bundle announcements on the local broker, so the devices run unchanged.

Nothing is lost on the way: a device message is acknowledged on the local broker (a persistent
session) only once the batch that carries it was acknowledged upstream.
"""

from __future__ import annotations

import argparse
import json
import logging
import queue
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

from ddnn import envelope as env
from ddnn.batch import MAX_ENTRY, batches, pack_batch
from ddnn.device.coalescer import Coalescer, Group, Key
from ddnn.envelope import DecodeError, MessageType
from ddnn.errors import ConfigError
from ddnn.names import check_name
from ddnn.plumbing import options
from ddnn.plumbing.mqtt import SECURITY_OPTIONS, BrokerUrl, MqttClient, MqttOptions, MqttSecurity
from ddnn.plumbing.options import Option, bind, boolean, grouped, id_list
from ddnn.plumbing.signals import stop_on_signals
from ddnn.plumbing.throttle import LogThrottle
from ddnn.status import status_fields
from ddnn.topics import DELIVERY, DEVICE_KINDS, Topics, subscription

log = logging.getLogger(__name__)

ENV_PREFIX = "DDNN_GATEWAY_"
MAX_DEVICES = 256  # devices a gateway without --devices forwards at most


@dataclass(frozen=True, kw_only=True)
class GatewaySettings:
    """Everything ``ddnn gateway`` can be told (flags or ``DDNN_GATEWAY_*``)."""

    local: str  # the devices' broker
    broker: str  # the edge's broker, over the uplink
    security: MqttSecurity = MqttSecurity()  # TLS and credentials for the edge's broker
    gateway_id: str = "gw0"
    devices: tuple[str, ...] = ()  # the devices it forwards; empty: any, up to MAX_DEVICES
    deployment: str = "default"
    edge_id: str = "edge0"
    topic_prefix: str = "ddnn"
    coalesce_ms: float = 20.0  # longest a message waits for the other devices of its frame
    forward_results: bool = False  # one-view bundles: devices publish their own results
    keepalive: int = 10
    reconnect_max: int = 30

    def __post_init__(self) -> None:
        object.__setattr__(self, "devices", tuple(self.devices))
        BrokerUrl.parse(self.local)
        BrokerUrl.parse(self.broker)
        check_name("gateway id", self.gateway_id)
        check_name("edge id", self.edge_id)
        for d in self.devices:
            check_name("device id", d)
        Topics(self.deployment, self.topic_prefix)
        if not 0 <= self.coalesce_ms <= 1000:
            raise ConfigError("--coalesce-ms must be between 0 and 1000")


OPTIONS = (
    Option("local", str, "URL", "the devices' MQTT broker (local to the site)"),
    Option("broker", str, "URL", "the edge's MQTT broker, over the uplink (mqtts:// for TLS)"),
    *grouped("security", SECURITY_OPTIONS),
    Option("gateway-id", str, "ID", "this gateway's id: its topics, and what the edge lets it "
                                    "speak for (edge --gateways)"),
    Option("devices", id_list, "IDS", "comma-separated devices to forward (unset: any device "
                                      f"on the site broker, {MAX_DEVICES} at most)"),
    Option("deployment", str, "NAME", "deployment whose devices to forward"),
    Option("edge-id", str, "ID", "the edge whose pulls, status and announcements to repeat"),
    Option("topic-prefix", str, "PREFIX", "first topic level(s)"),
    Option("coalesce-ms", float, "MS", "longest a device message waits for the other devices' "
                                       "messages of its frame before its batch goes"),
    Option("forward-results", boolean, "BOOL", "forward the devices' own results (one-view "
                                               "bundles decide on the device)"),
    Option("keepalive", int, "S", "MQTT keepalive, seconds"),
    Option("reconnect-max", int, "S", "cap of the reconnection backoff, seconds"),
)
bind(GatewaySettings, OPTIONS)

# What of a device's status goes up (the edge reads these; the rest stays on the site).
_STATUS_FIELDS = ("state", "view", "model", "mode", "since")
MAX_MASK = 32  # bytes of a pull's view mask the gateway keeps (256 views)
STOP_WAIT = 5.0  # seconds a stopping gateway waits for its last batches' acknowledgements


class GatewayService:
    """The two MQTT clients and the coalescer between them; a context manager."""

    def __init__(self, settings: GatewaySettings):
        s = self.settings = settings
        t = self.topics = Topics(s.deployment, s.topic_prefix)
        self.statuses: dict[str, dict] = {}  # device -> the status fields it sent up
        self._pulled: dict[int, bytes] = {}  # frame -> the views' mask of the edge's pull
        self._lock = threading.Lock()
        self._batches: dict[int, list] = {}  # upstream mid -> local deliveries to acknowledge
        # PUBACKs from upstream as (mid, taken): paho reports them with its own lock held, so
        # the local acknowledgements happen on a thread of ours.
        self._acks: queue.SimpleQueue[tuple[int, bool] | None] = queue.SimpleQueue()
        self._stopping = False
        # batches and messages sent up; groups sent complete or at their window's end;
        # messages dropped (bad, or too large to go up) and refused by the edge's broker
        self.forwarded = dict.fromkeys(("batches", "messages", "complete", "timed_out",
                                        "dropped", "refused"), 0)
        self._drops_log = LogThrottle(every=1000)  # the first, then one in a thousand
        self.coalescer = Coalescer(s.coalesce_ms / 1000, self._expected, self._send)
        self.up = MqttClient(
            s.broker, f"ddnn-{s.deployment}-{s.gateway_id}",
            MqttOptions(keepalive=s.keepalive, reconnect_max=s.reconnect_max,
                        security=s.security,
                        subscriptions=[subscription(t.requests(s.edge_id), "requests"),
                                       subscription(t.edge_status(s.edge_id), "status"),
                                       subscription(t.bundle, "bundle")]),
            status_topic=t.gateway(s.gateway_id, "status"),
            status_info={"gateway": s.gateway_id, "devices": {}},
            on_message=self._from_edge, on_published=lambda mid: self._acks.put((mid, True)),
            on_publish_refused=lambda mid: self._acks.put((mid, False)))
        self.local = MqttClient(
            s.local, f"ddnn-{s.deployment}-{s.gateway_id}-local",
            MqttOptions(keepalive=s.keepalive, reconnect_max=s.reconnect_max, persistent=True,
                        subscriptions=[subscription(t.all_devices(k), k) for k in DEVICE_KINDS]
                        + ([subscription(t.results, "results")] if s.forward_results else [])),
            on_message=self._from_device)
        self._threads = [
            threading.Thread(target=self.coalescer.run, name="gateway-flush", daemon=True),
            threading.Thread(target=self._acknowledge, name="gateway-acks", daemon=True)]

    @classmethod
    def from_settings(cls, settings: GatewaySettings) -> GatewayService:
        return cls(settings)

    # --- up: devices -> edge ------------------------------------------------------------------

    def _from_device(self, topic: str, payload: bytes) -> bool | None:
        """A local device message (local paho thread); False: acknowledged later (or, while
        stopping, by the next run of the gateway)."""
        if self._stopping:
            return False
        delivery = self.local.delivering
        if topic == self.topics.results:  # a one-view device's own answer: up as it is
            self._publish(topic, payload, DELIVERY["results"].qos, [delivery])
            return False
        parsed = self.topics.parse_device(topic)
        if parsed is None or not self._forwards(parsed[0]):
            return None
        device, kind = parsed
        if kind == "status":
            self._device_status(device, payload)
            return None
        try:
            if len(payload) > MAX_ENTRY:  # before decoding: the cheap check first
                raise DecodeError(f"message of {len(payload)} bytes cannot go in a batch")
            frame = env.decode(payload).frame
        except DecodeError as e:
            self._count("dropped")  # the edge would drop it too: the uplink is dear
            if self._drops_log():
                log.warning("dropping a message of %s (%d so far): %s", device,
                            self.forwarded["dropped"], e)
            return None
        self.coalescer.add((kind, frame), device, payload, delivery)
        return False

    def _forwards(self, device: str) -> bool:
        """A device of this gateway: listed, or (without a list) one of the first seen."""
        if self.settings.devices:
            return device in self.settings.devices
        return device in self.statuses or len(self.statuses) < MAX_DEVICES

    def _expected(self, key: Key) -> set[str]:
        """The devices a group waits for: the online ones; for features, those pulled."""
        kind, frame = key
        online = {d for d, f in self.statuses.items() if f.get("state") == "online"}
        if kind == "scores":
            return online
        with self._lock:
            mask = self._pulled.get(frame)
        if mask is None:
            return set()  # a pull we did not see (or push mode): wait for the window
        return {d for d in online if _pulled(mask, self.statuses[d].get("view"))}

    def _send(self, groups: list[Group]) -> None:
        """The ready groups' messages, in as few batches as the format allows."""
        entries = [e for g in groups for e in g.entries]
        complete = sum(g.complete for g in groups)
        with self._lock:
            self.forwarded["complete"] += complete
            self.forwarded["timed_out"] += len(groups) - complete
            for g in groups:
                if g.key[0] == "features":
                    self._pulled.pop(g.key[1], None)
        for chunk in batches(entries):
            data = pack_batch((device, payload) for device, payload, _ in chunk)
            self._publish(self.topics.gateway(self.settings.gateway_id, "messages"), data,
                          DELIVERY["messages"].qos, [tag for _, _, tag in chunk])
            with self._lock:
                self.forwarded["batches"] += 1
                self.forwarded["messages"] += len(chunk)

    def _publish(self, topic: str, payload: bytes, qos: int, deliveries: list) -> None:
        with self._lock:  # the mid is registered before its PUBACK can arrive
            info = self.up.publish(topic, payload, qos)
            if self.up.queued(info):
                self._batches[info.mid] = deliveries
                return
        log.warning("the uplink refused a batch (%d messages): the devices' broker keeps them",
                    len(deliveries))

    def _acknowledge(self) -> None:
        """As the edge's broker takes batches, their messages leave the devices' broker; a
        batch it refused stays there (it comes again when the gateway reconnects)."""
        while (ack := self._acks.get()) is not None:
            mid, taken = ack
            with self._lock:
                deliveries = self._batches.pop(mid, ())
                if not taken:
                    self.forwarded["refused"] += len(deliveries)
            if taken:
                for d in deliveries:
                    self.local.ack(d)
            # A refused batch is counted above; MqttClient already warns about refused
            # publishes with the ACL hint, first and then one in a thousand.

    def _count(self, what: str) -> None:
        with self._lock:
            self.forwarded[what] += 1

    def _device_status(self, device: str, payload: bytes) -> None:
        info = status_fields(payload)
        if info.get("state") not in ("online", "offline"):
            return
        fields = {k: info[k] for k in _STATUS_FIELDS if k in info}
        if self.statuses.get(device) == fields:
            return  # nothing new for the edge (retained statuses come again on reconnection)
        self.statuses[device] = fields
        self.up.update_status(devices=dict(self.statuses))

    # --- down: edge -> devices ----------------------------------------------------------------

    def _from_edge(self, topic: str, payload: bytes) -> None:
        t, s = self.topics, self.settings
        if topic == t.requests(s.edge_id):
            self._remember_pull(payload)
            self.local.publish(topic, payload, DELIVERY["requests"].qos)
        elif topic in (t.edge_status(s.edge_id), t.bundle):
            wire = DELIVERY["status" if topic != t.bundle else "bundle"]
            self.local.publish(topic, payload, wire.qos, retain=wire.retain)

    def _remember_pull(self, payload: bytes) -> None:
        """Which views the edge pulled for a frame: its features' group waits for them."""
        try:
            e = env.decode(payload)
        except DecodeError:
            return  # the devices drop and count it
        if e.kind != MessageType.REQUEST or e.codec != "binary" or len(e.payload) > MAX_MASK:
            return
        with self._lock:
            self._pulled[e.frame] = e.payload
            while len(self._pulled) > self.coalescer.max_groups:
                self._pulled.pop(next(iter(self._pulled)))

    # --- lifecycle ----------------------------------------------------------------------------

    def __enter__(self) -> GatewayService:
        for t in self._threads:
            t.start()
        self.up.start()
        self.local.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        """Take no more device messages, send what is held, acknowledge what the edge's broker
        took, then disconnect: what is left comes again to the next run."""
        self._stopping = True
        self.coalescer.stop()
        self._threads[0].join(STOP_WAIT)
        deadline = time.monotonic() + STOP_WAIT
        while self.up.connected.is_set() and time.monotonic() < deadline:
            with self._lock:
                if not self._batches:
                    break
            time.sleep(0.02)  # the last PUBACKs, over the uplink
        self._acks.put(None)
        self._threads[1].join(STOP_WAIT)
        self.local.stop()  # (the acknowledgements above go out before its DISCONNECT)
        self.up.stop()


def _pulled(mask: bytes, view) -> bool:
    """Whether the request's packed view mask (binary codec: MSB first) holds ``view``."""
    if not isinstance(view, int) or isinstance(view, bool) or not 0 <= view < 8 * len(mask):
        return False
    return bool(mask[view // 8] >> (7 - view % 8) & 1)


# --- command line ---------------------------------------------------------------------------

DESCRIPTION = f"""\
Forward the messages of the devices on a local broker to the edge's broker in batches: one
message per frame up the constrained uplink instead of one per device (the devices run
unchanged, with --broker set to the local broker). Start the edge with --gateways
GATEWAY=DEVICE+DEVICE... so it lets this gateway speak for its devices. Every option also reads
the environment variable {ENV_PREFIX}<OPTION>; a flag wins."""


def register(sub, data_sub, formatter) -> None:
    """Add ``ddnn gateway`` to the subcommands."""
    p = sub.add_parser("gateway", help="batch a site's device messages up one uplink",
                       description=DESCRIPTION, formatter_class=formatter)
    options.add_options(p, OPTIONS, GatewaySettings, ENV_PREFIX)
    p.set_defaults(func=run)


def settings_from(args: argparse.Namespace, environ: Mapping[str, str] | None = None
                  ) -> GatewaySettings:
    return options.settings_from(args, OPTIONS, GatewaySettings, ENV_PREFIX, environ)


def run(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    log.info("gateway config: %s", options.describe(settings, OPTIONS))
    stop = threading.Event()
    stop_on_signals(stop)
    with GatewayService.from_settings(settings) as service:
        stop.wait()
        log.info("stopping: %s", json.dumps(service.forwarded))
    return 0
