"""Stand-ins for parts of a tier, where a test looks at one rule without the rest."""

from __future__ import annotations

from ddnn.edge.aggregator import EdgeSnapshot
from ddnn.edge.metrics import EdgeMetrics
from ddnn.plumbing.lifecycle import Lifecycle


class Agg:
    """What the health checks read of an aggregator: its snapshot and its metrics."""

    def __init__(self):
        self.answered = 0
        self.assembler: list = []
        self.devices = ["cam0", "cam1"]
        self.metrics = EdgeMetrics()
        self.manifest = None
        self.parts = Lifecycle()  # the service's lifecycle: its threads are what /livez lists

    def snapshot(self) -> EdgeSnapshot:
        return EdgeSnapshot(answered=self.answered, pending=len(self.assembler), cloud_up=False,
                            devices=tuple(self.devices), late_devices=(),
                            manifest=self.manifest)  # type: ignore[arg-type]


