"""MQTT topic names of a deployment, in one place so devices, edge and tools agree.

``{prefix}/{deployment}/devices/{device}/scores|features|status``,
``{prefix}/{deployment}/gateways/{gateway}/messages|status``,
``{prefix}/{deployment}/edges/{edge}/requests|status``, ``{prefix}/{deployment}/results`` and
``{prefix}/{deployment}/bundle``. Names are lowercase-safe and never contain MQTT wildcards.
"""

from __future__ import annotations

from dataclasses import dataclass

from ddnn.errors import ConfigError
from ddnn.names import check_name, is_name

DEVICE_KINDS = ("scores", "features", "status")
GATEWAY_KINDS = ("messages", "status")


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
