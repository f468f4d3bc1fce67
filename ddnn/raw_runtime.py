"""Running a raw-offload reference bundle (``"kind": "raw"``) with ONNX Runtime.

The reference is one model on every raw view (``ddnn train --baseline``); the cloud serves it as
``{name}-raw`` beside the hierarchy of the same name, so the two can be compared through the same
service. :class:`RawRuntime` has the shape of :class:`ddnn.runtime.BundleRuntime` where a server
needs it (``bundle``, ``manifest``, ``load_all``).
"""

from __future__ import annotations

import threading

import numpy as np

from ddnn.bundle import Bundle
from ddnn.runtime import SegmentRunner


class RawRuntime:
    """The one segment of a raw-offload reference bundle, loaded on first use; thread-safe."""

    def __init__(self, bundle: Bundle, threads: int | None = None):
        self.bundle = bundle
        self.manifest = bundle.manifest  # a ddnn.raw_manifest.RawManifest
        self.threads = threads
        self._runner: SegmentRunner | None = None
        self._lock = threading.Lock()

    def load_all(self) -> None:
        """Create the session now (services do this before reporting ready)."""
        self._session()

    def _session(self) -> SegmentRunner:
        with self._lock:
            if self._runner is None:
                spec = self.manifest.raw
                self._runner = SegmentRunner(self.bundle.file(spec), spec, self.threads)
            return self._runner

    def scores(self, views: np.ndarray) -> np.ndarray:
        """Views (B, V, 3, H, W) in [0, 1], zeros for an absent view → class scores (B, C)."""
        return self._session()(views=views)["scores"]
