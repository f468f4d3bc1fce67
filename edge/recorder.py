"""Experience recorded by the edge (``--experience DIR``): for every frame the cloud answered,
the device features the edge fused and the cloud's answer as a soft label, in the format of
:mod:`ddnn.experience`, for ``ddnn federate`` to learn from (the cloud teaches the layers above
the device stem); and for every frame an operator labelled (``POST /v1/feedback``,
:mod:`ddnn.edge.feedback`), its features with the hard label. Device features only: no image
ever reaches the edge, so none is recorded. Labelled frames are written in chunks of their own
as soon as the queue is empty (an operator's answer is rare and worth more than the cloud's).

Off the frame path: the cloud stage hands each frame over with :meth:`ExperienceRecorder.put`
(a reference to arrays it already holds, into a bounded queue; when the queue is full the
frame is dropped and counted), and a thread of its own gathers frames into chunks, writes
them (a temporary name, then renamed) and prunes the oldest chunks past ``--experience-max-mb``.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ddnn import experience
from ddnn.bundle import Manifest
from ddnn.edge.events import NO_EVENTS, EdgeEvents
from ddnn.edge.pipeline import Scores
from ddnn.errors import ConfigError
from ddnn.exits import softmax
from ddnn.plumbing.lifecycle import Worker
from ddnn.plumbing.options import Option, path
from ddnn.plumbing.throttle import LogThrottle

log = logging.getLogger(__name__)

QUEUE = 4096  # frames waiting to be written, at most; more are dropped (counted)
CHUNK_FRAMES = 256  # frames per chunk at most (fewer when the budget is small)
CHUNK_SECONDS = 30.0  # a chunk is written at least this often while frames come


@dataclass(frozen=True, kw_only=True)
class ExperienceRecording:
    """Where the edge records experience (``--experience``, ``--experience-max-mb``)."""

    directory: Path | None = None  # None: nothing is recorded
    max_mb: float = 256.0  # the directory's budget: the oldest chunks go first past it

    def __post_init__(self) -> None:
        if not self.max_mb > 0:
            raise ConfigError(f"experience_max_mb must be positive, got {self.max_mb}")

    @property
    def max_bytes(self) -> int:
        return int(self.max_mb * 1024 * 1024)


RECORDING_OPTIONS = (
    Option("experience", path, "DIR",
           "record experience into DIR for ddnn federate: for each frame the cloud answered, "
           "the device features the edge fused and the cloud's answer (soft label); device "
           "features only, never images (opt-in; needs --cloud, or --operator-token for "
           "operators' labels only)", key="directory"),
    Option("experience-max-mb", float, "MB",
           "the experience directory's budget: past it the oldest chunks are deleted",
           key="max_mb"),
)


@dataclass(frozen=True)
class Taught:
    """One frame the cloud answered, as the recorder keeps it until written."""

    manifest: Manifest  # of the bundle version the frame ran on
    features: Mapping[int, np.ndarray]  # view → its device features (decoded levels)
    scores: Mapping[int, Scores]  # view → the scores its device sent
    cloud: np.ndarray | None  # (C,) the cloud's scores; None for a labelled frame
    label: int = experience.NO_LABEL  # an operator's class index
    chance: float = 0.0  # of being recorded (ddnn.experience): 0 for an operator's choice

    @property
    def key(self) -> tuple[str, str, bool]:
        """Frames written together: one bundle version, labelled or taught by the cloud."""
        return self.manifest.name, self.manifest.version, self.label != experience.NO_LABEL


class ExperienceRecorder:
    """Writes frames handed over with :meth:`put` into ``settings.directory``.

    ``events`` hears of frames recorded, dropped or failed (``on_experience``) and of the
    directory's size after each write (``on_experience_size``).
    """

    def __init__(self, settings: ExperienceRecording, *, events: EdgeEvents = NO_EVENTS,
                 queue_size: int = QUEUE):
        if settings.directory is None:
            raise ConfigError("an experience recorder needs a directory")
        self.directory, self.max_bytes = Path(settings.directory), settings.max_bytes
        self.events = events
        self._queue: queue.Queue[Taught] = queue.Queue(maxsize=queue_size)
        self._stop = threading.Event()
        self._failed = LogThrottle()
        self.worker = Worker("edge-experience", self._loop, stop=self._stop.set, join=30.0)

    def start(self) -> None:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"--experience {self.directory}: cannot create it ({e})") from None
        self.events.on_experience_size(self._size())
        self.worker.start()

    def stop(self) -> None:
        self.worker.stop()  # (the thread writes what is left before it ends)

    def alive(self) -> bool:
        return self.worker.alive()

    def put(self, manifest: Manifest, features: Mapping[int, np.ndarray],
            scores: Mapping[int, Scores], cloud: np.ndarray, chance: float = 1.0) -> None:
        """Hand one frame over (any thread; never blocks: a full queue drops it, counted).
        ``chance``: of the cloud seeing it (1 for a frame sent up, the rate of its audit)."""
        try:
            self._queue.put_nowait(Taught(manifest, features, scores, cloud, chance=chance))
        except queue.Full:
            self.events.on_experience("dropped", 1)

    def put_labelled(self, manifest: Manifest, features: Mapping[int, np.ndarray],
                     label: int) -> bool:
        """Hand over one frame an operator labelled with the class index ``label`` (any
        thread; never blocks). False: the queue is full, the frame was not taken (counted)."""
        if not 0 <= label < manifest.num_classes:
            raise ValueError(f"label {label} is not a class index of {manifest.name}")
        try:
            self._queue.put_nowait(Taught(manifest, features, {}, None, label))
        except queue.Full:
            self.events.on_experience("dropped", 1)
            return False
        return True

    # --- the recorder's thread ---------------------------------------------------------------

    def _loop(self) -> None:
        pending: dict[tuple[str, str, bool], list[Taught]] = {}  # by Taught.key
        since = time.monotonic()
        while not self._stop.is_set():
            with contextlib.suppress(queue.Empty):
                self._add(pending, self._queue.get(timeout=0.2))
            old = time.monotonic() - since > CHUNK_SECONDS
            self._flush(pending, everything=old)
            if old or not pending:
                since = time.monotonic()
        while True:  # stopping: what is left, then the last chunks
            try:
                self._add(pending, self._queue.get_nowait())
            except queue.Empty:
                break
        self._flush(pending, everything=True)

    @staticmethod
    def _add(pending: dict[tuple[str, str, bool], list[Taught]], t: Taught) -> None:
        pending.setdefault(t.key, []).append(t)

    def _flush(self, pending: dict[tuple[str, str, bool], list[Taught]],
               everything: bool) -> None:
        """Write every full chunk (``everything``: the rest too; labelled frames: once the
        queue is empty)."""
        for key, frames in list(pending.items()):
            size = chunk_frames(frames[0].manifest, self.max_bytes)
            now = everything or (key[2] and self._queue.empty())
            while len(frames) >= size or (frames and now):
                self._write(frames[:size])
                del frames[:size]
            if not frames:
                del pending[key]

    def _write(self, frames: list[Taught]) -> None:
        m = frames[0].manifest
        try:
            arrays = chunk_arrays(frames)
            experience.write_chunk(self.directory, arrays.features, arrays.present,
                                   arrays.soft_label, model=(m.name, m.version),
                                   classes=list(m.classes),
                                   device_codec=m.codec["device_features"],
                                   device_scores=arrays.device_scores, label=arrays.label,
                                   chance=arrays.chance)
            experience.prune(self.directory, self.max_bytes)
        except (OSError, ValueError) as e:
            self.events.on_experience("failed", len(frames))
            if self._failed(type(e).__name__):
                log.error("could not write experience into %s: %s (later failures are counted "
                          "in ddnn_edge_experience_frames_total)", self.directory, e)
            return
        self.events.on_experience("recorded", len(frames))
        self.events.on_experience_size(self._size())

    def _size(self) -> int:
        return sum(p.stat().st_size for p in experience.chunks(self.directory))


def frame_bytes(m: Manifest) -> int:
    """A frame's size in a chunk before compression (features and scores as float16, the soft
    label float32, a present flag a view, the label int16 and the chance float32)."""
    feature = int(np.prod(m.devices[0].output("features").sample_shape))
    return 2 * m.views * (feature + m.num_classes) + 4 * m.num_classes + m.views + 2 + 4


def chunk_frames(m: Manifest, max_bytes: int) -> int:
    """Frames per chunk: at most :data:`CHUNK_FRAMES`, and small enough that a chunk is a small
    part of the budget (pruning deletes whole chunks)."""
    return int(min(CHUNK_FRAMES, max(1, max_bytes // (8 * frame_bytes(m)))))


@dataclass(frozen=True)
class ChunkArrays:
    """A chunk's arrays in :mod:`ddnn.experience`'s layout."""

    features: np.ndarray  # float16 (N, V, F, h, w)
    present: np.ndarray  # bool (N, V)
    soft_label: np.ndarray  # float32 (N, C)
    device_scores: np.ndarray | None  # float16 (N, V, C); None unless every frame has them
    label: np.ndarray  # int16 (N,), NO_LABEL where the frame has no hard label
    chance: np.ndarray  # float32 (N,): of being recorded


def chunk_arrays(frames: list[Taught]) -> ChunkArrays:
    """A chunk's arrays: ``device_scores`` only when every frame has every fused view's
    scores; the soft label of a labelled frame is its class's one-hot row."""
    m = frames[0].manifest
    shape = m.devices[0].output("features").sample_shape
    n, v, c = len(frames), m.views, m.num_classes
    features = np.zeros((n, v, *shape), np.float16)
    present = np.zeros((n, v), bool)
    scores = np.zeros((n, v, c), np.float16)
    soft = np.zeros((n, c), np.float32)
    label = np.full(n, experience.NO_LABEL, np.int16)
    with_scores = True
    for i, t in enumerate(frames):
        for view, f in t.features.items():
            features[i, view] = np.reshape(f, shape)
            present[i, view] = True
            s = t.scores.get(view)
            if s is None or np.size(s) != c:  # (a one-view device sends its scores with them)
                with_scores = False
            else:
                scores[i, view] = np.ravel(s)
        if t.cloud is None:
            label[i], soft[i, t.label] = t.label, 1.0
        else:
            soft[i] = softmax(np.ravel(t.cloud)[None])[0]
    chance = np.array([t.chance for t in frames], np.float32)
    return ChunkArrays(features, present, soft, scores if with_scores else None, label, chance)
