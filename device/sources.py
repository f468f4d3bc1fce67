"""Frame sources of a device agent: a replay of one view of a dataset file, a folder of images,
or a camera (OpenCV, optional).

A source yields ``(frame id, image)`` with the image float32 ``(3, H, W)`` in [0, 1]. An
all-zero image means "this view sees nothing" (the dataset contract's absent view).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from ddnn.errors import ConfigError, DdnnError
from ddnn.plumbing.retry import RetryPolicy

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = (".png", ".ppm", ".pgm", ".jpg", ".jpeg")


def is_absent(image: np.ndarray) -> bool:
    """True for an all-zero image: the view does not see the object."""
    return not image.any()  # (the method: np.any's dispatch costs more than the test)


class NpzReplay:
    """One view of a dataset ``.npz``, frames numbered by their index in the file."""

    def __init__(self, path: str | Path, view: int, num_classes: int | None = None,
                 limit: int | None = None, start: int = 0):
        from ddnn.dataset import load_view

        self.path = Path(path)
        # The frames to replay of this view alone, read a few samples at a time: never the
        # whole file in memory. Views absent by label are exactly zero, so the device's absence
        # test agrees with the file.
        self._images, _ = load_view(path, view, num_classes, start, limit)
        self._range = range(start, start + len(self._images))

    def __len__(self) -> int:
        return len(self._range)

    @property
    def replayed(self) -> range:
        """The frame ids this replay produces (a restart produces them again)."""
        return self._range

    def __iter__(self) -> Iterator[tuple[int, np.ndarray]]:
        yield from zip(self._range, self._images, strict=True)


class SourceError(DdnnError):
    """A frame source failed for good (a camera that cannot be reopened): the agent exits
    non-zero, so a supervisor (systemd's ``Restart=on-failure``) starts it again."""


POLL = 0.25  # seconds between two listings of a followed folder


class ImageFolder:
    """Images of a folder in name order, decoded by Pillow.

    Numbered from 0 in name order; with ``follow`` the folder is watched (polled every
    :data:`POLL` seconds) for new images, which a capture tool writes there, and each is
    numbered like a camera frame, by its modification time's slot at ``fps``
    (:func:`frame_slot`; always increasing), so a restarted device never reuses a frame id.
    Followed images are taken in name order, once settled (not modified for a poll), and only
    names after the last one taken. ``after_send`` disposes of an image once its frame was
    processed (its messages queued): ``keep``, ``delete`` or ``archive`` into ``archive``.
    """

    def __init__(self, path: str | Path, image_shape: tuple[int, int, int],
                 limit: int | None = None, *, follow: bool = False, after_send: str = "keep",
                 archive: Path | None = None, fps: float = 10.0,
                 stop: threading.Event | None = None):
        if importlib.util.find_spec("PIL") is None:  # fail at start, not at the first frame
            raise ConfigError("reading images needs Pillow: pip install 'ddnn[device]'")
        self.path = Path(path)
        if not self.path.is_dir():
            raise ConfigError(f"{path}: not a folder of images")
        if after_send not in ("keep", "delete", "archive") or (after_send == "archive") != (
                archive is not None):
            raise ConfigError(f"after_send must be keep, delete or archive (with a folder), "
                              f"got {after_send!r}")
        self.follow, self.after_send, self.archive, self.fps = follow, after_send, archive, fps
        self.limit, self.image_shape = limit, image_shape
        self.stop_event = stop or threading.Event()  # set: a followed folder stops
        self.skipped = 0  # unreadable images, or followed ones named before the last taken
        if archive is not None:
            archive.mkdir(parents=True, exist_ok=True)
        files = self._listing()
        if not files and not follow:
            raise ConfigError(f"{path}: no {'/'.join(IMAGE_SUFFIXES)} images")
        self.files = files[:limit] if limit is not None else files

    def _listing(self) -> list[Path]:
        return sorted(p for p in self.path.iterdir()
                      if p.suffix.lower() in IMAGE_SUFFIXES and not p.name.startswith("."))

    def __len__(self) -> int:
        return len(self.files)

    @property
    def replayed(self) -> range | None:
        """The frame ids of a folder read once (by position: a restart produces them again);
        None when followed (ids from modification times, never repeated)."""
        return None if self.follow else range(len(self.files))

    def __iter__(self) -> Iterator[tuple[int, np.ndarray]]:
        if self.follow:
            yield from self._followed()
            return
        for i, f in enumerate(self.files):
            yield i, to_chw(read_image(f), self.image_shape)
            self._dispose(f)

    def _followed(self) -> Iterator[tuple[int, np.ndarray]]:
        last_name, last_id, taken = "", -1, 0
        while not self.stop_event.is_set() and (self.limit is None or taken < self.limit):
            now = time.time()
            new = []
            for f in self._listing():
                if f.name <= last_name:
                    continue
                try:
                    mtime = f.stat().st_mtime
                except FileNotFoundError:  # taken away meanwhile
                    continue
                if now - mtime < POLL:
                    break  # still being written: it and every later name wait a poll
                new.append((f, mtime))
            for f, mtime in new:
                last_name = f.name
                image = self._read(f)
                if image is None:
                    continue
                slot = frame_slot(mtime, self.fps) if self.fps > 0 else int(mtime * 1000)
                last_id = max(slot, last_id + 1)
                yield last_id, image
                self._dispose(f)
                taken += 1
                if self.stop_event.is_set() or (self.limit is not None and taken >= self.limit):
                    return
            if not new:
                self.stop_event.wait(POLL)

    def _read(self, f: Path) -> np.ndarray | None:
        try:
            return to_chw(read_image(f), self.image_shape)
        except ConfigError as e:
            self.skipped += 1
            log.warning("skipping an image: %s", e)
            return None

    def _dispose(self, f: Path) -> None:
        try:
            if self.after_send == "delete":
                f.unlink(missing_ok=True)
            elif self.after_send == "archive":
                shutil.move(f, self.archive / f.name)  # type: ignore[operator]
        except OSError as e:  # a read-only folder must not stop the frames
            log.warning("could not %s %s: %s", self.after_send, f, e)


def frame_slot(t: float, fps: float) -> int:
    """The frame id of wall-clock time ``t`` at ``fps``: the same on every camera of a deployment
    whose clocks agree (NTP), and never reused when a device restarts."""
    return int(t * fps)


# Reopening an unreadable camera: 0.5 s doubling to --camera-retry-max.
CAMERA_RETRY = RetryPolicy(initial=0.5, maximum=30.0)


class Camera:
    """Frames of a camera through OpenCV (``pip install opencv-python-headless``).

    Live views are matched across devices by time: a frame's id is its capture time's slot at
    ``fps`` (:func:`frame_slot`), so cameras started at different moments, or restarted, agree
    on which frame is which. A second capture in the same slot is skipped.

    A camera that cannot be opened, or whose read fails (unplugged, a network camera's stream
    cut), is released and reopened with exponential backoff (``retry``); after ``retries``
    failed reopenings in a row (0: never) the iteration raises :class:`SourceError`.
    """

    def __init__(self, index: int, image_shape: tuple[int, int, int], limit: int | None = None,
                 fps: float = 10.0, *, retries: int = 10, retry: RetryPolicy = CAMERA_RETRY,
                 stop: threading.Event | None = None):
        try:
            import cv2
        except ImportError:
            raise ConfigError(
                "a camera source needs OpenCV: pip install opencv-python-headless"
            ) from None
        if fps <= 0:
            raise ConfigError(f"a camera needs a frame rate above 0, got {fps}")
        self._cv2, self.index = cv2, index
        self.image_shape, self.limit, self.fps = image_shape, limit, fps
        self.retries, self.retry = retries, retry
        self.stop_event = stop or threading.Event()  # set: stop waiting to reopen
        self.failures = 0  # failed reopenings in a row
        self.reopened = 0  # successful reopenings after a failure
        self._cap = self._open()
        if self._cap is None:
            log.warning("camera %d cannot be opened; retrying with backoff", index)

    @property
    def problem(self) -> str | None:
        """Why no frames come, for the health check; None while the camera reads."""
        if self._cap is None:
            return f"camera {self.index} unreadable: reopening ({self.failures} failed tries)"
        return None

    def _open(self):
        try:
            cap = self._cv2.VideoCapture(self.index)
            if not cap.isOpened():
                cap.release()
                return None
            # Keep no backlog: a frame read late must be a fresh one, or its time slot would
            # name an older instant than the other cameras' frames of that slot.
            cap.set(self._cv2.CAP_PROP_BUFFERSIZE, 1)
        except Exception as e:  # cv2.error and whatever a capture backend raises
            log.warning("camera %d: %s", self.index, e)
            return None
        return cap

    def _read(self) -> np.ndarray | None:
        if self._cap is None:
            return None
        try:
            ok, bgr = self._cap.read()
        except Exception as e:
            log.warning("camera %d: read failed: %s", self.index, e)
            ok, bgr = False, None
        if ok and bgr is not None:
            return bgr
        log.warning("camera %d: read failed; releasing it to reopen", self.index)
        with contextlib.suppress(Exception):
            self._cap.release()
        self._cap = None
        return None

    def _reopen(self, backoff) -> None:
        """Wait and reopen once; raises :class:`SourceError` when out of tries."""
        if self.retries and backoff.failures >= self.retries:
            raise SourceError(f"camera {self.index} unreadable after {backoff.failures} "
                              "reopenings; giving up")
        delay = backoff.failed()
        self.failures = backoff.failures
        if self.stop_event.wait(delay):
            return
        self._cap = self._open()
        if self._cap is not None:
            log.info("camera %d reopened after %d failed tries", self.index, self.failures)
            self.reopened += 1
        else:
            log.warning("camera %d cannot be opened (try %d%s); next in %.1f s", self.index,
                        backoff.failures, f" of {self.retries}" if self.retries else "",
                        self.retry.delay(backoff.failures + 1))

    def __iter__(self) -> Iterator[tuple[int, np.ndarray]]:
        sent, last = 0, -1
        backoff = self.retry.backoff()
        while (self.limit is None or sent < self.limit) and not self.stop_event.is_set():
            bgr = self._read()
            if bgr is None:
                self._reopen(backoff)
                continue
            backoff.succeeded()
            self.failures = 0
            slot = frame_slot(time.time(), self.fps)
            if slot == last:
                continue
            yield slot, to_chw(bgr[:, :, ::-1], self.image_shape)
            last, sent = slot, sent + 1

    def close(self) -> None:
        if self._cap is not None:
            with contextlib.suppress(Exception):
                self._cap.release()
            self._cap = None


def to_chw(rgb: np.ndarray, image_shape: tuple[int, int, int]) -> np.ndarray:
    """An (H, W, 3) uint8 image as float32 (3, h, w) in [0, 1], nearest-neighbour resized."""
    _, h, w = image_shape
    rows = (np.arange(h) * rgb.shape[0] // h).clip(0, rgb.shape[0] - 1)
    cols = (np.arange(w) * rgb.shape[1] // w).clip(0, rgb.shape[1] - 1)
    small = rgb[rows][:, cols]
    return np.ascontiguousarray(small.transpose(2, 0, 1), dtype=np.float32) / 255.0


def read_image(path: Path) -> np.ndarray:
    """An image file as (H, W, 3) uint8: any format Pillow reads (PNG, JPEG, PPM/PGM, ...)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as im:
            return np.asarray(im.convert("RGB"))
    # A decompression bomb, a truncated or lying file: refused like an unreadable one, so a
    # followed folder skips it instead of ending the replay.
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError, ValueError,
            SyntaxError) as e:
        raise ConfigError(f"{path}: not a readable image ({e})") from None
