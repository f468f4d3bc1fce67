"""Frame sources of a device agent: a replay of one view of a dataset file, a folder of images,
or a camera (OpenCV, optional).

A source yields ``(frame id, image)`` with the image float32 ``(3, H, W)`` in [0, 1]. An
all-zero image means "this view sees nothing" (the dataset contract's absent view).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from ddnn.errors import ConfigError, DatasetError

IMAGE_SUFFIXES = (".png", ".ppm", ".pgm", ".jpg", ".jpeg")


def is_absent(image: np.ndarray) -> bool:
    """True for an all-zero image: the view does not see the object."""
    return not np.any(image)


class NpzReplay:
    """One view of a dataset ``.npz``, frames numbered by their index in the file."""

    def __init__(self, path: str | Path, view: int, num_classes: int | None = None,
                 limit: int | None = None, start: int = 0):
        from ddnn.dataset import load_dataset

        ds = load_dataset(path, num_classes=num_classes)
        if not 0 <= view < ds.num_views:
            raise DatasetError(f"{path}: has views 0..{ds.num_views - 1}, not {view}")
        self.path = Path(path)
        # The contract marks absent views by label; make their images exactly zero so the
        # device's absence test (all-zero) agrees with the file whatever a writer stored.
        self._images = np.where(ds.present[:, view, None, None, None], ds.X[:, view], 0.0)
        end = len(self._images) if limit is None else min(len(self._images), start + limit)
        self._range = range(start, end)

    def __len__(self) -> int:
        return len(self._range)

    def __iter__(self) -> Iterator[tuple[int, np.ndarray]]:
        for i in self._range:
            yield i, self._images[i].astype(np.float32, copy=False)


class ImageFolder:
    """Images of a folder in name order, decoded by Pillow, numbered from 0."""

    def __init__(self, path: str | Path, image_shape: tuple[int, int, int],
                 limit: int | None = None):
        if importlib.util.find_spec("PIL") is None:  # fail at start, not at the first frame
            raise ConfigError("reading images needs Pillow: pip install 'ddnn[device]'")
        self.path = Path(path)
        if not self.path.is_dir():
            raise ConfigError(f"{path}: not a folder of images")
        files = sorted(p for p in self.path.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
        if not files:
            raise ConfigError(f"{path}: no {'/'.join(IMAGE_SUFFIXES)} images")
        self.files = files[:limit] if limit is not None else files
        self.image_shape = image_shape

    def __len__(self) -> int:
        return len(self.files)

    def __iter__(self) -> Iterator[tuple[int, np.ndarray]]:
        for i, f in enumerate(self.files):
            yield i, to_chw(read_image(f), self.image_shape)


def frame_slot(t: float, fps: float) -> int:
    """The frame id of wall-clock time ``t`` at ``fps``: the same on every camera of a deployment
    whose clocks agree (NTP), and never reused when a device restarts."""
    return int(t * fps)


class Camera:
    """Frames of a camera through OpenCV (``pip install opencv-python-headless``).

    Live views are matched across devices by time: a frame's id is its capture time's slot at
    ``fps`` (:func:`frame_slot`), so cameras started at different moments, or restarted, agree
    on which frame is which. A second capture in the same slot is skipped.
    """

    def __init__(self, index: int, image_shape: tuple[int, int, int], limit: int | None = None,
                 fps: float = 10.0):
        try:
            import cv2
        except ImportError:
            raise ConfigError(
                "a camera source needs OpenCV: pip install opencv-python-headless"
            ) from None
        if fps <= 0:
            raise ConfigError(f"a camera needs a frame rate above 0, got {fps}")
        self._cap = cv2.VideoCapture(index)
        if not self._cap.isOpened():
            raise ConfigError(f"camera {index} cannot be opened")
        # Keep no backlog: a frame read late must be a fresh one, or its time slot would name
        # an older instant than the other cameras' frames of that slot.
        self._cap.set(cv2.CAP_PROP_BUFFERSIZE, 1)
        self.image_shape, self.limit, self.fps = image_shape, limit, fps

    def __iter__(self) -> Iterator[tuple[int, np.ndarray]]:
        import time

        sent, last = 0, -1
        while self.limit is None or sent < self.limit:
            ok, bgr = self._cap.read()
            if not ok:
                return
            slot = frame_slot(time.time(), self.fps)
            if slot == last:
                continue
            yield slot, to_chw(bgr[:, :, ::-1], self.image_shape)
            last, sent = slot, sent + 1


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
    except (UnidentifiedImageError, OSError) as e:
        raise ConfigError(f"{path}: not a readable image ({e})") from None
