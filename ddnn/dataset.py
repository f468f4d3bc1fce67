"""The multi-view dataset file (``.npz``) of the contract, loaded with numpy alone.

``X`` float32 ``(N, V, 3, H, W)`` in [0, 1]; ``y`` int ``(N, V)``, ``-1`` where a view is absent;
optional ``label`` int ``(N,)`` (default: the largest label among the present views, the MVMC
convention); optional ``classes``, the class names. The original MVMC file marks an absent view
with label 3: an all-zero image is taken as absent whatever its label says.
"""

from __future__ import annotations

import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ddnn.errors import DatasetError

MIN_SIZE = 16


@dataclass(frozen=True)
class MultiViewDataset:
    """Images of V views per sample, with each view's label and the sample's label."""

    X: np.ndarray  # float32 (N, V, 3, H, W) in [0, 1]
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

    def subset(self, index: np.ndarray) -> MultiViewDataset:
        """The samples at ``index`` (an integer array or boolean mask)."""
        return MultiViewDataset(self.X[index], self.y[index], self.label[index], self.classes)


def _fail(path: Path, problem: str) -> DatasetError:
    return DatasetError(f"{path}: {problem}")


def load_dataset(path: str | Path, num_classes: int | None = None) -> MultiViewDataset:
    """Load and validate a dataset file; raises :class:`DatasetError` naming the problem.

    ``num_classes`` (from a bundle) bounds the labels; otherwise the class count is taken from
    the file's ``classes`` or from its largest label.
    """
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"{path}: no such dataset file")
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = {k: f[k] for k in f.files}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
        raise _fail(path, f"not a readable .npz file ({e})") from None
    for key in ("X", "y"):
        if key not in arrays:
            raise _fail(path, f"missing array {key!r} (has {sorted(arrays)})")

    X, y = arrays["X"], arrays["y"]
    if X.ndim != 5 or X.shape[2] != 3:
        raise _fail(path, f"X must have shape (N, V, 3, H, W), got {X.shape}")
    n, v, _, h, w = X.shape
    if n == 0 or v == 0:
        raise _fail(path, f"X holds no samples or no views: shape {X.shape}")
    if h < MIN_SIZE or w < MIN_SIZE:
        raise _fail(path, f"images must be at least {MIN_SIZE}x{MIN_SIZE}, got {h}x{w}")
    if not np.issubdtype(X.dtype, np.floating):
        raise _fail(path, f"X must be floating point in [0, 1], got dtype {X.dtype}")
    X = X.astype(np.float32, copy=False)
    if not np.isfinite(X).all() or X.min() < 0.0 or X.max() > 1.0:
        raise _fail(path, "X values must be finite and lie in [0, 1]")
    if y.shape != (n, v) or not np.issubdtype(y.dtype, np.integer):
        raise _fail(path, f"y must be integer with shape {(n, v)}, got {y.dtype} {y.shape}")

    # An all-zero image is an absent view, whatever its label says (MVMC uses 3 there).
    blank = ~X.reshape(n, v, -1).any(axis=2)
    y = np.where(blank, -1, y).astype(np.int64)
    if (y < -1).any():
        raise _fail(path, f"y holds a negative label other than -1: {int(y.min())}")
    if not (y >= 0).any(axis=1).all():
        bad = int(np.flatnonzero(~(y >= 0).any(axis=1))[0])
        raise _fail(path, f"sample {bad} has no present view")

    if "label" in arrays:
        label = arrays["label"]
        if label.shape != (n,) or not np.issubdtype(label.dtype, np.integer):
            raise _fail(path, f"label must be integer with shape ({n},), got {label.shape}")
        label = label.astype(np.int64)
    else:
        label = y.max(axis=1)

    classes: tuple[str, ...] = ()
    if "classes" in arrays:
        names = arrays["classes"]
        if names.ndim != 1 or names.dtype.kind != "U":
            raise _fail(path, "classes must be a 1-D array of strings")
        classes = tuple(str(c) for c in names)
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
    return MultiViewDataset(X, y, label, classes)
