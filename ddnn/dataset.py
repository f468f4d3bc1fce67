"""The multi-view dataset of the contract, loaded with numpy alone, in one of two layouts.

A file (``.npz``): ``X`` float32 ``(N, V, 3, H, W)`` in [0, 1]; ``y`` int ``(N, V)``, ``-1`` where a
view is absent; optional ``label`` int ``(N,)`` (default: the largest label among the present
views, the MVMC convention); optional ``classes``, the class names. The original MVMC file marks
an absent view with label 3: an all-zero image is taken as absent whatever its label says.

A directory (what ``ddnn data import`` writes, for sets larger than memory): ``dataset.json``
(format, classes, view names), ``X.npy`` uint8 ``(N, V, 3, H, W)`` (pixel / 255), ``y.npy`` and
``label.npy`` int64. ``load_dataset(..., mmap=True)`` keeps ``X`` memory-mapped as uint8; read
batches with :meth:`MultiViewDataset.images`, which converts only the rows asked for.
"""

from __future__ import annotations

import json
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ddnn.errors import DatasetError

MIN_SIZE = 16
DIR_FORMAT = "ddnn-dataset"  # dataset.json "format" of the directory layout
DIR_VERSION = 1
_CHUNK = 256  # samples read at a time when scanning a memory-mapped X
_CHUNK_BYTES = 4 << 20  # bytes of a .npz file's X read at a time


class RowSelection:
    """Some rows of a memory-mapped array, read from disk only when indexed (a lazy subset)."""

    def __init__(self, base: np.ndarray, rows: np.ndarray):
        self.base, self.rows = base, np.asarray(rows, dtype=np.int64)

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.rows), *self.base.shape[1:])

    @property
    def dtype(self) -> np.dtype:
        return self.base.dtype

    @property
    def ndim(self) -> int:
        return self.base.ndim

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index) -> np.ndarray:
        return np.asarray(self.base[self.rows[index]])

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        return np.asarray(self.base[self.rows], dtype=dtype)


@dataclass(frozen=True)
class MultiViewDataset:
    """Images of V views per sample, with each view's label and the sample's label."""

    X: np.ndarray  # float32 (N, V, 3, H, W) in [0, 1]; uint8 (pixel * 255) when memory-mapped
    y: np.ndarray  # int64 (N, V), -1 for an absent view
    label: np.ndarray  # int64 (N,)
    classes: tuple[str, ...]

    @property
    def present(self) -> np.ndarray:
        """Boolean (N, V): which views see the object."""
        return self.y >= 0

    @property
    def num_samples(self) -> int:
        return int(self.X.shape[0])

    @property
    def num_views(self) -> int:
        return int(self.X.shape[1])

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return tuple(int(d) for d in self.X.shape[2:])  # type: ignore[return-value]

    @property
    def lazy(self) -> bool:
        """Whether ``X`` stays on disk (uint8, memory-mapped) until batches are read."""
        return isinstance(self.X, (np.memmap, RowSelection))

    def images(self, index) -> np.ndarray:
        """Float32 images in [0, 1] of the samples at ``index``; reads only those rows."""
        x = np.asarray(self.X[index])
        return x.astype(np.float32) * np.float32(1 / 255) if x.dtype == np.uint8 else x

    def in_memory(self) -> MultiViewDataset:
        """The same samples with ``X`` as float32 in memory (the ``.npz`` layout)."""
        if not self.lazy and self.X.dtype == np.float32:
            return self
        return MultiViewDataset(self.images(slice(None)), self.y, self.label, self.classes)

    def subset(self, index: np.ndarray) -> MultiViewDataset:
        """The samples at ``index`` (an integer array or boolean mask); lazy stays lazy."""
        if self.lazy:
            rows = np.arange(self.num_samples)[index]
            base = self.X.base if isinstance(self.X, RowSelection) else self.X
            if isinstance(self.X, RowSelection):
                rows = self.X.rows[rows]
            X = RowSelection(base, rows)
            return MultiViewDataset(X, self.y[index], self.label[index], self.classes)
        return MultiViewDataset(self.X[index], self.y[index], self.label[index], self.classes)


def _fail(path: Path, problem: str) -> DatasetError:
    return DatasetError(f"{path}: {problem}")


def load_dataset(
    path: str | Path, num_classes: int | None = None, mmap: bool = False
) -> MultiViewDataset:
    """Load and validate a dataset file or directory; a :class:`DatasetError` names the problem.

    ``num_classes`` (from a bundle) bounds the labels; otherwise the class count is taken from
    the file's ``classes`` or from its largest label. ``mmap`` keeps a directory's uint8 images
    on disk (see the module docstring); a ``.npz`` file is always read into memory.
    """
    path = Path(path)
    if path.is_dir():
        ds = _load_directory(path, num_classes)
        return ds if mmap else ds.in_memory()
    arrays, X, blank = _read_npz(path)
    y, label, classes = _npz_labels(path, arrays, blank, num_classes)
    return MultiViewDataset(X, y, label, classes)


def load_view(
    path: str | Path, view: int, num_classes: int | None = None, start: int = 0,
    limit: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """One view of a dataset: its images float32 ``(N, 3, H, W)``, all zero where the view is
    absent, and a boolean ``(N,)`` of where it is present; of the samples from ``start`` on
    (``limit`` of them at most) when given.

    The file is validated as :func:`load_dataset` validates it, but only these images are kept
    (a ``.npz`` file's ``X`` is read a few samples at a time, a directory's stays mapped): a
    device replaying one camera of V holds 1/V of the images at most, never the whole array.
    """
    path = Path(path)
    if path.is_dir():
        ds = _load_directory(path, num_classes)
        _check_view(path, view, ds.num_views)
        rows = range(ds.num_samples)[start : None if limit is None else start + limit]
        images = np.empty((len(rows), *ds.image_shape), np.float32)
        for i in range(rows.start, rows.stop, _CHUNK):
            j = min(i + _CHUNK, rows.stop)
            images[i - rows.start : j - rows.start] = ds.images((slice(i, j), view))
        present = ds.present[rows.start : rows.stop, view]
    else:
        arrays, images, blank = _read_npz(path, view, start, limit)
        y, _, _ = _npz_labels(path, arrays, blank, num_classes)
        present = y[start:, view][: len(images)] >= 0
    images[~present] = 0.0  # absent by label: exactly zero, as the device's absence test wants
    return images, present


def _check_view(path: Path, view: int, views: int) -> None:
    if not 0 <= view < views:
        raise _fail(path, f"has views 0..{views - 1}, not {view}")


def _read_npz(path: Path, view: int | None = None, start: int = 0, limit: int | None = None
              ) -> tuple[dict, np.ndarray, np.ndarray]:
    """A ``.npz`` file's arrays but X; X checked and kept whole, or only ``view`` of it (of the
    samples from ``start``, ``limit`` at most); and the (N, V) mask of all-zero images."""
    if not path.is_file():
        raise DatasetError(f"{path}: no such dataset file")
    try:
        f = np.load(path, allow_pickle=False)
        if not isinstance(f, np.lib.npyio.NpzFile):
            raise _fail(path, "not a .npz file (one array alone?)")
        with f:
            for key in ("X", "y"):
                if key not in f.files:
                    raise _fail(path, f"missing array {key!r} (has {sorted(f.files)})")
            arrays = {k: f[k] for k in f.files if k != "X"}
            with f.zip.open("X.npy") as fp:
                X, blank = _read_images(path, fp, view, start, limit)
    except DatasetError:
        raise
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
        raise _fail(path, f"not a readable .npz file ({e})") from None
    return arrays, X, blank


def _read_images(path: Path, fp, view: int | None, start: int = 0, limit: int | None = None
                 ) -> tuple[np.ndarray, np.ndarray]:
    """X from its ``.npy`` stream, a chunk of samples at a time: checked, converted to float32,
    every view or one kept (of the samples ``start`` to ``start + limit``); with the (N, V)
    mask of all-zero images."""
    version = np.lib.format.read_magic(fp)
    if version not in ((1, 0), (2, 0)):
        raise _fail(path, f"X.npy has an unsupported .npy format version {version}")
    read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                   else np.lib.format.read_array_header_2_0)
    shape, fortran, dtype = read_header(fp)
    if len(shape) != 5 or shape[2] != 3:
        raise _fail(path, f"X must have shape (N, V, 3, H, W), got {shape}")
    n, v, _, h, w = shape
    if n == 0 or v == 0:
        raise _fail(path, f"X holds no samples or no views: shape {shape}")
    if h < MIN_SIZE or w < MIN_SIZE:
        raise _fail(path, f"images must be at least {MIN_SIZE}x{MIN_SIZE}, got {h}x{w}")
    if not np.issubdtype(dtype, np.floating):
        raise _fail(path, f"X must be floating point in [0, 1], got dtype {dtype}")
    if view is not None:
        _check_view(path, view, v)
    keep = range(n)[start : None if limit is None else start + limit]
    kept = np.empty((len(keep), v, 3, h, w) if view is None else (len(keep), 3, h, w),
                    np.float32)
    blank = np.empty((n, v), dtype=bool)
    sample = v * 3 * h * w * dtype.itemsize
    # A Fortran-ordered X (a transposed array saved as it was) cannot be cut by samples.
    rows = n if fortran else max(1, _CHUNK_BYTES // sample)
    for i in range(0, n, rows):
        k = min(rows, n - i)
        data = fp.read(k * sample)
        if len(data) != k * sample:
            raise _fail(path, f"X.npy is truncated: {shape} needs {n * sample} bytes")
        chunk = np.frombuffer(data, dtype).reshape((k, v, 3, h, w), order="F" if fortran else "C")
        chunk = chunk.astype(np.float32, copy=False)
        if not np.isfinite(chunk).all() or chunk.min() < 0.0 or chunk.max() > 1.0:
            raise _fail(path, "X values must be finite and lie in [0, 1]")
        # An all-zero image is an absent view, whatever its label says (MVMC uses 3 there).
        blank[i : i + k] = ~chunk.reshape(k, v, -1).any(axis=2)
        lo, hi = max(i, keep.start), min(i + k, keep.stop)
        if lo < hi:
            part = chunk[lo - i : hi - i]
            kept[lo - keep.start : hi - keep.start] = part if view is None else part[:, view]
    return kept, blank


def _npz_labels(path: Path, arrays: dict, blank: np.ndarray, num_classes: int | None):
    """Validated (y, label, classes) of a ``.npz`` file."""
    y = arrays["y"]
    n, v = blank.shape
    if y.shape != (n, v) or not np.issubdtype(y.dtype, np.integer):
        raise _fail(path, f"y must be integer with shape {(n, v)}, got {y.dtype} {y.shape}")
    names = arrays.get("classes")
    if names is not None and (names.ndim != 1 or names.dtype.kind != "U"):
        raise _fail(path, "classes must be a 1-D array of strings")
    classes = tuple(str(c) for c in names) if names is not None else ()
    return _labels(path, y, blank, arrays.get("label"), classes, num_classes)


def _labels(path, y, blank, label, classes, num_classes):
    """Validated (y, label, classes), shared by both layouts."""
    n = y.shape[0]
    y = np.where(blank, -1, y).astype(np.int64)
    if (y < -1).any():
        raise _fail(path, f"y holds a negative label other than -1: {int(y.min())}")
    if not (y >= 0).any(axis=1).all():
        bad = int(np.flatnonzero(~(y >= 0).any(axis=1))[0])
        raise _fail(path, f"sample {bad} has no present view")
    if label is not None:
        if label.shape != (n,) or not np.issubdtype(label.dtype, np.integer):
            raise _fail(path, f"label must be integer with shape ({n},), got {label.shape}")
        label = label.astype(np.int64)
    else:
        label = y.max(axis=1)
    if num_classes is None:
        num_classes = len(classes) or int(max(label.max(), y.max())) + 1
    if not classes:
        classes = tuple(f"class{i}" for i in range(num_classes))
    if len(classes) != num_classes:
        raise _fail(path, f"file names {len(classes)} classes, the model has {num_classes}")
    if num_classes < 2:
        raise _fail(path, "a classifier needs at least two classes")
    top = int(max(label.max(), y.max()))
    if label.min() < 0 or top >= num_classes:
        raise _fail(path, f"label out of range: classes are 0..{num_classes - 1}, found {top}")
    return y, label, tuple(classes)


def _load_directory(path: Path, num_classes: int | None) -> MultiViewDataset:
    """The directory layout, with ``X`` memory-mapped read-only."""
    meta_path = path / "dataset.json"
    try:
        meta = json.loads(meta_path.read_text())
    except FileNotFoundError:
        raise _fail(path, "not a dataset directory (no dataset.json)") from None
    except (OSError, ValueError) as e:
        raise _fail(meta_path, f"not readable JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != DIR_FORMAT:
        raise _fail(meta_path, f"format is not {DIR_FORMAT!r}")
    if meta.get("version") != DIR_VERSION:
        raise _fail(meta_path, f"unsupported version {meta.get('version')!r} (read {DIR_VERSION})")
    arrays = {}
    for key in ("X", "y", "label"):
        try:
            arrays[key] = np.load(path / f"{key}.npy", mmap_mode="r" if key == "X" else None,
                                  allow_pickle=False)
        except (OSError, ValueError) as e:
            raise _fail(path / f"{key}.npy", f"not a readable .npy file ({e})") from None
    X, y = arrays["X"], arrays["y"]
    if X.dtype != np.uint8 or X.ndim != 5 or X.shape[2] != 3:
        raise _fail(path, f"X.npy must be uint8 (N, V, 3, H, W), got {X.dtype} {X.shape}")
    n, v, _, h, w = X.shape
    if n == 0 or v == 0 or h < MIN_SIZE or w < MIN_SIZE:
        raise _fail(path, f"X.npy: no samples, no views or images under {MIN_SIZE}x{MIN_SIZE}")
    if y.shape != (n, v) or not np.issubdtype(y.dtype, np.integer):
        raise _fail(path, f"y must be integer with shape {(n, v)}, got {y.dtype} {y.shape}")
    blank = np.empty((n, v), dtype=bool)
    for i in range(0, n, _CHUNK):  # chunked: the whole X need not fit in memory
        blank[i : i + _CHUNK] = ~X[i : i + _CHUNK].reshape(-1, v, 3 * h * w).any(axis=2)
    classes = tuple(str(c) for c in meta.get("classes", ()))
    y, label, classes = _labels(path, y, blank, arrays["label"], classes, num_classes)
    return MultiViewDataset(X, y, label, classes)


def write_directory_meta(path: Path, classes, view_names, extra: dict | None = None) -> None:
    """``dataset.json`` of the directory layout (the arrays are written by the caller)."""
    meta = {"format": DIR_FORMAT, "version": DIR_VERSION, "classes": list(classes),
            "views": list(view_names), **(extra or {})}
    (path / "dataset.json").write_text(json.dumps(meta, indent=2) + "\n")
