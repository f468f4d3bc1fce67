"""The device agent: one camera's frames through the bundle's device segment, out to the edge.

With several views (the paper's setting) a device publishes its class scores for every frame
and keeps its packed features for a while: the edge pulls them for the frames that do not exit
locally (``pull``), or the device sends them along with the scores (``push``: no round trip,
but features for every frame). With one view the device decides its own exit with the local
threshold: a confident frame produces its result here; the others send their features up.

A bundle that escalates (``manifest.escalated``) also gives each frame a *detail* (the view at
reduced resolution, :mod:`ddnn.hierarchy`), kept beside the features: the edge pulls it
(``DETAIL_REQUEST``) for the frames still unsure after its exit, and it goes up to the cloud.

A frame's features (or detail) are sent once per pull, not once per request: a request
repeating a pull this device answered less than :data:`REPULL_AFTER` seconds ago, on the same
connection to the broker, is ignored and counted (a flood of requests cannot make it resend).
The edge's own re-pulls after an outage still get an answer: they come after the device
reconnected, or after that time.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ddnn import envelope as env
from ddnn.device.message import OutMessage
from ddnn.device.settings import DeviceSettings
from ddnn.device.sources import is_absent
from ddnn.envelope import DecodeError, MessageType
from ddnn.exits import entropy_of_logits
from ddnn.plumbing.throttle import LogThrottle
from ddnn.result import result_for
from ddnn.runtime import BundleRuntime, transmit

log = logging.getLogger(__name__)

REPULL_AFTER = 5.0  # seconds before the same connection may pull a frame's features again


@dataclass
class DeviceStats:
    """Counts of one run, logged at exit."""

    frames: int = 0
    absent: int = 0
    skipped: int = 0  # frames dropped because the device fell behind its source (a replay)
    local_exits: int = 0
    sent: collections.Counter = field(default_factory=collections.Counter)
    payload_bytes: int = 0
    header_bytes: int = 0
    pulls_answered: int = 0
    pulls_missed: int = 0
    pulls_repeated: int = 0  # requests for a frame answered moments ago: ignored
    bad_requests: int = 0


class DeviceAgent:
    """Runs the device segment of ``settings.view`` on frames and hands what it sends to ``emit``.

    ``settings`` are resolved for the bundle (``DeviceService.from_settings`` does that): its
    ``mode`` is the one to run. ``emit`` is called from the frame and the transport threads.
    """

    def __init__(self, runtime: BundleRuntime, settings: DeviceSettings,
                 emit: Callable[[OutMessage], None]):
        runtime.runner(f"device-{settings.view}")  # load the session now, not at the first frame
        m = runtime.manifest
        self.runtime, self.settings, self._emit = runtime, settings, emit
        self.manifest = m
        self.single_view = m.views == 1
        self.threshold = m.policy.with_overrides(
            local=settings.local_threshold).threshold("local")
        self.stats = DeviceStats()
        # frame -> its features message (None in push mode: they went up) and, where the
        # bundle escalates, its detail message: their tensors packed, each message encoded
        # only if pulled (most frames never are: coding a detail costs about 30 µs)
        self._features: collections.OrderedDict[
            int, tuple[env.Envelope | None, env.Envelope | None]] = collections.OrderedDict()
        # (frame, what was pulled) -> (when, connection number) it was last sent on a pull
        self._answered: dict[tuple[int, MessageType], tuple[float, int]] = {}
        # The transport's count of connections to the broker (MqttClient.connects): a pull
        # repeated after a reconnection is answered at once.
        self.connections: Callable[[], int] = lambda: 0
        self._lock = threading.Lock()
        self._last_request = time.monotonic()
        # Over MQTT the topic and the retained status say who sends (ddnn.envelope); the HTTP
        # fallback's channel names nobody, so there each message carries its identity.
        self._identity = (dict(model=m.name, deployment=settings.deployment,
                               device=settings.device_id) if not settings.broker else {})
        self._ids = dict(version=m.version, **self._identity)
        self._previous: tuple[str, str] | None = None  # the version before the last swap
        self._frame_lock = threading.Lock()  # a frame runs on one version, start to end
        self._once = LogThrottle()  # each kind of bad or repeated pull: one line, then counted

    # --- over-the-air updates ---------------------------------------------------------------

    def swap(self, runtime: BundleRuntime) -> None:
        """Run the next frames on ``runtime``; the frame under way finishes on the old one."""
        runtime.runner(f"device-{self.settings.view}")  # load before taking the lock
        m = runtime.manifest
        with self._frame_lock:
            old = self.manifest
            self._previous = (old.name, old.version)
            self.runtime, self.manifest = runtime, m
            self.single_view = m.views == 1
            self.threshold = m.policy.with_overrides(
                local=self.settings.local_threshold).threshold("local")
            self._identity = {**self._identity, "model": m.name} if self._identity else {}
            self._ids = dict(version=m.version, **self._identity)

    # --- per frame --------------------------------------------------------------------------

    def process(self, frame: int, image: np.ndarray, captured: float | None = None) -> None:
        """Run one frame and queue what it sends (``captured``: wall-clock capture time)."""
        with self._frame_lock:
            self._process(frame, image, captured)

    def skip(self, frame: int, captured: float) -> None:
        """Tell the edge this frame will not come (the device fell behind its source), so no
        frame waits for it."""
        with self._frame_lock:
            self.stats.frames += 1
            self.stats.skipped += 1
            self._queue("skipped", env.pack(MessageType.SKIPPED, frame=frame, timestamp=captured,
                                            **self._ids))

    def _process(self, frame: int, image: np.ndarray, captured: float | None) -> None:
        ts = time.time() if captured is None else captured
        self.stats.frames += 1
        if is_absent(image):
            self.stats.absent += 1
            self._queue("absent", env.pack(MessageType.ABSENT, frame=frame, timestamp=ts,
                                           **self._ids))
            return
        out = self.runtime.device_outputs(self.settings.view, image[None])
        scores, features = out["scores"], out["features"]
        m = self.manifest
        feat_msg = env.pack(MessageType.FEATURES, frame=frame, timestamp=ts, tensor=features,
                            codec=m.codec["device_features"], **self._ids)
        if self.single_view:  # (a one-view frame does not escalate: nothing else to fuse)
            self._single_view_exit(frame, scores, feat_msg, ts)
            return
        detail = None
        if self.runtime.detail_codec is not None:  # the bundle escalates: keep the detail too
            detail = env.pack(MessageType.DETAIL, frame=frame, timestamp=ts,
                              tensor=out["detail"], codec=m.codec["device_detail"],
                              deflate=True, **self._ids)
        push = self.settings.mode == "push"  # the features go up with the scores, unasked
        if not push or detail is not None:
            self._keep(frame, None if push else feat_msg, detail)
        self._queue("scores", env.pack(MessageType.SCORES, frame=frame, timestamp=ts,
                                       tensor=scores, codec=m.codec["scores"], **self._ids))
        if push:
            self._queue("features", feat_msg)

    def _keep(self, frame: int, features: env.Envelope | None, detail: env.Envelope | None
              ) -> None:
        """Keep a frame's features and detail messages for the edge's pulls."""
        with self._lock:
            self._features[frame] = (features, detail)
            while len(self._features) > self.settings.keep:
                old, _ = self._features.popitem(last=False)
                self._answered.pop((old, MessageType.REQUEST), None)
                self._answered.pop((old, MessageType.DETAIL_REQUEST), None)

    def _single_view_exit(self, frame: int, scores: np.ndarray, feat_msg: env.Envelope,
                          ts: float) -> None:
        # The same path as ddnn evaluate: scores through their codec, then the local exit layer.
        received = transmit(scores, self.runtime.scores_codec)[:, None]
        local = self.runtime.local(received, np.ones((1, 1), bool))
        eta = float(entropy_of_logits(local)[0])
        if eta < self.threshold:
            self.stats.local_exits += 1
            result = result_for(frame=frame, scores=local[0], classes=self.manifest.classes,
                                exit="local", entropy=eta, views=[self.settings.device_id],
                                latency_ms=(time.time() - ts) * 1000)
            self._emit(OutMessage("results", result.to_json(), frame))
            self.stats.sent["results"] += 1
        else:
            self._queue("features", feat_msg)

    def _queue(self, kind: str, message: env.Envelope) -> None:
        data = env.encode(message)
        self._emit(OutMessage(kind, data, message.frame))
        self.stats.sent[kind] += 1
        self.stats.payload_bytes += len(message.payload)
        self.stats.header_bytes += len(data) - len(message.payload)

    # --- feature pulls (transport thread) ----------------------------------------------------

    def handle_request(self, data: bytes) -> None:
        """Answer the edge's pull for a frame (its features, or its detail) if this device's
        view is in its mask."""
        self._last_request = time.monotonic()
        try:
            req = env.decode(data)
            if req.kind not in (MessageType.REQUEST, MessageType.DETAIL_REQUEST):
                raise DecodeError(f"expected a request, got {req.kind.name.lower()}")
            # Any version of this model: during a roll-out the edge may run the next version
            # before this device does, and updates keep the wire format (ota.compatible).
            # (The topic names the edge; a request carries a model only if it names one.)
            if req.model not in (None, self.manifest.name):
                raise DecodeError(f"request for model {req.model}:{req.version}")
            mask = req.tensor((self.manifest.views,))
        except DecodeError as e:
            self.stats.bad_requests += 1
            if self._once("bad request"):
                log.warning("dropping a bad feature request (logged once): %s", e)
            return
        view = self.settings.view
        if mask.ndim != 1 or mask.shape[0] <= view or mask[view] <= 0:
            return
        detail = req.kind == MessageType.DETAIL_REQUEST
        now, connection = time.monotonic(), self.connections()
        with self._lock:
            kept = self._features.get(req.frame)
            data = kept[detail] if kept is not None else None
            last = self._answered.get((req.frame, req.kind))
            repeated = (data is not None and last is not None
                        and last[1] == connection and now - last[0] < REPULL_AFTER)
            if data is not None and not repeated:
                self._answered[(req.frame, req.kind)] = (now, connection)
        what = "detail" if detail else "features"
        if data is None:
            self.stats.pulls_missed += 1
            log.debug("pull for frame %d: %s not kept", req.frame, what)
            return
        if repeated:
            self.stats.pulls_repeated += 1
            if self._once("repeated pull"):
                log.warning("ignoring a repeated pull for frame %d, answered %.1f s ago (logged "
                            "once; counted)", req.frame, now - last[0])  # type: ignore[index]
            return
        data = env.encode(data)  # (coded now that it is pulled)
        # (the detail travels on the features topic: the edge tells them apart by type)
        self._emit(OutMessage("features", data, req.frame))
        self.stats.pulls_answered += 1
        self.stats.sent[what] += 1
        header = env.payload_offset(data)  # (a detail's payload is counted as coded)
        self.stats.payload_bytes += len(data) - header
        self.stats.header_bytes += header

    def seconds_since_request(self) -> float:
        return time.monotonic() - self._last_request

    # --- a whole replay ---------------------------------------------------------------------

    def replay(self, source, stop: threading.Event, start_at: float | None = None) -> None:
        """Process every frame of ``source`` at ``settings.fps`` until done or ``stop`` is set.

        ``start_at`` (Unix time; default ``settings.start_at``): when frame 0 is captured, so
        devices given the same time capture frame n together.
        """
        period = 1.0 / self.settings.fps if self.settings.fps > 0 else 0.0
        lag = self.settings.max_lag_ms / 1000
        max_lag = max(lag, period) if period and lag > 0 else float("inf")  # (inf: never skip)
        start = time.time()
        start_at = self.settings.start_at if start_at is None else start_at
        if start_at is not None:
            if start > start_at:
                log.warning("started %.3f s after the agreed start; catching up",
                            start - start_at)
            start = start_at
        for n, (frame, image) in enumerate(source):
            if stop.is_set():
                return
            # Wall-clock schedule, so devices given one --start-at capture frame n together.
            due = start + n * period
            delay = due - time.time()
            if delay > 0 and stop.wait(delay):
                return
            if -delay > max_lag and not is_absent(image):
                # This frame can no longer be on time: drop it, as a camera's leaky queue does,
                # and say so; the lag never grows past max_lag. (An absent view costs no
                # inference: it is said as such.)
                self.skip(frame, due)
                continue
            # (its capture time is its slot in the schedule: a late answer's latency says so)
            self.process(frame, image, due if period else None)
