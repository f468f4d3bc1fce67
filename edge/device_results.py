"""A one-view device's own result, checked before the edge publishes it as its own.

Only the edge writes the deployment's results topic (the broker's ACL); a one-view device
decides its own exit and sends its result to the edge: on its own ``devices/{id}/results``
topic, through a gateway (``gateways/{id}/results``) or ``POST /v1/results``. Each is checked
here — a result by the contract, of a known device, with a class of this bundle and its label,
from the device's own (local) exit, of a device its sender speaks for — and published to every
sink; anything else is counted (``ddnn_edge_dropped_total{reason="malformed"|"forbidden"}``)
and dropped with a throttled log line.
"""

from __future__ import annotations

import logging
from collections.abc import Collection

from ddnn.edge.aggregator import EdgeAggregator, EdgeSnapshot
from ddnn.plumbing.throttle import LogThrottle
from ddnn.result import Result, ResultError

log = logging.getLogger(__name__)


class Forbidden(Exception):
    """A result its sender may not post (``403`` over HTTP)."""


def check_device_result(body: bytes, agg: EdgeSnapshot, speaks_for: Collection[str] | None = None,
                        sender: str = "this sender") -> Result:
    """A one-view device's result, checked (a ResultError says what is off, Forbidden that
    ``sender``, who speaks for the devices ``speaks_for`` — None: any — may not post it)."""
    if not agg.single_view:
        raise Forbidden(f"the bundle has {agg.manifest.views} views: its devices do not post "
                        "results, the edge answers their frames")
    result = Result.from_json(body)
    if result.exit != "local" or result.cls is None:  # (a frame it did not see: the edge's)
        raise ResultError("a device's own result exits at 'local'")
    classes = agg.manifest.classes
    if result.cls >= len(classes):
        raise ResultError(f"class must be an integer in 0..{len(classes) - 1}")
    if result.label != classes[result.cls]:
        raise ResultError(f"label must be {classes[result.cls]!r}, the name of class {result.cls}")
    if len(result.views) != 1 or result.views[0] not in agg.devices or result.missing:
        raise ResultError("views must list the one device of this deployment that answered")
    if speaks_for is not None and result.views[0] not in speaks_for:
        raise Forbidden(f"{sender} cannot post a result of {result.views[0]}")
    return result


class DeviceResults:
    """Takes devices' results from MQTT (a device's own topic, or a gateway's) for the edge."""

    def __init__(self, aggregator: EdgeAggregator):
        self.agg = aggregator
        self._warned = LogThrottle(period=10.0)

    def take(self, body: bytes, speaks_for: Collection[str], sender: str) -> None:
        try:
            result = check_device_result(body, self.agg.snapshot(), speaks_for, sender)
        except (Forbidden, ResultError) as e:
            reason = "forbidden" if isinstance(e, Forbidden) else "malformed"
            self.agg.events.on_dropped(reason)
            if n := self._warned(reason):
                log.warning("dropped a device result from %s (%s; %d like it): %s", sender,
                            reason, n, e)
            return
        self.agg.publish_result(result)
