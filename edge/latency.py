"""What each of the edge's paths costs now: moving windows of its measured latencies, and the
percentile of capture-to-answer latency an operating point would give (``--latency-slo``).

A frame's latency (``latency_ms`` of its result) is the sum of the parts it walks
(docs/latency.md): its *arrival* (capture to its first view here) and *wait* (to its last view:
the edge's queueing), for a frame that leaves at the edge exit the feature *pull*, and for one
sent on up the *cloud* stage (hand-over to the cloud thread, the details, the call: per cloud
model, plain or escalated). :class:`PathCosts` observes each part through the edge's events and
keeps the samples of the last few seconds (:class:`MovingWindow`); an operating point's exit
shares weigh the three paths' distributions into one mixture, whose percentile is the point's
predicted latency (:meth:`PathCosts.predict`). The paths are built by drawing their parts
independently, so a slow cloud shows in every point that sends frames up, in proportion to how
many it sends.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Mapping

import numpy as np

from ddnn.edge.events import EdgeEvents
from ddnn.result import Result

HORIZON = 2.0  # seconds of samples a window keeps: long enough for a percentile, short enough
# that a change of the network shows within a few seconds
KEEP = 16  # samples a window keeps past its horizon while none is newer: a path nobody walks
# keeps its last costs
DRAWS = 1024  # samples of each path drawn from its parts
PATHS = ("local", "edge", "cloud")
CLOUD_MODELS = ("cloud", "escalated")


class MovingWindow:
    """The values added in the last ``horizon`` seconds, at most ``size``; with none that
    recent, the last ``keep`` of them, however old. Thread-safe."""

    def __init__(self, horizon: float = HORIZON, *, size: int = 4096, keep: int = KEEP):
        if not horizon > 0 or size < 1 or not 0 <= keep <= size:
            raise ValueError(f"a moving window needs horizon > 0 and 0 <= keep <= size, got "
                             f"{horizon}, {keep}, {size}")
        self.horizon, self.keep = horizon, keep
        self._samples: collections.deque[tuple[float, float]] = collections.deque(maxlen=size)
        self._lock = threading.Lock()

    def add(self, value: float, now: float | None = None) -> None:
        with self._lock:
            self._samples.append((time.monotonic() if now is None else now, float(value)))

    def values(self, now: float | None = None) -> np.ndarray:
        """The values in the window now (oldest first)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            # Old values go once a newer one is in the horizon; with none, the last few stay.
            fresh = bool(self._samples) and self._samples[-1][0] >= now - self.horizon
            while self._samples and self._samples[0][0] < now - self.horizon and (
                    fresh or len(self._samples) > self.keep):
                self._samples.popleft()
            return np.array([v for _, v in self._samples], np.float64)

    def quantile(self, q: float, now: float | None = None) -> float | None:
        """The ``q`` quantile (0..1) of the values in the window; None when it is empty."""
        v = self.values(now)
        return float(np.quantile(v, q)) if v.size else None

    def __len__(self) -> int:
        return len(self._samples)


def mixture_quantile(paths: Mapping[str, np.ndarray], shares: Mapping[str, float],
                     q: float) -> float:
    """The ``q`` quantile of a mixture: a frame walks path ``k`` (sorted samples
    ``paths[k]``) with chance ``shares[k]``. Paths with no share are left out."""
    used = {k: paths[k] for k, s in shares.items() if s > 0}
    if not used:
        raise ValueError("a mixture needs a path with a positive share")
    total = sum(shares[k] for k in used)
    xs = np.unique(np.concatenate(list(used.values())))
    cdf = sum(shares[k] / total * np.searchsorted(v, xs, side="right") / v.size
              for k, v in used.items())
    return float(xs[min(int(np.searchsorted(cdf, q - 1e-12)), xs.size - 1)])


class PathCosts(EdgeEvents):
    """The costs of the edge's parts, observed through its events: ``arrival`` and ``wait``
    (every frame), ``pull`` (frames whose features were pulled), the ``cloud`` stage per model
    (every call, probes and audits included: its oldest frame's queueing and the call), and the
    ``measured`` capture-to-answer latency of every result."""

    def __init__(self, horizon: float = HORIZON, *, seed: int = 0):
        self.parts = {k: MovingWindow(horizon) for k in ("arrival", "wait", "pull")}
        self.cloud = {k: MovingWindow(horizon) for k in CLOUD_MODELS}
        self.measured = MovingWindow(horizon)
        self._rng = np.random.default_rng(seed)

    # --- the events ---------------------------------------------------------------------

    def on_stage(self, stage: str, seconds: float) -> None:
        if stage in self.parts:
            self.parts[stage].add(seconds)

    def on_cloud_call(self, outcome: str, seconds: float | None = None,
                      model: str = "cloud") -> None:
        # A failed call costs its time too (a timeout is the worst a frame sent up waits).
        if seconds is not None and outcome in ("ok", "error") and model in self.cloud:
            self.cloud[model].add(seconds)

    def on_answered(self, result: Result, step: str, latency: float) -> None:
        self.measured.add(latency)

    # --- the prediction -----------------------------------------------------------------

    def paths(self, model: str = "cloud", now: float | None = None
              ) -> dict[str, np.ndarray | None]:
        """Sorted samples of each path's capture-to-answer latency, its parts drawn
        independently (None: a part of it was never measured)."""
        parts = {k: w.values(now) for k, w in self.parts.items()}
        parts["cloud"] = self.cloud[model].values(now)

        def draw(*names: str) -> np.ndarray | None:
            if any(parts[n].size == 0 for n in names):
                return None
            return np.sort(sum(self._rng.choice(parts[n], DRAWS) for n in names))

        return {"local": draw("arrival", "wait"), "edge": draw("arrival", "wait", "pull"),
                "cloud": draw("arrival", "wait", "pull", "cloud")}

    def predict(self, shares: Mapping[str, float], q: float,
                paths: Mapping[str, np.ndarray | None]) -> float | None:
        """The ``q`` quantile of latency (seconds) for a point whose frames leave at each exit
        with ``shares`` (``local``, ``edge``, ``cloud``), over ``paths`` (:meth:`paths`); None
        when a path it uses was never measured."""
        used = {k: s for k, s in shares.items() if s > 0}
        if not used or any(paths.get(k) is None for k in used):
            return None
        return mixture_quantile({k: paths[k] for k in used}, used, q)  # type: ignore[misc]
