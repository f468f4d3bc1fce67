"""Messages of devices behind a gateway (``ddnn gateway``): batches and statuses, unpacked.

A gateway speaks only for the devices the edge's ``--gateways GATEWAY=DEVICE+DEVICE...`` gives
it, as a device's topic speaks only for that device: an entry for any other device is dropped
(``unknown_device``), as is the whole of a batch from a gateway not configured. Each entry
then goes through :class:`~ddnn.edge.ingest.Ingest` like a message on the device's own topic.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping

from ddnn.batch import unpack_batch
from ddnn.edge.device_results import DeviceResults
from ddnn.edge.events import NO_EVENTS, EdgeEvents
from ddnn.edge.ingest import Ingest
from ddnn.envelope import DecodeError
from ddnn.plumbing.throttle import LogThrottle
from ddnn.status import status_fields
from ddnn.topics import Topics

log = logging.getLogger(__name__)


class GatewayIngest:
    """Routes gateway topics into ``ingest``; ``gateways`` maps a gateway to its devices.
    A one-view device's own result through its gateway goes to ``results`` (None: dropped)."""

    def __init__(self, ingest: Ingest, topics: Topics, gateways: Mapping[str, tuple[str, ...]],
                 events: EdgeEvents = NO_EVENTS, results: DeviceResults | None = None):
        self.ingest, self.topics, self.events, self.results = ingest, topics, events, results
        self.gateways = {g: tuple(ds) for g, ds in gateways.items()}
        self._warned = LogThrottle(max_keys=100)  # one line per distinct refusal

    def handles(self, topic: str) -> bool:
        return self.topics.parse_gateway(topic) is not None

    def on_message(self, topic: str, payload: bytes) -> bool | None:
        """A message on a gateway topic; False declines it (a draining edge leaves batches of
        new frames to the next one, as :meth:`Ingest.on_message` does)."""
        parsed = self.topics.parse_gateway(topic)
        if parsed is None:
            return None
        gateway, kind = parsed
        devices = self.gateways.get(gateway)
        if devices is None:
            self._refuse("unknown_device", f"gateway {gateway!r} is not one of this edge's "
                                           "(--gateways)")
        elif kind == "status":
            self._status(devices, payload)
        elif kind == "results":
            if self.results is not None:
                self.results.take(payload, devices, f"gateway {gateway}")
        else:
            return self._batch(gateway, devices, payload)
        return None

    def _status(self, devices: tuple[str, ...], payload: bytes) -> None:
        info = status_fields(payload)
        state = info.get("state")
        listed = info.get("devices")
        reported = listed if isinstance(listed, dict) else {}
        for device in devices:
            fields = reported.get(device) if state == "online" else None
            if not isinstance(fields, dict):  # gateway offline, or this device never seen
                fields = {"state": "offline"}
            self.ingest.on_status(device, json.dumps(fields).encode())

    def _batch(self, gateway: str, devices: tuple[str, ...], payload: bytes) -> bool | None:
        try:
            entries = unpack_batch(payload)
        except DecodeError as e:
            self._refuse("malformed", f"batch of gateway {gateway}: {e}")
            return None
        if self.ingest.draining and not all(self.ingest.handled_here(e) for _, e in entries):
            self.ingest.declined += 1
            return False
        for device, envelope in entries:
            if device not in devices:
                self._refuse("unknown_device", f"gateway {gateway} cannot speak for {device!r}")
                continue
            self.ingest.accept(envelope, device)
        return None

    def _refuse(self, reason: str, detail: str) -> None:
        self.events.on_dropped(reason)
        if self._warned(detail):
            log.warning("dropped a gateway message (%s): %s", reason, detail)
