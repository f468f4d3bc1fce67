"""Device messages in: decoded, checked, and fed to the
:class:`~ddnn.edge.assembler.FrameAssembler`.

A message is taken only when everything about it is right: its size, its envelope, its
deployment, its model (the one the device's retained status names, for compact messages that
leave it to their channel) and version (the running one, the one before an over-the-air update,
or one announced for it: devices switch one after another), its device (one of this edge's, and
the one whose topic carried it), its codec and its shape. Anything else is dropped with a reason,
which the edge's events count (``on_dropped``); each reason is logged once. Which versions are
taken is :class:`~ddnn.edge.versions.AcceptedVersions`'. Status messages keep the assembler's
roster of which devices are alive and which push their features; a device back online is
pulled again for what it missed (:meth:`FeaturePulls.again`).

A frame the assembler declares ready goes to :meth:`FrameScheduler.ready
<ddnn.edge.scheduler.FrameScheduler.ready>`; a pulled detail to :meth:`DetailPulls.add`.
Runs on the MQTT thread and on the HTTP handlers' threads.

The hot path is a device's scores over MQTT, six times per frame: its topic is looked up, not
parsed; a compact scores message of the running version is read in place
(:class:`ScoresReader`), and messages are counted in plain integers
(:class:`~ddnn.edge.counts.MessageCounts`) handed to the events in bulk. Everything else, and
anything unusual about such a message, takes the full path (:func:`ddnn.envelope.decode`),
which takes it or says why not.
"""

from __future__ import annotations

import logging
import math
import struct
import time
from collections.abc import Sequence

import numpy as np

from ddnn import envelope as env
from ddnn.bundle import Manifest
from ddnn.codec import FeatureCodec
from ddnn.edge.assembler import Drop, Frame, FrameAssembler
from ddnn.edge.counts import MessageCounts
from ddnn.edge.escalation import DetailPulls
from ddnn.edge.events import EdgeEvents
from ddnn.edge.feedback import FeedbackDesk
from ddnn.edge.pulls import FeaturePulls
from ddnn.edge.scheduler import FrameScheduler
from ddnn.edge.score_bounds import ScoreBounds
from ddnn.edge.versions import AcceptedVersions
from ddnn.envelope import DecodeError, MessageType
from ddnn.plumbing.throttle import LogThrottle
from ddnn.status import status_fields
from ddnn.topics import Topics

log = logging.getLogger(__name__)

CLOCK_TOLERANCE = 30.0  # seconds a device's timestamps may be behind the edge's clock
FUTURE_TOLERANCE = 2.0  # and ahead of it: no capture comes from the future (NTP: milliseconds)
MAX_ROUTES = 1024  # device topics remembered with their device and kind (bounded: any can come)
_U32 = struct.Struct("<I")
_FLOAT_CODECS = {"float16": "e", "float32": "f"}  # their struct formats


class ScoresReader:
    """Reads the hot message, a compact scores envelope of one version, without building an
    :class:`~ddnn.envelope.Envelope`: ``read`` gives ``(frame, capture ticks, scores)`` (a
    tuple of C floats), or None for anything else (another version, an identity block, a
    non-minimal varint, a wrong size, a value that is not finite...), which the full decoder
    then handles. What it accepts, the full path accepts with the same values (a property test
    holds them equal).
    """

    def __init__(self, version: str, codec: str, classes: int):
        # The fixed bytes, as the encoder writes them: format and type byte, and the version
        # (after frame 0's one-byte varint and the capture time).
        sample = env.encode(env.pack(MessageType.SCORES, version=version, frame=0, timestamp=0,
                                     tensor=np.zeros((1, classes), np.float32), codec=codec))
        self.head, self.version = sample[:2], sample[7 : 8 + len(version)]
        kind = _FLOAT_CODECS.get(codec)  # None: other codecs take the full path
        self.values = None if kind is None else struct.Struct(f"<{classes}{kind}")
        self.size = FeatureCodec(codec).payload_size((1, classes))

    def read(self, data: bytes) -> tuple[int, int, tuple[float, ...]] | None:
        if self.values is None or data[:2] != self.head:
            return None
        n, pos, frame, shift = len(data), 2, 0, 0
        while True:  # the frame id: LEB128, minimal, at most MAX_VARINT bytes
            if pos >= n or pos >= 2 + env.MAX_VARINT:
                return None
            byte = data[pos]
            pos += 1
            frame |= (byte & 0x7F) << shift
            if not byte & 0x80:
                break
            shift += 7
        if (byte == 0 and pos > 3) or frame >= 1 << 64:
            return None
        start = pos + _U32.size + len(self.version)
        if n - start != self.size or data[pos + _U32.size : start] != self.version:
            return None
        # Plain floats, not numpy: small numpy calls cost more than the local exit's math.
        x = self.values.unpack_from(data, start)  # (float16 and float32 widen exactly)
        if not math.isfinite(sum(x)):  # NaN and ∞ propagate; finite values cannot overflow
            return None
        return frame, _U32.unpack_from(data, pos)[0], x


class Taken:
    """The fast path took a message that completed no frame."""


TAKEN = Taken()


class Ingest:
    """Takes device messages for one deployment's devices (``devices[i]`` runs view ``i``),
    readying frames for ``scheduler``. ``pulls`` (None: the devices push their features) is
    asked again for what a device back online missed; ``details`` takes the pulled details of
    escalated frames (None: none are pulled); ``feedback`` (set when operators label frames)
    the features pulled for a labelled frame."""

    def __init__(self, assembler: FrameAssembler, topics: Topics, devices: Sequence[str],
                 manifest: Manifest, *, scheduler: FrameScheduler, events: EdgeEvents,
                 counts: MessageCounts | None = None, pulls: FeaturePulls | None = None,
                 details: DetailPulls | None = None):
        self.assembler, self.topics, self.scheduler = assembler, topics, scheduler
        self.devices = list(devices)
        self.views = {d: i for i, d in enumerate(self.devices)}
        self.events, self.pulls, self.details = events, pulls, details
        self.feedback: FeedbackDesk | None = None  # takes features pulled for a label
        self.counts = counts or MessageCounts(events)
        self._routes: dict[str, tuple[str, str]] = {}  # topic -> (device, kind)
        self._skewed = LogThrottle()  # devices whose clock was found off (warned once each)
        self._logged = LogThrottle()  # drop reasons: one line each
        self.versions = AcceptedVersions(manifest)
        self.draining = False  # stopping: frames under way finish, new ones are declined
        self.declined = 0  # messages of new frames declined while draining
        # Updates keep the codecs and wire shapes (ddnn.plumbing.ota.compatible).
        self._scores_shape = (1, manifest.num_classes)
        self._feature_shape = (1, *manifest.devices[0].output("features").sample_shape)
        self._reader = _reader_for(manifest)

    def serve(self, manifest: Manifest) -> None:
        """Take messages of ``manifest``'s version (an update), still those of the one before."""
        self.versions.serve(manifest)
        self._reader = _reader_for(manifest)

    def decline_new_frames(self) -> None:
        """From now on, decline messages of frames not under way (for the next edge)."""
        self.draining = True

    # --- MQTT -----------------------------------------------------------------------------------

    def on_message(self, topic: str, payload: bytes) -> bool | None:
        """One MQTT message; False declines it (while draining: a frame for the next edge)."""
        route = self._routes.get(topic)
        if route is None:
            route = self.topics.parse_device(topic)
            if route is None:
                self._drop("topic", f"message on unexpected topic {topic!r}")
                return None
            if route[0] in self.views and len(self._routes) < MAX_ROUTES:
                self._routes[topic] = route
        device, kind = route
        if kind == "status":
            self.on_status(device, payload)
        elif self.draining and not self.handled_here(payload):
            self.declined += 1
            return False
        else:
            self._accept(payload, device)
        return None

    def handled_here(self, payload: bytes) -> bool:
        """Whether a draining edge still takes this message: its frame is under way here."""
        try:
            frame = env.decode(payload).frame
        except DecodeError:
            return True  # dropped and counted here like any malformed message
        return self.assembler.knows(frame)

    def on_status(self, device: str, payload: bytes) -> None:
        """A device's retained status: online (with its mode) or offline (its last will)."""
        view = self.views.get(device)
        info = status_fields(payload)
        state = info.get("state")
        if view is None or state not in ("online", "offline"):
            return  # other deployments' or tools' devices, or an empty retained message
        model = info.get("model")
        if state == "online" and isinstance(model, str) and model:
            # The model its compact messages are of (they carry only the version).
            self.versions.models[device] = model.rsplit(":", 1)[0]
        online = state == "online"
        # A pushing device is never asked for features.
        pushing = info["mode"] == "push" if online and "mode" in info else None
        self.assembler.roster.set_online(view, online, pushing)
        log.info("device %s (view %d) is %s", device, view, state)
        self.events.on_device_status(device, online)
        if online and self.pulls is not None:
            self.pulls.again(self.assembler)  # it may have missed pulls while away

    # --- envelopes (MQTT and HTTP) -------------------------------------------------------------

    def accept(self, payload: bytes, device: str | None = None) -> str | None:
        """Take one device message; returns the drop reason, or ``None`` when taken.

        ``device``: the device whose topic carried it (None over HTTP). Counted at once.
        """
        try:
            return self._accept(payload, device)
        finally:
            self.counts.flush()

    def _accept(self, payload: bytes, device: str | None) -> str | None:
        try:
            frame = self._take_fast(payload, device) or self._take(payload, device)
        except Drop as d:
            device = self.devices[d.view] if d.view is not None else None
            self._drop(d.reason, str(d), device, d.lag)
            return d.reason
        if isinstance(frame, Frame):
            self.scheduler.ready(frame)
        return None

    def _take_fast(self, payload: bytes, device: str | None) -> Frame | Taken | None:
        """The hot path: a compact scores message of the running version from one of this
        edge's devices on its own topic. None: not one, the full path takes it."""
        reader, versions = self._reader, self.versions
        if (reader is None or device is None
                or versions.models.get(device, versions.manifest.name) != versions.manifest.name
                or len(payload) > env.MAX_MESSAGE):
            return None
        read = reader.read(payload)
        view = self.views.get(device)
        if read is None or view is None:
            return None
        frame, ticks, scores = read
        self.counts.count("scores", reader.size, len(payload) - reader.size)
        wall = time.time()
        captured = self._capture_time(device, env.capture_time(ticks, wall), wall)
        f = self._scores(view, frame, scores, captured, time.monotonic(), versions.bounds)
        return TAKEN if f is None else f

    def _take(self, payload: bytes, device: str | None) -> Frame | None:
        e, device, version = self._decode(payload, device)
        view = self.views[device]
        kind = e.kind.name.lower()
        # (a deflated payload counts as sent: the bytes after the header)
        sent = len(payload) - env.payload_offset(payload) if e.deflate else len(e.payload)
        self.counts.count(kind, sent, len(payload) - sent)
        m, a, now = self.versions.manifest, self.assembler, time.monotonic()
        captured = self._capture_time(device, e.timestamp, time.time())
        if e.kind == MessageType.SCORES and not a.single_view:
            x = self._tensor(e, m.codec["scores"], self._scores_shape)
            bounds = self.versions.bounds_of(version)
            return self._scores(view, e.frame, tuple(x[0].tolist()), captured, now, bounds)
        if e.kind == MessageType.ABSENT:
            return a.add_scores(view, e.frame, None, captured, now)
        if e.kind == MessageType.SKIPPED:  # its device fell behind: nobody waits for the view
            f = a.add_scores(view, e.frame, None, captured, now, skipped=True)
            self.events.on_skipped(device)  # (counted once taken: not a duplicate or late one)
            return f
        if e.kind == MessageType.FEATURES:
            x = self._tensor(e, m.codec["device_features"], self._feature_shape)
            # (features pulled for an operator's label: their frame was answered long ago)
            if self.feedback is not None and self.feedback.offer(view, e.frame, x):
                return None
            return a.add_features(view, e.frame, x, captured, now)
        if e.kind == MessageType.DETAIL and m.escalated is not None and self.details:
            shape = (1, *m.devices[view].output("detail").sample_shape)
            self.details.add(view, e.frame, self._tensor(e, m.codec["device_detail"], shape))
            return None
        raise Drop("malformed", f"a device cannot send {kind} messages")

    def _scores(self, view: int, frame: int, scores: tuple[float, ...], captured: float,
                now: float, bounds: ScoreBounds) -> Frame | None:
        """Scores within the bundle's bounds go to the assembler; others are refused (a Drop),
        their device judged for them, and their frame waits no more for the view."""
        why = bounds.check(scores)
        if why is None:
            return self.assembler.add_scores(view, frame, scores, captured, now)
        f = self.assembler.refuse(view, frame, "scores", now)
        if f is not None:
            self.scheduler.ready(f)
        raise Drop("scores", f"{self.devices[view]}, frame {frame}: {why}", view=view)

    def _decode(self, payload: bytes, device: str | None
                ) -> tuple[env.Envelope, str, tuple[str, str]]:
        """The envelope of a message of this deployment, model and devices, with its device
        and its ``(model, version)``; else a Drop."""
        if len(payload) > env.MAX_MESSAGE:
            raise Drop("oversized", f"message of {len(payload)} bytes")
        try:
            e = env.decode(payload)
        except DecodeError as err:
            raise Drop("malformed", str(err)) from None
        m = self.versions.manifest
        if not e.has_identity:  # compact: the channel says who sent it
            if device is None:
                raise Drop("malformed", "a message that does not name its device came on a "
                                        "channel that does not either")
            e = e.bound(model=self.versions.model_of(device),
                        deployment=self.topics.deployment, device=device)
        elif device is not None and e.device != device:
            raise Drop("malformed", f"device {e.device!r} publishing on {device!r}'s topic")
        if e.deployment != self.topics.deployment:
            raise Drop("deployment", f"message for deployment {e.deployment!r}")
        version = (e.model or "", e.version)
        if not self.versions.takes(version):
            raise Drop("model", f"message for model {e.model}:{e.version}, serving "
                                f"{m.name}:{m.version}")
        if e.device is None or e.device not in self.views:
            raise Drop("unknown_device", f"device {e.device!r} is not one of {self.devices}")
        return e, e.device, version

    def _capture_time(self, device: str, timestamp: float, wall: float) -> float:
        """A message's capture time, or ``wall`` (now) when the device's clock is far off (then
        the latency of its frames would be nonsense): counted, and warned once per device."""
        if -CLOCK_TOLERANCE <= timestamp - wall <= FUTURE_TOLERANCE:
            return timestamp
        self.events.on_clock_skewed(device)
        if self._skewed(device):
            log.warning("device %s stamps its frames %+.1f s from this edge's clock (more than "
                        "%.0f s behind or %.0f s ahead): its latencies are measured from "
                        "arrival; check its NTP", device, timestamp - wall, CLOCK_TOLERANCE,
                        FUTURE_TOLERANCE)
        return wall

    def _tensor(self, e: env.Envelope, codec: str, shape: tuple[int, ...]) -> np.ndarray:
        size = FeatureCodec(codec).payload_size(shape)
        if e.codec != codec or len(e.payload) != size:
            raise Drop("shape", f"{e.kind.name.lower()} of {e.device} is {len(e.payload)} "
                                f"bytes of {e.codec}, expected {size} of {codec} {shape}")
        try:
            return e.tensor(shape)
        except DecodeError as err:
            raise Drop("malformed", str(err)) from None

    def _drop(self, reason: str, detail: str, device: str | None = None,
              lag: float | None = None) -> None:
        self.events.on_dropped(reason, device, lag)
        if reason == "late":
            return  # the edge's log warns once per device, with its lag
        # One line per kind, the counters say the rest; push mode's extra features are normal.
        if reason != "unneeded" and self._logged(reason):
            log.warning("dropped a message (%s): %s; further ones are only counted", reason, detail)


def _reader_for(m: Manifest) -> ScoresReader | None:
    """The hot message's reader for ``m``'s version (a one-view bundle's devices send none)."""
    return None if m.views == 1 else ScoresReader(m.version, m.codec["scores"], m.num_classes)
