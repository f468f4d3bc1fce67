"""MQTT topic names of a deployment, in one place so devices, edge and tools agree.

``{prefix}/{deployment}/devices/{device}/scores|features|status``,
``{prefix}/{deployment}/gateways/{gateway}/messages|status``,
``{prefix}/{deployment}/edges/{edge}/requests|status``, ``{prefix}/{deployment}/results`` and
``{prefix}/{deployment}/bundle``. Names are lowercase-safe and never contain MQTT wildcards.

How each kind of topic carries its messages (QoS, retained or not, the body's format) is in
:data:`DELIVERY`, the one table every subscription and publication is built from.
"""

from __future__ import annotations

from dataclasses import dataclass

from ddnn.errors import ConfigError
from ddnn.names import check_name, is_name

DEVICE_KINDS = ("scores", "features", "status")
GATEWAY_KINDS = ("messages", "status")


@dataclass(frozen=True)
class Delivery:
    """How the messages of one kind of topic travel over MQTT."""

    qos: int
    retain: bool = False
    # The body: "envelope" (ddnn.envelope), "batch" (ddnn.batch), "status" (ddnn.status),
    # "result" (ddnn.result JSON) or "announcement" (a bundle version, ddnn.plumbing.ota).
    body: str = "envelope"


# Topic kind -> how its messages travel. Absent views go on the scores topic.
DELIVERY = {
    # A lost score message makes the edge wait for the deadline, then fuse without it.
    "scores": Delivery(qos=1),
    "features": Delivery(qos=1),  # a lost feature message degrades the frame's edge exit
    # A pull is lost only with the device's connection, and the edge pulls again when the
    # device is back online (the frame waits for its features meanwhile); QoS 1 would cost
    # every device a PUBACK up the constrained link for every pull.
    "requests": Delivery(qos=0),
    "results": Delivery(qos=1, body="result"),  # the product: applications must not miss one
    # Retained (devices, gateways, edges), so late subscribers learn who is alive.
    "status": Delivery(qos=1, retain=True, body="status"),
    "bundle": Delivery(qos=1, retain=True, body="announcement"),  # the current version
    "messages": Delivery(qos=1, body="batch"),  # a gateway's scores and features of a frame
}


def subscription(topic: str, kind: str) -> tuple[str, int]:
    """``(topic filter, QoS)`` of a subscription to ``kind`` messages on ``topic``."""
    return topic, DELIVERY[kind].qos


def check_part(kind: str, value: str) -> str:
    """Validate one topic level (a prefix part, deployment, device or edge id)."""
    return check_name(kind, value)


@dataclass(frozen=True)
class Topics:
    """The topics of one deployment under a prefix (default ``ddnn``)."""

    deployment: str = "default"
    prefix: str = "ddnn"

    def __post_init__(self) -> None:
        for part in self.prefix.split("/"):
            check_part("topic prefix", part)
        check_part("deployment", self.deployment)

    @property
    def root(self) -> str:
        return f"{self.prefix}/{self.deployment}"

    def device(self, device: str, kind: str) -> str:
        if kind not in DEVICE_KINDS:
            raise ConfigError(f"unknown device topic {kind!r}")
        return f"{self.root}/devices/{check_part('device id', device)}/{kind}"

    def all_devices(self, kind: str) -> str:
        """Wildcard subscription for one kind of every device of the deployment."""
        return f"{self.root}/devices/+/{kind}"

    def gateway(self, gateway: str, kind: str) -> str:
        if kind not in GATEWAY_KINDS:
            raise ConfigError(f"unknown gateway topic {kind!r}")
        return f"{self.root}/gateways/{check_part('gateway id', gateway)}/{kind}"

    def parse_gateway(self, topic: str) -> tuple[str, str] | None:
        """``(gateway id, kind)`` of a gateway topic of this deployment, else ``None``."""
        return self._parse(topic, "gateways", GATEWAY_KINDS)

    def requests(self, edge: str) -> str:
        return f"{self.root}/edges/{check_part('edge id', edge)}/requests"

    def edge_status(self, edge: str) -> str:
        return f"{self.root}/edges/{check_part('edge id', edge)}/status"

    @property
    def results(self) -> str:
        return f"{self.root}/results"

    @property
    def bundle(self) -> str:
        return f"{self.root}/bundle"

    def parse_device(self, topic: str) -> tuple[str, str] | None:
        """``(device id, kind)`` of a device topic of this deployment, else ``None``."""
        return self._parse(topic, "devices", DEVICE_KINDS)

    def _parse(self, topic: str, level: str, kinds: tuple[str, ...]) -> tuple[str, str] | None:
        head = f"{self.root}/{level}/"
        if not topic.startswith(head):
            return None
        parts = topic[len(head):].split("/")
        if len(parts) != 2 or parts[1] not in kinds or not is_name(parts[0]):
            return None
        return parts[0], parts[1]


def default_device_ids(views: int) -> list[str]:
    """Device ids by view when none are configured: ``cam0`` … ``cam{V-1}``."""
    return [f"cam{i}" for i in range(views)]
