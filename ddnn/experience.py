"""Experience: what an edge records of the frames it forwarded, for the cloud to teach from.

For each frame the edge sent up, the device features it fused and the cloud's answer as a soft
label (class probabilities). Federated fine-tuning (``ddnn federate client --experience DIR``)
trains the layers above the device stem on it by distillation: no human labels, and no image
ever leaves a device through this path (features only). The format (docs/federated.md):

A directory of chunks ``experience-<unix ms>-<seq>.npz`` (written to a temporary name and
renamed, so a reader never sees half a chunk), each an ``.npz`` without pickles holding

- ``features`` float16 ``(N, V, F, h, w)``: each view's device features as the edge decoded
  them (the codec's levels), zeros for a view that was not fused;
- ``present`` bool ``(N, V)``: the views whose features were fused;
- ``soft_label`` float32 ``(N, C)``: the cloud's class probabilities (softmax of its scores);
- optional ``device_scores`` float16 ``(N, V, C)``: the devices' scores as sent (for the
  local exit, when it has weights);
- ``label`` int16 ``(N,)`` (format version 2): an operator's hard label (``POST /v1/feedback``,
  :mod:`ddnn.edge.feedback`), the class index, or -1 where the frame has none; a labelled
  frame's ``soft_label`` is that class's one-hot row, so a reader that knows only soft labels
  learns the operator's answer too;
- optional ``chance`` float32 ``(N,)``: the chance the frame had of being recorded, of all the
  frames the edge saw: 1 for a frame its exits sent up, the audit rate for an early exit the
  cloud checked anyway; 0 where no random draw stands behind it (an operator's choice, a
  latency probe, any frame while the edge audits nothing). Frames drawn with known chances
  are a sample of the whole stream (:func:`stream_sample`), which ``ddnn federate``
  calibrates the exits on; a reader without it learns from the frames alone;
- ``meta``: a 0-d string, JSON: ``{"format": "ddnn-experience", "format_version": 2,
  "model": {"name", "version"}, "classes": [...], "feature_shape": [F, h, w],
  "device_codec": ..., "created": ISO 8601}``.

Version 1 chunks (no ``label``) still load, as frames without a hard label. The oldest chunks
are deleted first when the directory grows past its budget
(:func:`prune`). Numpy only: the edge writes it without torch.
"""

from __future__ import annotations

import datetime as dt
import itertools
import json
import logging
import os
import time
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ddnn.errors import DatasetError

FORMAT = "ddnn-experience"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)  # version 1: no hard labels
NO_LABEL = -1  # ``label`` of a frame without a hard label
PREFIX = "experience-"
log = logging.getLogger("ddnn.experience")
_seq = itertools.count()


@dataclass(frozen=True)
class Experience:
    """Recorded frames: features (float32), which views were fused, the cloud's soft labels,
    and the operators' hard labels (:data:`NO_LABEL` where none was given)."""

    features: np.ndarray  # float32 (N, V, F, h, w)
    present: np.ndarray  # bool (N, V)
    soft_label: np.ndarray  # float32 (N, C)
    device_scores: np.ndarray | None  # float32 (N, V, C), NaN rows where a frame has none
    # (an operator's label); None when no frame has them
    classes: tuple[str, ...]
    label: np.ndarray | None = None  # int64 (N,), NO_LABEL where none; None: all NO_LABEL
    chance: np.ndarray | None = None  # float32 (N,): each frame's chance of being recorded;
    # None: not recorded (chunks of an older edge), 0 where no random draw chose the frame
    draw: np.ndarray | None = None  # float64 (N, 2): each frame's own uniform numbers, fixed by
    # its chunk's name and row, so a held-out frame stays held out however the directory grows

    def __post_init__(self) -> None:
        if self.label is None:
            object.__setattr__(self, "label", np.full(self.num_samples, NO_LABEL, np.int64))

    @property
    def labelled(self) -> np.ndarray:
        """bool (N,): the frames an operator labelled."""
        return np.asarray(self.label) != NO_LABEL

    @property
    def scored(self) -> np.ndarray:
        """bool (N,): the frames recorded with their devices' scores (the local exit's input)."""
        if self.device_scores is None:
            return np.zeros(self.num_samples, bool)
        return ~np.isnan(self.device_scores).any(axis=(1, 2))

    @property
    def num_samples(self) -> int:
        return int(self.features.shape[0])

    def subset(self, index: np.ndarray) -> Experience:
        scores = None if self.device_scores is None else self.device_scores[index]
        chance = None if self.chance is None else self.chance[index]
        draw = None if self.draw is None else self.draw[index]
        return Experience(self.features[index], self.present[index], self.soft_label[index],
                          scores, self.classes, np.asarray(self.label)[index], chance, draw)

    @property
    def teacher_label(self) -> np.ndarray:
        """int64 (N,): each frame's best known class: the operator's where given, else the
        cloud's answer (the argmax of its soft label)."""
        return np.where(self.labelled, np.asarray(self.label), self.soft_label.argmax(1))


def stream_sample(chance: np.ndarray, draw: np.ndarray) -> np.ndarray:
    """The indices of a uniform sample of the stream the frames were drawn from, at the rate
    of the least likely draw: frame i, recorded with chance ``p_i`` > 0, stays with chance
    ``min(p) / p_i`` (so every frame of the stream had the same chance ``min(p)`` to be here),
    where its own uniform number ``draw[i]`` (in [0, 1)) falls under that. A frame the edge
    sent up is recorded whatever its exits said, an audited one only when drawn: the recorded
    frames over-represent the hard ones, the sample does not. Frames of chance 0 (no random
    draw chose them) are left out."""
    chance = np.asarray(chance, dtype=np.float64)
    drawn = np.flatnonzero(chance > 0)
    if drawn.size == 0:
        return drawn
    keep = np.asarray(draw, np.float64)[drawn] < chance[drawn].min() / chance[drawn]
    return drawn[keep]


def frame_draws(name: str, frames: int) -> np.ndarray:
    """float64 (frames, 2): uniform numbers of a chunk's frames, fixed by the chunk's name."""
    return np.random.default_rng(zlib.crc32(name.encode())).random((frames, 2))


def write_chunk(directory: str | Path, features: np.ndarray, present: np.ndarray,
                soft_label: np.ndarray, *, model: tuple[str, str], classes: list[str],
                device_codec: str, device_scores: np.ndarray | None = None,
                label: np.ndarray | None = None, chance: np.ndarray | None = None) -> Path:
    """Write one chunk of experience into ``directory`` (atomically); returns its path.

    ``label``: the hard labels (class index, :data:`NO_LABEL` for none; None: no frame has one);
    ``chance``: each frame's chance of being recorded (None: not known).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    meta = {
        "format": FORMAT, "format_version": FORMAT_VERSION,
        "model": {"name": model[0], "version": model[1]}, "classes": list(classes),
        "feature_shape": list(features.shape[2:]), "device_codec": device_codec,
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }
    arrays = {
        "features": np.asarray(features, dtype=np.float16),
        "present": np.asarray(present, dtype=bool),
        "soft_label": np.asarray(soft_label, dtype=np.float32),
        "label": (np.full(len(features), NO_LABEL, np.int16) if label is None
                  else np.asarray(label, dtype=np.int16)),
        "meta": np.array(json.dumps(meta)),
    }
    if device_scores is not None:
        arrays["device_scores"] = np.asarray(device_scores, dtype=np.float16)
    if chance is not None:
        arrays["chance"] = np.asarray(chance, dtype=np.float32)
    name = f"{PREFIX}{int(time.time() * 1000)}-{os.getpid()}-{next(_seq)}.npz"
    tmp = directory / f".{name}.tmp"
    with open(tmp, "wb") as f:
        np.savez_compressed(f, **arrays)  # binarized features shrink several times
    os.replace(tmp, directory / name)
    return directory / name


def chunks(directory: str | Path) -> list[Path]:
    """The directory's finished chunks, oldest first."""
    return sorted(Path(directory).glob(f"{PREFIX}*.npz"), key=lambda p: (p.stat().st_mtime, p.name))


def prune(directory: str | Path, max_bytes: int) -> int:
    """Delete the oldest chunks until the rest fit in ``max_bytes``; returns how many went."""
    files = chunks(directory)
    sizes = [p.stat().st_size for p in files]
    total, removed = sum(sizes), 0
    for path, size in zip(files, sizes, strict=True):
        if total <= max_bytes:
            break
        path.unlink(missing_ok=True)
        total, removed = total - size, removed + 1
    return removed


def _read_chunk(path: Path) -> tuple[dict, dict[str, np.ndarray]]:
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
        meta = json.loads(str(arrays.pop("meta")))
    except (OSError, ValueError, KeyError, zipfile.BadZipFile, json.JSONDecodeError) as e:
        raise DatasetError(f"{path.name}: not an experience chunk ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise DatasetError(f"{path.name}: meta does not name the {FORMAT} format")
    version = meta.get("format_version")
    if version not in READABLE_VERSIONS or isinstance(version, bool):
        raise DatasetError(f"{path.name}: format version {version!r} is not one of "
                           f"{READABLE_VERSIONS}")
    if version == 1 and "label" in arrays:
        raise DatasetError(f"{path.name}: a format version 1 chunk holds no label")
    return meta, arrays


def _check_chunk(path: Path, meta: dict, a: dict[str, np.ndarray]) -> None:
    f, p, s = a.get("features"), a.get("present"), a.get("soft_label")
    if f is None or p is None or s is None:
        raise DatasetError(f"{path.name}: needs features, present and soft_label")
    n = f.shape[0]
    if f.ndim != 5 or p.shape != f.shape[:2] or p.dtype != bool or s.ndim != 2 or len(s) != n:
        raise DatasetError(f"{path.name}: shapes disagree: features {f.shape}, present "
                           f"{p.shape} {p.dtype}, soft_label {s.shape}")
    if s.shape[1] != len(meta.get("classes", ())):
        raise DatasetError(f"{path.name}: soft_label has {s.shape[1]} classes, meta names "
                           f"{len(meta.get('classes', ()))}")
    if not (np.isfinite(f).all() and np.isfinite(s).all()) or (s < 0).any():
        raise DatasetError(f"{path.name}: holds NaN, infinite or negative probabilities")
    if n and np.abs(s.sum(1) - 1).max() > 1e-3:
        raise DatasetError(f"{path.name}: soft_label rows must sum to 1")
    d = a.get("device_scores")
    if d is not None and d.shape != (*p.shape, s.shape[1]):
        raise DatasetError(f"{path.name}: device_scores {d.shape} should be "
                           f"{(*p.shape, s.shape[1])}")
    y = a.get("label")
    if y is not None:
        if y.shape != (n,) or y.dtype.kind not in "iu":
            raise DatasetError(f"{path.name}: label {y.shape} {y.dtype} should be integers ({n},)")
        if ((y != NO_LABEL) & ((y < 0) | (y >= s.shape[1]))).any():
            raise DatasetError(f"{path.name}: a label is not a class index (0..{s.shape[1] - 1}) "
                               f"nor {NO_LABEL}")
    c = a.get("chance")
    if c is not None and (c.shape != (n,) or c.dtype.kind != "f" or not np.isfinite(c).all()
                          or (c < 0).any() or (c > 1).any()):
        raise DatasetError(f"{path.name}: chance {c.shape} {c.dtype} should be ({n},) "
                           "probabilities")


def read_experience(directory: str | Path, classes: tuple[str, ...] | None = None,
                    feature_shape: tuple[int, ...] | None = None,
                    views: int | None = None) -> Experience:
    """Every valid chunk of ``directory`` that fits the model, concatenated.

    A chunk that is unreadable or recorded for other classes, views or features is skipped
    with a warning naming it (one bad file must not stop a site from learning); no usable
    chunk at all is a :class:`DatasetError`.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise DatasetError(f"{directory}: no such experience directory")
    parts: list[dict[str, np.ndarray]] = []
    draws: list[np.ndarray] = []
    names: tuple[str, ...] | None = classes
    for path in chunks(directory):
        try:
            meta, a = _read_chunk(path)
            _check_chunk(path, meta, a)
            got = tuple(meta["classes"])
            if names is not None and got != names:
                raise DatasetError(f"{path.name}: classes {got} differ from {names}")
            if feature_shape is not None and a["features"].shape[2:] != tuple(feature_shape):
                raise DatasetError(f"{path.name}: features {a['features'].shape[2:]} differ "
                                   f"from the model's {tuple(feature_shape)}")
            if views is not None and a["features"].shape[1] != views:
                raise DatasetError(f"{path.name}: {a['features'].shape[1]} views, the model "
                                   f"has {views}")
        except DatasetError as e:
            log.warning("skipping experience chunk: %s", e)
            continue
        names = got
        parts.append(a)
        draws.append(frame_draws(path.name, len(a["features"])))
    if not parts or names is None:
        raise DatasetError(f"{directory}: no usable experience chunk")
    with_scores = any("device_scores" in a for a in parts)
    with_chance = all("chance" in a for a in parts)  # else no frame's chance is known

    def scores(a: dict[str, np.ndarray]) -> np.ndarray:
        """A chunk's device scores; NaN where it has none (an operator's labels)."""
        if "device_scores" in a:
            return a["device_scores"].astype(np.float32)
        return np.full((*a["present"].shape, len(names)), np.nan, np.float32)

    return Experience(
        features=np.concatenate([a["features"] for a in parts]).astype(np.float32),
        present=np.concatenate([a["present"] for a in parts]),
        soft_label=np.concatenate([a["soft_label"] for a in parts]).astype(np.float32),
        device_scores=(np.concatenate([scores(a) for a in parts]) if with_scores else None),
        classes=names,
        label=np.concatenate([a["label"].astype(np.int64) if "label" in a
                              else np.full(len(a["features"]), NO_LABEL, np.int64)
                              for a in parts]),
        chance=(np.concatenate([a["chance"] for a in parts]).astype(np.float32)
                if with_chance else None),
        draw=np.concatenate(draws),
    )
