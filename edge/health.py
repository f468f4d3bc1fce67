"""The edge's health: whether it can serve now, and why not (``/healthz`` = ``/readyz``), and
whether its threads run (``/livez``).

Not ready (503, with a JSON list of reasons) while:

* the broker has been unreachable for longer than ``--health-grace`` (or refused this edge's
  credentials for good);
* the worker is stalled: frames are pending and none has been answered for ``--stall-after``
  seconds while the broker is connected (deadlines are frozen while it is away, by design);
* every device is offline: its retained status says so (the last will), or, once the edge has
  run for ``--health-grace``, it never said anything;
* a thread of the edge has ended (the service's lifecycle lists them: ``/livez``).

A drift alarm (``--audit-rate``, :mod:`ddnn.edge.drift`: at the configured thresholds the
exits' answers disagree with the cloud's more than ``--agreement-budget`` allows) is named
under ``warnings``, by how much and with the thresholds in force meanwhile, and leaves the edge
ready: its answers still go out, and a readiness probe taking it out of service would cut off
the devices that post over HTTP. So is a latency objective (``--latency-slo``,
:mod:`ddnn.edge.planner`) that cannot be met or was missed over the last seconds, and a drift
monitor whose thresholds it overrules.

Ready again by itself once the cause is gone. A small thread samples the worker's progress
every :data:`SAMPLE` seconds, so a stall is measured, not guessed from one look.

:class:`EdgeVersionProbe` is what the probation of an over-the-air update looks at
(:mod:`ddnn.plumbing.probation`): frames failing in the edge's segments, the cloud refusing the
version, the worker stalled.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ddnn.edge.aggregator import EdgeAggregator, EdgeSnapshot
from ddnn.edge.settings import EdgeSettings
from ddnn.plumbing.health import Check
from ddnn.plumbing.lifecycle import Worker
from ddnn.plumbing.mqtt import MqttClient
from ddnn.plumbing.ota import BundleUpdater
from ddnn.plumbing.probation import Look

SAMPLE = 0.25  # seconds between two samples of the worker's progress


class EdgeHealth:
    """Watches one edge through its read-only :meth:`EdgeAggregator.snapshot` (and its
    metrics); ``updater`` returns its bundle updater (None without one)."""

    def __init__(self, agg: EdgeAggregator, settings: EdgeSettings, mqtt: MqttClient | None,
                 updater: Callable[[], BundleUpdater | None] = lambda: None,
                 liveness: Callable[[], Check] = Check):
        self.agg, self.settings, self.mqtt = agg, settings, mqtt
        self._updater = updater
        self.liveness = liveness  # the service's lifecycle says which threads run
        self.started = time.monotonic()
        self._answered = agg.snapshot().answered
        self._progress_at = self.started  # last sample with progress, or nothing pending
        self._done = threading.Event()
        self._sampler = Worker("edge-health", self._sample_loop, stop=self._done.set, join=2)

    # --- sampling --------------------------------------------------------------------------

    def start(self) -> EdgeHealth:
        self.started = self._progress_at = time.monotonic()
        self._sampler.start()
        return self

    def stop(self) -> None:
        self._sampler.stop()

    def alive(self) -> bool:
        return self._sampler.alive()

    def _sample_loop(self) -> None:
        while not self._done.wait(SAMPLE):
            self.sample()

    def sample(self, now: float | None = None) -> None:
        """One look at the worker: progress is an answer, or nothing left to answer."""
        now = time.monotonic() if now is None else now
        snap = self.agg.snapshot()
        if snap.answered != self._answered or snap.pending == 0 or not self._connected():
            self._progress_at = now
        self._answered = snap.answered

    def _connected(self) -> bool:
        return self.mqtt is None or self.mqtt.connected.is_set()

    def stalled_for(self) -> float:
        """Seconds frames have been pending without an answer (0 when none pend)."""
        if self.agg.snapshot().pending == 0:
            return 0.0
        return time.monotonic() - self._progress_at

    # --- the checks ------------------------------------------------------------------------

    def device_states(self) -> dict[str, str]:
        """Each device's last status: online, offline, or unknown (never said)."""
        gauge = self.agg.metrics.devices_online
        states = {}
        for d in self.agg.snapshot().devices:
            v = gauge.get(device=d)
            states[d] = "unknown" if v is None else ("online" if v else "offline")
        return states

    def readiness(self) -> Check:
        s, now = self.settings, time.monotonic()
        states = self.device_states() if self.mqtt is not None else {}
        check = snapshot_check(self.agg.snapshot())
        check.details.update(broker_connected=self._connected(), devices=states)
        updater = self._updater()
        if updater is not None:
            check.details["bundle"] = updater.status()
        if self.mqtt is not None:
            self._broker_reasons(check, now, self.mqtt)
            grown = now - self.started > s.health.health_grace
            if states and all(st == "offline" or (st == "unknown" and grown)
                              for st in states.values()):
                check.reasons.append("every device is offline: " + ", ".join(
                    f"{d} ({st if st == 'offline' else 'never seen'})"
                    for d, st in states.items()))
        stall = self.stall_reason()
        if stall is not None:
            check.reasons.append(stall)
        check.reasons += self.liveness().reasons
        return check

    def stall_reason(self) -> str | None:
        """Why the worker counts as stalled, or None."""
        stalled, s = self.stalled_for(), self.settings
        after = s.health.stall_after
        if stalled > after and self._connected():
            return (f"worker stalled: {self.agg.snapshot().pending} frames pending and none "
                    f"answered for {stalled:.0f} s (more than --stall-after {after:g} s)")
        return None

    def _broker_reasons(self, check: Check, now: float, mqtt: MqttClient) -> None:
        grace = self.settings.health.health_grace
        if mqtt.refused is not None:
            check.reasons.append(f"the broker refused this edge for good: {mqtt.refused}")
            return
        since = mqtt.disconnected_since
        if since is not None and now - since > grace:
            check.reasons.append(f"broker {mqtt.url} unreachable for {now - since:.0f} s (more "
                                 f"than --health-grace {grace:g} s){mqtt.attempts.last_attempt()}")


class EdgeVersionProbe:
    """What the edge sees of the bundle version it runs, for its probation: frames that failed
    in its segments (``processing_failed``), the cloud answering that it does not serve the
    version (``unknown_version``), a stalled worker. It worked if it answered frames."""

    def __init__(self, health: EdgeHealth):
        self.health = health
        self._last = self._counts()

    def _counts(self) -> tuple[float, float, float]:
        agg = self.health.agg
        return (agg.snapshot().answered, agg.metrics.dropped.value(reason="processing_failed"),
                agg.metrics.cloud.value(outcome="unknown_version"))

    def begin(self) -> None:
        self._last = self._counts()

    def look(self) -> Look:
        counts = self._counts()
        answered, failed, refused = (a - b for a, b in zip(counts, self._last, strict=True))
        self._last = counts
        problems = []
        if failed:
            problems.append(f"{failed:.0f} frames failed in the edge's segments "
                            '(ddnn_edge_dropped_total{reason="processing_failed"})')
        if refused:
            problems.append(f"the cloud does not serve version "
                            f"{self.health.agg.snapshot().manifest.version} ({refused:.0f} "
                            "calls answered "
                            "404)")
        stall = self.health.stall_reason()
        if stall is not None:
            problems.append(stall)
        return Look(worked=answered > 0, problems=tuple(problems))


def snapshot_check(snap: EdgeSnapshot) -> Check:
    """The numbers every health answer shows (no reasons)."""
    details = {"results": snap.answered, "pending_frames": snap.pending,
               "cloud_up": snap.cloud_up, "late_devices": list(snap.late_devices),
               "flagged_devices": dict(snap.flagged_devices)}
    if snap.drift is not None:
        details["drift"] = dict(snap.drift)
    if snap.latency is not None:
        details["latency"] = dict(snap.latency)
    warnings = []  # (the edge still serves: these do not make it unready)
    if snap.drift_reason is not None:
        warnings.append(snap.drift_reason)
    warnings += snap.latency_reasons
    if snap.late_devices:
        warnings.append(f"device(s) {', '.join(snap.late_devices)} keep arriving late: most of "
                        "their recent views came after their frames were answered (a slow board, "
                        "a congested link, or a clock that is off); their views are not fused")
    if warnings:
        details["warnings"] = warnings
    return Check(details=details)


def health_check(agg: EdgeAggregator, health: EdgeHealth | None, path: str) -> Check:
    """What ``GET path`` (/healthz, /readyz or /livez) answers; without a monitor (an HTTP
    server made on its own, in tests) the edge counts as able to serve."""
    if health is not None:
        return health.liveness() if path == "/livez" else health.readiness()
    return snapshot_check(agg.snapshot())
