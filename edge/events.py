"""What the edge's parts observe, reported through one typed protocol.

Every part of the edge reports what it sees (a message taken or dropped, a device flagged, a
segment's compute time, a frame answered, a call to the cloud...) by calling one ``on_*``
method of the :class:`EdgeEvents` it was given; none of them changes what the edge does. The
observers are the edge's metrics (:class:`~ddnn.edge.metrics.EdgeMetrics`, the built-in one)
and its log (:class:`~ddnn.edge.event_log.EdgeLog`); :class:`EventRunner` hands each event to
all of them, so a part holds one ``events`` and knows nothing of who listens. Control flow (a
frame answered, features pulled, a frame sent to the cloud) is never an event: it is a typed
call on the part that does it (docs/architecture.md).

In the shape of LitServe's callbacks: a class of named no-op hooks that observers override, and
a runner that calls every observer and keeps a failing one from reaching the frame's path.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from ddnn.plumbing.throttle import LogThrottle

if TYPE_CHECKING:  # (types only: drift never imports the events)
    from ddnn.edge.drift import AgreementMonitor, Decision
    from ddnn.result import Result

log = logging.getLogger(__name__)


class DeviceEvents:
    """What the edge observes of its devices and their messages."""

    def on_devices(self, devices: Sequence[str]) -> None:
        """The devices this edge serves (``devices[i]`` runs view ``i``), at its start."""

    def on_broker(self, connected: bool) -> None:
        """The edge connected to its broker, or lost it."""

    def on_received(self, kind: str, messages: int, payload_bytes: int,
                    header_bytes: int) -> None:
        """Device messages of ``kind`` taken (the ingest's counts, handed over in bulk)."""

    def on_dropped(self, reason: str, device: str | None = None,
                   lag: float | None = None) -> None:
        """A message (or a result, for ``sink``) counted and dropped; ``device``: whose, where
        it is known; ``lag``: how late (seconds) a ``late`` one came."""

    def on_refused(self, device: str, reason: str) -> None:
        """A view held for its device's conduct dropped after the fact (``ahead``: it ran
        ahead of the other devices' views)."""

    def on_device_status(self, device: str, online: bool) -> None:
        """A device's status says it is online or offline."""

    def on_clock_skewed(self, device: str) -> None:
        """A message of ``device`` stamped far from the edge's clock."""

    def on_skipped(self, device: str) -> None:
        """``device`` fell behind its source and skipped a frame (it said so)."""

    def on_flag(self, device: str, reason: str, flagged: bool) -> None:
        """A device flagged for ``reason`` (:mod:`ddnn.edge.conduct`), or cleared."""


class FrameEvents:
    """What the edge observes of frames on their way up, of the cloud and of the bundle."""

    def on_computed(self, step: str, seconds: float) -> None:
        """A segment's compute time (``local``, ``edge``); on the frame's path, so cheap."""

    def on_stage(self, stage: str, seconds: float) -> None:
        """Time a frame spent in one stage of the latency breakdown (docs/latency.md)."""

    def on_missing(self, stage: str, views: int) -> None:
        """A frame went on without ``views`` views it expected at ``stage``."""

    def on_pulled(self, kind: str) -> None:
        """A pull published to the devices (``features`` or ``detail``)."""

    def on_answered(self, result: Result, step: str, latency: float) -> None:
        """``result`` handed to the sinks; ``step``: the exit stage that ended there;
        ``latency``: capture to result (seconds)."""

    def on_settled(self, pending: int) -> None:
        """After each round of the worker: ``pending`` frames are being assembled."""

    def on_cloud_call(self, outcome: str, seconds: float | None = None,
                      model: str = "cloud") -> None:
        """A call to the cloud ended (``ok``, ``error``, ``unknown_version``,
        ``no_escalated``); ``seconds``: how long it took (``ok``, ``error``), from its oldest
        frame's hand-over to the cloud stage; ``model``: ``cloud`` or ``escalated``."""

    def on_bundle(self, model: str, version: str, running: bool) -> None:
        """The edge runs ``model:version`` for new frames, or no longer does."""

    def on_bundle_update(self, result: str) -> None:
        """An over-the-air update ``applied``, ``refused``, ``retry``-ed or ``rolled_back``."""

    def on_thresholds(self, thresholds: Mapping[str, float]) -> None:
        """The exit thresholds in force."""

    def on_latency_plan(self, point: Mapping[str, float], objective: float,
                        predicted: float | None, measured: float | None, met: bool) -> None:
        """The latency planner's operating point (``level``, ``local``, ``edge`` thresholds,
        its held-out ``accuracy``), the ``objective`` (``--latency-slo``), the percentile of
        latency it predicts and the one measured (seconds; None: not known yet), and whether
        the point is predicted to meet the objective."""


class LearningEvents:
    """What the edge observes of learning in the field: the exits checked against the cloud
    (drift, ``--audit-rate``), the experience recorded (``--experience``) and the operators'
    feedback (``POST /v1/feedback``)."""

    def on_audit(self, exit: str) -> None:
        """A frame answered at the ``exit`` early exit and sent up for the cloud to check."""

    def on_investigation(self) -> None:
        """The local exit's share moved: every early exit is audited for a while."""

    def on_threshold_change(self, direction: str) -> None:
        """The drift policy tightened or relaxed the thresholds (``tighten``, ``relax``)."""

    def on_drift(self, decision: Decision | None, monitor: AgreementMonitor) -> None:
        """Where the drift monitor stands (``decision`` None: it started afresh)."""

    def on_experience(self, outcome: str, frames: int) -> None:
        """Frames for the experience recording ``recorded``, ``dropped`` or ``failed``."""

    def on_experience_size(self, size: int) -> None:
        """Bytes of recorded experience on disk."""

    def on_feedback(self, outcome: str) -> None:
        """An operator's ``POST /v1/feedback`` answered: ``recorded``, or why not
        (:mod:`ddnn.edge.feedback`: ``unauthorized``, ``forbidden``, ``unknown``, ...)."""


class Hook(Protocol):
    """An observer's bound ``on_*`` method (each event has its own arguments)."""

    def __call__(self, *args: Any, **kwargs: Any) -> None: ...


class EdgeEvents(DeviceEvents, FrameEvents, LearningEvents):
    """The edge's observations; every method is a no-op here (override those you observe).

    Called on the thread where the observation is made (the MQTT thread, the worker, the
    cloud stage's thread, an HTTP handler): observers are thread-safe and quick.
    """


EVENTS = tuple(name for name in dir(EdgeEvents) if name.startswith("on_"))
NO_EVENTS = EdgeEvents()  # observes nothing (a part used alone, as in tests)


class EventRunner(EdgeEvents):
    """Hands every event to each of ``observers`` in order. An observer that raises is logged
    (once per observer and event) and the others still get the event: an observation never
    fails the frame it was made on."""

    def __init__(self, observers: Sequence[EdgeEvents]):
        self.observers = tuple(observers)
        self._failed = LogThrottle()
        for name in EVENTS:  # one forwarding function per event, made once
            setattr(self, name, self._forwarder(name))

    def _forwarder(self, name: str) -> Hook:
        base = getattr(EdgeEvents, name)
        # Observers that leave an event as the no-op are not called for it.
        hooks: list[Hook] = [hook for hook in (getattr(o, name) for o in self.observers)
                             if getattr(hook, "__func__", None) is not base]

        def forward(*args: Any, **kwargs: Any) -> None:
            for hook in hooks:
                try:
                    hook(*args, **kwargs)
                except Exception:  # an observer's bug must not reach the frame's path
                    owner = type(getattr(hook, "__self__", hook)).__name__
                    if self._failed((owner, name)):
                        log.exception("edge event observer %s failed in %s; its later "
                                      "failures there are not logged", owner, name)

        return forward
