"""Operators' feedback: ``POST /v1/feedback`` gives a frame the edge answered its true class.

Body ``{"frame": F, "label": L}`` (``L`` a class name of the bundle the frame ran on, or its
index), authorized by the operator's bearer token (``--operator-token`` or
``--operator-token-file``; never a device's: a device's token is refused with 403). The edge
remembers the frames it answered (:class:`AnsweredMemory`: which views it fused, and the
features of the last few it pulled); for a labelled frame it takes the features it has, pulls
the others from the devices (:class:`~ddnn.edge.pulls.FeaturePulls`: they keep a frame's
features for their last ``--keep`` frames), and records them with the hard label in its
experience (:meth:`~ddnn.edge.recorder.ExperienceRecorder.put_labelled`; ``ddnn federate``
learns from it). Device features only, never an image.

Answers: ``201`` recorded; ``400`` a body that is not such an object, or a label that is not a
class; ``401`` no or a wrong token; ``403`` a device's token; ``404`` a frame this edge has not
answered; ``409`` a frame labelled already; ``410`` a frame forgotten, or whose features no
device keeps any more; ``422`` a frame answered without any view; ``429`` too many requests
from one address; ``503`` the recorder's queue is full (retry).
"""

from __future__ import annotations

import hmac
import logging
import stat
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ddnn import bounded_json
from ddnn.bundle import Manifest
from ddnn.edge.credentials import MIN_TOKEN, HttpCredentials
from ddnn.edge.events import EdgeEvents
from ddnn.edge.pulls import FeaturePulls
from ddnn.edge.recorder import ExperienceRecorder
from ddnn.errors import ConfigError
from ddnn.plumbing.options import Option, path
from ddnn.plumbing.rate import RateLimiter

log = logging.getLogger(__name__)

MAX_BODY = 1024  # bytes of a feedback body at most
FEEDBACK_RATE = 10.0  # requests a second per client address (a burst of twice that)
HISTORY = 65536  # answered frames remembered (their views and bundle version)
KEPT = 256  # of them, the newest whose pulled features are kept (the others are pulled again)
MAX_FRAME = 2**64 - 1  # frame ids are unsigned 64-bit on the wire


@dataclass(frozen=True, kw_only=True)
class OperatorAccess:
    """Who may post feedback (``--operator-token``, ``--operator-token-file``)."""

    operator_token: str | None = None
    operator_token_file: Path | None = None

    def __post_init__(self) -> None:
        if self.operator_token is not None and self.operator_token_file is not None:
            raise ConfigError("give --operator-token or --operator-token-file, not both")
        if self.operator_token is not None:
            _check_token(self.operator_token, "--operator-token")

    @property
    def enabled(self) -> bool:
        return self.operator_token is not None or self.operator_token_file is not None

    def token(self) -> str | None:
        """The operator's token (read from its file, whose errors are a :class:`ConfigError`
        that never shows it); None: feedback is off."""
        if self.operator_token_file is None:
            return self.operator_token
        where = f"--operator-token-file {self.operator_token_file}"
        try:
            text = self.operator_token_file.read_text("utf-8").strip()
            mode = stat.S_IMODE(self.operator_token_file.stat().st_mode)
        except OSError as e:
            raise ConfigError(f"{where}: cannot read it ({e.strerror})") from None
        except UnicodeDecodeError:
            raise ConfigError(f"{where}: not UTF-8 text") from None
        _check_token(text, where)
        if mode & 0o077:
            log.warning("%s can be read by other users (mode %o): chmod 600 it", where, mode)
        return text


def _check_token(token: str, where: str) -> None:
    if len(token) < MIN_TOKEN or any(c.isspace() for c in token):
        raise ConfigError(f"{where}: the operator token needs {MIN_TOKEN} characters or more, "
                          "without spaces (e.g. `openssl rand -hex 16`)")


OPERATOR_OPTIONS = (
    Option("operator-token", str, "TOKEN",
           "bearer token of POST /v1/feedback, with which an operator labels answered frames "
           "(recorded in --experience with their features); never a device's token; unset: "
           "no feedback", secret=True),
    Option("operator-token-file", path, "FILE",
           "read the operator token from FILE (mode 0600) instead of --operator-token"),
)


class FeedbackError(Exception):
    """A refused feedback: the HTTP ``status``, a short ``outcome`` (counted) and why."""

    def __init__(self, status: int, outcome: str, message: str):
        super().__init__(message)
        self.status, self.outcome = status, outcome


def parse_feedback(body: bytes) -> tuple[int, str | int]:
    """``(frame, label)`` of a feedback body; a :class:`FeedbackError` (400) otherwise."""
    try:
        obj = bounded_json.loads(body.decode("utf-8"), max_depth=2)
    except ValueError:  # UnicodeDecodeError and JsonDepthError among them
        raise FeedbackError(400, "invalid", "the body is not JSON (UTF-8)") from None
    if not isinstance(obj, dict) or set(obj) != {"frame", "label"}:
        raise FeedbackError(400, "invalid", 'the body must be {"frame": F, "label": L}')
    frame, label = obj["frame"], obj["label"]
    if isinstance(frame, bool) or not isinstance(frame, int) or not 0 <= frame <= MAX_FRAME:
        raise FeedbackError(400, "invalid", "frame must be a frame id (an integer, 0..2**64-1)")
    if isinstance(label, bool) or not isinstance(label, (int, str)):
        raise FeedbackError(400, "invalid", "label must be a class name or a class index")
    return frame, label


def class_index(label: str | int, classes: Sequence[str]) -> int:
    """The index of ``label`` (a name or an index) among ``classes``; 400 otherwise."""
    if isinstance(label, int):
        if 0 <= label < len(classes):
            return label
        raise FeedbackError(400, "invalid", f"label {label} is not a class index "
                                            f"(0..{len(classes) - 1})")
    if label in classes:
        return list(classes).index(label)
    shown = ", ".join(classes[:20]) + (", ..." if len(classes) > 20 else "")
    raise FeedbackError(400, "invalid", f"label {label[:64]!r} is not a class ({shown})")


@dataclass
class Remembered:
    """An answered frame as the edge remembers it."""

    manifest: Manifest  # of the bundle version it ran on
    views: tuple[int, ...]  # the views fused into its answer
    features: dict[int, np.ndarray] = field(default_factory=dict)  # view -> kept features


class AnsweredMemory:
    """The last :data:`HISTORY` frames answered, and the features of the last :data:`KEPT`.

    Frames are forgotten oldest answer first; a frame id at or below one forgotten counts as
    forgotten (410), any other unknown one as never answered here (404). Thread-safe.
    """

    def __init__(self, history: int = HISTORY, kept: int = KEPT):
        self.history, self.kept = history, kept
        self._frames: OrderedDict[int, Remembered] = OrderedDict()
        self._with_features: OrderedDict[int, None] = OrderedDict()
        self.low_water = -1  # the largest frame id forgotten
        self._lock = threading.Lock()

    def remember(self, frame: int, manifest: Manifest, views: Sequence[int],
                 features: Mapping[int, np.ndarray]) -> None:
        """An answered frame (the answer's views, the features it fused or was pushed)."""
        kept = {v: features[v] for v in views if v in features}
        with self._lock:
            self._frames[frame] = Remembered(manifest, tuple(views), kept)
            self._frames.move_to_end(frame)
            if kept:
                self._kept_features(frame)
            while len(self._frames) > self.history:
                old, _ = self._frames.popitem(last=False)
                self._with_features.pop(old, None)
                self.low_water = max(self.low_water, old)

    def add_features(self, frame: int, features: Mapping[int, np.ndarray]) -> None:
        """Features that came for a remembered frame after its answer (an audited frame's,
        pulled to check it with the cloud): kept, so a label needs no second pull, which the
        devices would take for a repeat and ignore."""
        with self._lock:
            r = self._frames.get(frame)
            if r is None:
                return
            new = {v: features[v] for v in r.views if v in features and v not in r.features}
            if not new:
                return
            r.features = {**r.features, **new}
            self._kept_features(frame)

    def _kept_features(self, frame: int) -> None:
        """``frame`` holds features now: the newest; the oldest past :attr:`kept` lose theirs
        (under the lock)."""
        self._with_features[frame] = None
        self._with_features.move_to_end(frame)
        while len(self._with_features) > self.kept:
            old, _ = self._with_features.popitem(last=False)
            if old in self._frames:
                self._frames[old].features = {}

    def get(self, frame: int) -> Remembered:
        """What is remembered of ``frame`` (a copy); a :class:`FeedbackError` 404 or 410."""
        with self._lock:
            r = self._frames.get(frame)
            if r is not None:
                return Remembered(r.manifest, r.views, dict(r.features))
            forgotten = frame <= self.low_water
        if forgotten:
            raise FeedbackError(410, "expired", f"frame {frame} was answered too long ago: this "
                                                "edge no longer remembers it")
        raise FeedbackError(404, "unknown", f"frame {frame} has not been answered by this edge")


@dataclass
class _Awaited:
    """Features pulled for a labelled frame, as they come."""

    views: tuple[int, ...]
    features: dict[int, np.ndarray] = field(default_factory=dict)
    complete: threading.Event = field(default_factory=threading.Event)


class FeedbackDesk:
    """Labels answered frames: their features (remembered, else pulled with ``pulls``: None,
    nobody can be asked) and the hard label go to ``recorder``. ``wait``: seconds a labelled
    frame waits for pulled features."""

    def __init__(self, memory: AnsweredMemory, recorder: ExperienceRecorder,
                 pulls: FeaturePulls | None, *, devices: Sequence[str], events: EdgeEvents,
                 wait: float):
        self.memory, self.recorder, self.pulls = memory, recorder, pulls
        self.devices, self.events, self.wait = list(devices), events, wait
        self._awaited: dict[int, _Awaited] = {}
        self._labelled: OrderedDict[int, None] = OrderedDict()  # (bounded as the memory)
        self._lock = threading.Lock()

    def label(self, frame: int, label: str | int) -> dict:
        """Record ``frame`` with ``label``; the 201 body, or a :class:`FeedbackError`."""
        r = self.memory.get(frame)
        index = class_index(label, r.manifest.classes)
        if not r.views:
            raise FeedbackError(422, "no_views", f"frame {frame} was answered without any view: "
                                                 "no features to learn from")
        with self._lock:
            if frame in self._labelled or frame in self._awaited:
                raise FeedbackError(409, "conflict", f"frame {frame} is labelled already")
            self._labelled[frame] = None
            while len(self._labelled) > self.memory.history:
                self._labelled.popitem(last=False)
        try:
            features, pulled = self._features(frame, r)
            if not features:
                raise FeedbackError(410, "expired", f"frame {frame}: no device sent its features "
                                                    f"within {self.wait:g} s (devices keep only "
                                                    "their last --keep frames)")
            if not self.recorder.put_labelled(r.manifest, features, index):
                raise FeedbackError(503, "busy", "the experience recorder's queue is full; retry")
        except FeedbackError:
            with self._lock:
                self._labelled.pop(frame, None)
            raise
        return {"recorded": True, "frame": frame, "class": index,
                "label": r.manifest.classes[index],
                "views": [self.devices[v] for v in sorted(features)],
                "pulled": [self.devices[v] for v in sorted(pulled)]}

    def _features(self, frame: int, r: Remembered) -> tuple[dict[int, np.ndarray], list[int]]:
        """The frame's features: those remembered, and those its devices sent when pulled."""
        missing = tuple(v for v in r.views if v not in r.features)
        if not missing or self.pulls is None:
            return r.features, []
        awaited = _Awaited(missing)
        with self._lock:
            self._awaited[frame] = awaited
        try:
            self.pulls.request(frame, missing)
            awaited.complete.wait(self.wait)
        finally:
            with self._lock:
                del self._awaited[frame]
                got = dict(awaited.features)
        return {**r.features, **got}, list(got)

    def offer(self, view: int, frame: int, features: np.ndarray) -> bool:
        """Pulled features of ``view`` for ``frame`` (the ingest's thread): True when a labelled
        frame awaited them (taken), False when none does."""
        with self._lock:
            awaited = self._awaited.get(frame)
            if awaited is None or view not in awaited.views or view in awaited.features:
                return False
            awaited.features[view] = features
            if len(awaited.features) == len(awaited.views):
                awaited.complete.set()
        return True


@dataclass(frozen=True)
class Reply:
    """An HTTP answer: status, JSON body, extra headers; ``close``: the body was left unread."""

    status: int
    body: dict
    headers: dict[str, str] = field(default_factory=dict)
    close: bool = False


class FeedbackRoute:
    """``POST /v1/feedback``: the operator's token (constant-time compare), a rate per client
    address, a bounded body, then the :class:`FeedbackDesk`. Every outcome is counted
    (``events.on_feedback``)."""

    def __init__(self, desk: FeedbackDesk, token: str, events: EdgeEvents,
                 rate: float = FEEDBACK_RATE):
        self.desk, self.events = desk, events
        self._expected = f"Bearer {token}".encode()
        self._rate = RateLimiter(rate, burst=2 * rate)

    def __repr__(self) -> str:  # never the token
        return "FeedbackRoute()"

    def shares(self, tokens: Sequence[str | None]) -> bool:
        """Whether the operator's token is one of ``tokens`` (the devices')."""
        return any(hmac.compare_digest(self._expected, f"Bearer {t}".encode())
                   for t in tokens if t)

    def post(self, authorization: bytes, client: str, length: int | None,
             read: Callable[[int], bytes], devices: HttpCredentials) -> Reply:
        """One request: ``authorization`` its header, ``length`` its Content-Length (None:
        missing or bad), ``read(n)`` its body; ``devices``: the devices' credentials (a
        device's token is refused with 403)."""
        reply = self._post(authorization, client, length, read, devices)
        self.events.on_feedback(reply.body.get("outcome", "recorded"))
        if reply.status >= 400:
            log.info("feedback from %s refused (%d): %s", client, reply.status,
                     reply.body["error"])
        return reply

    def _post(self, authorization: bytes, client: str, length: int | None,
              read: Callable[[int], bytes], devices: HttpCredentials) -> Reply:
        if not hmac.compare_digest(authorization, self._expected):
            if authorization and devices.required and devices.identify(authorization):
                return _refused(403, "forbidden", "a device's token cannot post feedback; "
                                                  "use the operator token", close=True)
            why = "missing bearer token" if not authorization else "invalid bearer token"
            return _refused(401, "unauthorized", why, close=True)
        if not self._rate.allow(client):
            return _refused(429, "rate", f"over {FEEDBACK_RATE:g} requests a second",
                            {"Retry-After": "1"}, close=True)
        if length is None:
            return _refused(411, "invalid", "Content-Length required", close=True)
        if length > MAX_BODY:
            return _refused(413, "invalid", f"body over {MAX_BODY} bytes", close=True)
        try:
            frame, label = parse_feedback(read(length))
            return Reply(201, self.desk.label(frame, label))
        except FeedbackError as e:
            headers = {"Retry-After": "1"} if e.status == 503 else {}
            return _refused(e.status, e.outcome, str(e), headers)


def _refused(status: int, outcome: str, error: str, headers: dict[str, str] | None = None,
             close: bool = False) -> Reply:
    return Reply(status, {"error": error, "outcome": outcome}, headers or {}, close)
