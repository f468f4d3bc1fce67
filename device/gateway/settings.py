"""The gateway's settings: one typed, frozen object from flags or ``DDNN_GATEWAY_*``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ddnn.errors import ConfigError
from ddnn.names import check_name
from ddnn.plumbing.health import MonitorHttp
from ddnn.plumbing.mqtt import CONNECT_TIMEOUT_OPTION, SECURITY_OPTIONS, BrokerUrl, MqttSecurity
from ddnn.plumbing.options import Option, bind, boolean, describe, grouped, id_list, section
from ddnn.topics import Topics

ENV_PREFIX = "DDNN_GATEWAY_"
MAX_DEVICES = 256  # devices a gateway without --devices forwards at most


@dataclass(frozen=True, kw_only=True)
class GatewaySettings:
    """Everything ``ddnn gateway`` can be told (flags or ``DDNN_GATEWAY_*``)."""

    local: str  # the devices' broker
    broker: str  # the edge's broker, over the uplink
    security: MqttSecurity = MqttSecurity()  # TLS and credentials for the edge's broker
    local_security: MqttSecurity = MqttSecurity()  # the same for the devices' broker
    gateway_id: str = "gw0"
    devices: tuple[str, ...] = ()  # the devices it forwards; empty: any, up to MAX_DEVICES
    deployment: str = "default"
    edge_id: str = "edge0"
    topic_prefix: str = "ddnn"
    coalesce_ms: float = 20.0  # longest a message waits for the other devices of its frame
    forward_results: bool = False  # one-view bundles: devices publish their own results
    keepalive: int = 10
    reconnect_max: int = 30
    connect_timeout: float = 10.0  # seconds for TCP, TLS and the CONNACK, each (both brokers)
    http: MonitorHttp = MonitorHttp()  # the gateway's own HTTP server (/metrics, /healthz)
    health_grace: float = 30.0  # a broker unreachable this long: /healthz answers 503

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
        if self.health_grace < 0:
            raise ConfigError(f"health_grace must not be negative, got {self.health_grace}")
        if not self.connect_timeout > 0:
            raise ConfigError(f"connect_timeout must be positive, got {self.connect_timeout}")

    def describe(self) -> dict:
        """The resolved settings for the start-up log, secrets masked (the URLs' too)."""
        return describe(self, OPTIONS)


# The devices' broker takes the same TLS and credential options, as --local-ca-file etc.
LOCAL_SECURITY_OPTIONS = tuple(
    dataclasses.replace(o, name=f"local-{o.name}", key=o.attr,
                        help=f"{o.help} (the devices' broker)") for o in SECURITY_OPTIONS)

OPTIONS = (
    *section("The site's broker (the devices')", (
        Option("local", str, "URL",
               "the devices' MQTT broker (local to the site; mqtts:// for TLS)"),
        *grouped("local_security", LOCAL_SECURITY_OPTIONS),
    )),
    *section("The edge's broker (over the uplink)", (
        Option("broker", str, "URL",
               "the edge's MQTT broker, over the uplink (mqtts:// for TLS)"),
        *grouped("security", SECURITY_OPTIONS),
    )),
    *section("What it forwards", (
        Option("gateway-id", str, "ID", "this gateway's id: its topics, and what the edge lets "
                                        "it speak for (edge --gateways)"),
        Option("devices", id_list, "IDS", "comma-separated devices to forward (unset: any "
                                          f"device on the site broker, {MAX_DEVICES} at most)"),
        Option("deployment", str, "NAME", "deployment whose devices to forward"),
        Option("edge-id", str, "ID", "the edge whose pulls, status and announcements to repeat"),
        Option("topic-prefix", str, "PREFIX", "first topic level(s)"),
        Option("coalesce-ms", float, "MS", "longest a device message waits for the other "
                                           "devices' messages of its frame before its batch "
                                           "goes"),
        Option("forward-results", boolean, "BOOL", "forward the devices' own results (one-view "
                                                   "bundles decide on the device)"),
    )),
    *section("Both connections", (
        Option("keepalive", int, "S", "MQTT keepalive, seconds"),
        Option("reconnect-max", int, "S", "cap of the reconnection backoff, seconds"),
        CONNECT_TIMEOUT_OPTION,
    )),
    *section("Monitoring", (
        *grouped("http", (
            Option("http-host", str, "ADDR", "address of the gateway's HTTP server",
                   key="host"),
            Option("http-port", int, "PORT",
                   "port of the gateway's HTTP server (/metrics, /healthz, /livez); unset: "
                   "none", key="port"))),
        Option("health-grace", float, "S",
               "seconds either broker may be unreachable before /healthz answers 503"),
    )),
)
bind(GatewaySettings, OPTIONS)
