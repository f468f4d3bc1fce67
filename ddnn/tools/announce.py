"""``ddnn announce``: publish a bundle version for over-the-air updates (retained).

Like the tiers, every option is a row of one table (:data:`OPTIONS`): a flag, a
``DDNN_ANNOUNCE_*`` environment variable and a default; the MQTT TLS and credential rows are the
device's and the edge's (:data:`ddnn.plumbing.mqtt.SECURITY_OPTIONS`), so the operator identity
that ``deploy/make-certs.sh`` makes (``env/operator.env``) works as it is.

The broker acknowledges a publish that its ACL drops just like one it keeps (MQTT 3.1.1), so
the announcement is read back from the retained topic before the command reports success.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass

from ddnn.bundle import check_name
from ddnn.errors import ConfigError, DdnnError
from ddnn.plumbing.mqtt import SECURITY_OPTIONS, BrokerUrl, MqttSecurity
from ddnn.plumbing.options import Option, add_options, bind, describe, grouped, settings_from
from ddnn.plumbing.ota import Announcement, bundle_url
from ddnn.topics import DELIVERY, Topics, subscription

log = logging.getLogger(__name__)

ENV_PREFIX = "DDNN_ANNOUNCE_"


class AnnounceError(DdnnError):
    """The announcement was not stored by the broker (not allowed, or not confirmed in time)."""


@dataclass(frozen=True, kw_only=True)
class AnnounceSettings:
    """Everything ``ddnn announce`` can be told; every field is a flag and a variable."""

    broker: str
    security: MqttSecurity = MqttSecurity()  # MQTT TLS and credentials (an option group)
    deployment: str = "default"
    topic_prefix: str = "ddnn"
    name: str
    version: str
    cloud: str | None = None  # the files are fetched from its /v1/bundles/NAME/VERSION
    url: str | None = None  # or from this base URL
    timeout: float = 10.0

    def __post_init__(self) -> None:
        BrokerUrl.parse(self.broker)
        check_name("model name", self.name)
        check_name("model version", self.version)
        Topics(self.deployment, self.topic_prefix)  # valid topic levels
        if self.url and self.cloud:
            raise ConfigError("give --url or --cloud, not both")
        if not self.timeout > 0:
            raise ConfigError(f"timeout must be positive, got {self.timeout}")

    def announcement(self) -> Announcement:
        url = self.url or (bundle_url(self.cloud, self.name, self.version) if self.cloud
                           else None)
        # Parsed back as the tiers will parse it: a URL they would refuse is refused here.
        return Announcement.parse(Announcement(self.name, self.version, url).to_bytes())

    def describe(self) -> dict:
        out = describe(self, OPTIONS)
        out["broker"] = str(BrokerUrl.parse(self.broker))  # never prints a password
        return out


OPTIONS = (
    Option("broker", str, "URL", "MQTT broker URL mqtt://[user:pass@]host:port (mqtts:// for "
                                 "TLS); a password in it is never logged"),
    *grouped("security", SECURITY_OPTIONS),
    Option("deployment", str, "NAME", "deployment name (topic level)"),
    Option("topic-prefix", str, "PREFIX", "first topic level(s)"),
    Option("name", str, "NAME", "model name of the bundle"),
    Option("version", str, "VERSION", "bundle version to announce"),
    Option("cloud", str, "URL",
           "cloud base URL: the files are fetched from its /v1/bundles/NAME/VERSION (unset, "
           "and no --url: each tier fetches from its own cloud)"),
    Option("url", str, "URL", "fetch the bundle from this base URL instead"),
    Option("timeout", float, "SECONDS",
           "how long to wait for the broker to connect, acknowledge and hand the retained "
           "announcement back"),
)
bind(AnnounceSettings, OPTIONS)


def announce(broker: str, deployment: str, ann: Announcement, prefix: str = "ddnn",
             timeout: float = 10.0, security: MqttSecurity | None = None) -> None:
    """Publish ``ann`` retained on the deployment's bundle topic, then read it back.

    Raises :class:`~ddnn.plumbing.mqtt.BrokerRefusedError` (exit status 78) when the broker
    refuses the credentials or certificate, :class:`~ddnn.plumbing.mqtt.MqttError` when it
    cannot be reached, and :class:`AnnounceError` when the broker does not hand the announcement
    back from the retained topic (its ACL dropped the publish, or this identity may not read
    the topic).
    """
    from ddnn.plumbing.mqtt import MqttClient, MqttError, MqttOptions

    topic = Topics(deployment, prefix).bundle
    payload = ann.to_bytes()
    stored = threading.Event()

    def on_message(t: str, p: bytes) -> None:
        if t == topic and p == payload:
            stored.set()

    wire = DELIVERY["bundle"]
    options = MqttOptions(subscriptions=[subscription(topic, "bundle")], reconnect_max=5,
                          security=security or MqttSecurity())
    client = MqttClient(broker, f"ddnn-announce-{deployment}-{os.getpid()}", options,
                        on_message=on_message).start()
    try:
        if not client.wait_connected(timeout):
            raise MqttError(f"broker {client.url} not reachable in {timeout:g} s")
        info = client.publish(topic, payload, wire.qos, retain=wire.retain)
        info.wait_for_publish(timeout)
        if not info.is_published():
            raise MqttError(f"broker {client.url} did not acknowledge the announcement in "
                            f"{timeout:g} s")
        if not stored.wait(timeout):
            who = f"user {client.username!r}" if client.username else "this client"
            raise AnnounceError(
                f"the broker acknowledged but did not keep the announcement of "
                f"{ann.name}:{ann.version} on {topic} within {timeout:g} s: its ACL lets "
                f"{who} not publish (or not read) there; announce with the operator identity "
                "(deploy/make-certs.sh env/operator.env)")
    finally:
        client.stop()
    log.info("announced %s:%s on %s", ann.name, ann.version, topic)


def register(sub, data_sub, formatter) -> None:
    p = sub.add_parser(
        "announce", help="announce a bundle version to a deployment (over-the-air update)",
        description="Publish a bundle version on the deployment's retained bundle topic, then "
        "read it back to confirm the broker kept it (an ACL drops a publish it does not allow "
        "silently). Devices and edges fetch it over HTTP (from --url, or --cloud's "
        "/v1/bundles/NAME/VERSION, or their own cloud), verify it and swap it in; a bad one is "
        "refused and the running version keeps serving. The cloud must serve that version "
        f"(--repository). Every option also reads the environment variable {ENV_PREFIX}<OPTION> "
        f"(e.g. {ENV_PREFIX}PASSWORD); a flag wins over the variable. On a secure broker use "
        "the operator identity from deploy/make-certs.sh (env/operator.env).",
        formatter_class=formatter)
    add_options(p, OPTIONS, AnnounceSettings, ENV_PREFIX)
    p.set_defaults(func=_announce)


def _announce(args) -> int:
    settings = settings_from(args, OPTIONS, AnnounceSettings, ENV_PREFIX)
    log.debug("ddnn announce with %s", settings.describe())
    ann = settings.announcement()
    announce(settings.broker, settings.deployment, ann, settings.topic_prefix,
             settings.timeout, settings.security)
    print(f"announced {ann.name}:{ann.version} to deployment {settings.deployment}")
    return 0
