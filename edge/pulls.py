"""The edge's feature pulls: a request on the edge's requests topic names a frame and the
views whose features it needs (a packed view mask); the devices of those views answer.

The topic names deployment and edge, so a request carries only the bundle version and the
frame. After an outage a device may have missed pulls: :meth:`FeaturePulls.again` asks again
for what frames still await.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from ddnn import envelope as env
from ddnn.bundle import Manifest
from ddnn.edge.assembler import FrameAssembler
from ddnn.edge.events import EdgeEvents
from ddnn.envelope import MessageType
from ddnn.topics import DELIVERY


class FeaturePulls:
    """Publishes pulls with ``publish(topic, payload, qos)`` on ``topic``, for the bundle
    version ``manifest()`` says new frames run on."""

    def __init__(self, publish: Callable[[str, bytes, int], object], topic: str,
                 events: EdgeEvents, manifest: Callable[[], Manifest]):
        self._publish, self.topic, self.events, self._manifest = publish, topic, events, manifest

    def request(self, frame: int, views: Sequence[int]) -> None:
        """Pull the features of ``views`` for ``frame``."""
        m = self._manifest()
        mask = np.full(m.views, -1.0, np.float32)
        mask[list(views)] = 1.0
        req = env.pack(MessageType.REQUEST, version=m.version, frame=frame, tensor=mask,
                       codec="binary")
        self._publish(self.topic, env.encode(req), DELIVERY["requests"].qos)
        self.events.on_pulled("features")

    def again(self, assembler: FrameAssembler) -> None:
        """Pull again what the frames waiting for features still miss."""
        for f in assembler.pending():
            missing = [v for v in f.requested if v not in f.features]
            if missing:
                self.request(f.id, missing)
