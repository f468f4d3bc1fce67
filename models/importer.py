"""``ddnn data import``: a folder of images → a dataset directory (uint8, read memory-mapped).

Two layouts, one folder per sample holding one image per view, named by the view
(``cam0.png``, ``cam1.jpg``, …); a missing view file is an absent view:

* class folders: ``ROOT/<class>/<sample>/<view>.<ext>``;
* a label table: ``ROOT/<sample>/<view>.<ext>`` and a CSV with a header ``sample,label``.

Everything is checked before anything is written, and the directory is written beside the
target and renamed into place: a bad folder gives one error naming the file, never half a set.
"""

from __future__ import annotations

import csv
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ddnn.dataset import MIN_SIZE, load_dataset, write_directory_meta
from ddnn.errors import DatasetError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".ppm", ".pgm", ".gif", ".tif", ".tiff", ".webp")


@dataclass(frozen=True)
class Sample:
    """One sample folder: its class name and the image file of each view it has."""

    folder: Path
    label: str
    files: dict[str, Path]  # view name → image file


def _view_files(folder: Path) -> dict[str, Path]:
    files: dict[str, Path] = {}
    for f in sorted(folder.iterdir()):
        if not f.is_file() or f.suffix.lower() not in IMAGE_SUFFIXES:
            continue
        if f.stem in files:
            raise DatasetError(f"{f}: a second image for view {f.stem!r} (also {files[f.stem]})")
        files[f.stem] = f
    if not files:
        kinds = ", ".join(IMAGE_SUFFIXES)
        raise DatasetError(f"{folder}: sample folder holds no view image ({kinds})")
    return files


def _read_labels(path: Path) -> dict[str, str]:
    try:
        with path.open(newline="") as f:
            rows = list(csv.reader(f))
    except (OSError, UnicodeDecodeError) as e:
        raise DatasetError(f"{path}: cannot read the label table ({e})") from None
    if not rows or [c.strip().lower() for c in rows[0][:2]] != ["sample", "label"]:
        raise DatasetError(f"{path}: the first line must be the header 'sample,label'")
    labels: dict[str, str] = {}
    for line, row in enumerate(rows[1:], start=2):
        if not row or not "".join(row).strip():
            continue
        if len(row) < 2 or not row[0].strip() or not row[1].strip():
            raise DatasetError(f"{path}:{line}: expected 'sample,label', got {row!r}")
        name = row[0].strip()
        if name in labels:
            raise DatasetError(f"{path}:{line}: sample {name!r} is labelled twice")
        labels[name] = row[1].strip()
    return labels


def scan(root: Path, labels_csv: Path | None = None) -> list[Sample]:
    """Every sample folder under ``root`` with its label and view files (reads no image)."""
    if not root.is_dir():
        raise DatasetError(f"{root}: no such folder")
    if labels_csv is not None:
        labels = _read_labels(labels_csv)
        samples = []
        for folder in sorted(p for p in root.iterdir() if p.is_dir()):
            if folder.name not in labels:
                raise DatasetError(f"{folder}: sample has no label in {labels_csv}")
            samples.append(Sample(folder, labels[folder.name], _view_files(folder)))
    else:
        samples = [
            Sample(folder, cls.name, _view_files(folder))
            for cls in sorted(p for p in root.iterdir() if p.is_dir())
            for folder in sorted(p for p in cls.iterdir() if p.is_dir())
        ]
    if not samples:
        raise DatasetError(f"{root}: no sample folders found")
    if len({s.label for s in samples}) < 2:
        raise DatasetError(f"{root}: every sample is of class {samples[0].label!r}; "
                           "a classifier needs at least two classes")
    return samples


def _class_order(names: set[str]) -> list[str]:
    if all(n.lstrip("-").isdigit() for n in names):
        return sorted(names, key=int)
    return sorted(names)


def _check_views(samples: list[Sample], views: list[str] | None) -> list[str]:
    seen = sorted({v for s in samples for v in s.files})
    if views is None:
        return seen
    for s in samples:
        extra = sorted(set(s.files) - set(views))
        if extra:
            raise DatasetError(
                f"{s.files[extra[0]]}: view {extra[0]!r} is not one of the {len(views)} views "
                f"{views} (inconsistent view count)"
            )
    return list(views)


def _read_image(path: Path, size: int | None, expected: tuple[int, int] | None) -> np.ndarray:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as img:
            img = img.convert("RGB")
            if size is not None:
                img = img.resize((size, size), Image.Resampling.BILINEAR)
            arr = np.asarray(img, dtype=np.uint8)
    except (OSError, UnidentifiedImageError, ValueError) as e:
        raise DatasetError(f"{path}: unreadable image ({e})") from None
    h, w = arr.shape[:2]
    if expected is not None and (h, w) != expected:
        raise DatasetError(
            f"{path}: image is {w}x{h}, expected {expected[1]}x{expected[0]} like the first "
            "image (pass --size N to resize every image)"
        )
    if h < MIN_SIZE or w < MIN_SIZE:
        raise DatasetError(f"{path}: image is {w}x{h}, at least {MIN_SIZE}x{MIN_SIZE} needed")
    return arr.transpose(2, 0, 1)  # (3, H, W)


def _write(staging: Path, samples, views, classes, size, progress) -> None:
    first = samples[0].files[next(iter(samples[0].files))]
    shape = _read_image(first, size, None).shape
    n, v = len(samples), len(views)
    X = np.lib.format.open_memmap(staging / "X.npy", mode="w+", dtype=np.uint8,
                                  shape=(n, v, *shape))
    y = np.full((n, v), -1, dtype=np.int64)
    index = {c: i for i, c in enumerate(classes)}
    label = np.array([index[s.label] for s in samples], dtype=np.int64)
    for i, s in enumerate(samples):
        for j, view in enumerate(views):
            if view in s.files:
                X[i, j] = _read_image(s.files[view], size, shape[1:])
                y[i, j] = label[i]  # an all-black image still reads as absent (the contract)
        progress(i + 1, n)
    X.flush()
    del X
    np.save(staging / "y.npy", y)
    np.save(staging / "label.npy", label)


def import_folder(
    root: str | Path,
    out: str | Path,
    labels_csv: str | Path | None = None,
    views: list[str] | None = None,
    size: int | None = None,
    progress: Callable[[int, int], None] = lambda done, total: None,
) -> Path:
    """Import ``root`` into the dataset directory ``out``; raises :class:`DatasetError`."""
    root, out = Path(root), Path(out)
    if out.exists():
        raise DatasetError(f"{out}: already exists; remove it or choose another --out")
    if size is not None and size < MIN_SIZE:
        raise DatasetError(f"--size must be at least {MIN_SIZE}, got {size}")
    samples = scan(root, Path(labels_csv) if labels_csv else None)
    views = _check_views(samples, views)
    classes = _class_order({s.label for s in samples})
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        _write(staging, samples, views, classes, size, progress)
        write_directory_meta(staging, classes, views, {"source": str(root)})
        load_dataset(staging, mmap=True)  # what we wrote must load and validate
        staging.chmod(0o755)
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out
