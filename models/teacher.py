"""A raw-view teacher: a raw-offload reference bundle (``ddnn train --baseline``) whose answers
the hierarchy's exits learn from beside the labels (knowledge distillation, Hinton et al.
2015; ``TrainingConfig.teacher_weight``).

The teacher runs once, by ONNX Runtime, over the training split before training starts (a
290 k-weight CNN over every view of every batch would cost each epoch as much as training the
hierarchy); each sample keeps its teacher answer whatever augmentation the batch then applies.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ddnn.bundle import load_bundle
from ddnn.dataset import MultiViewDataset
from ddnn.errors import ConfigError
from ddnn.raw_runtime import RawRuntime


@dataclass(frozen=True)
class Teacher:
    """A teacher's answers for a training split, and which bundle gave them."""

    logits: np.ndarray  # (N, C), row i for sample i of the split
    identity: dict  # bundle path, name and version: the manifest and checkpoints record it


def load_teacher(bundle_dir: str | Path, ds: MultiViewDataset, threads: int | None = None,
                 batch: int = 256) -> Teacher:
    """The teacher's logits for every sample of ``ds``. Raises :class:`BundleError` for a
    bundle that is not a reference and :class:`ConfigError` for one made for other data."""
    bundle = load_bundle(bundle_dir, kind="raw")
    m = bundle.manifest
    if (list(m.classes), m.views, tuple(m.input_shape)) != \
            (list(ds.classes), ds.num_views, tuple(ds.image_shape)):
        raise ConfigError(
            f"{bundle_dir}: the teacher was made for {m.views} views of {m.input_shape} and "
            f"classes {list(m.classes)}; the data has {ds.num_views} views of {ds.image_shape} "
            f"and classes {list(ds.classes)}")
    rt = RawRuntime(bundle, threads)
    logits = np.concatenate([rt.scores(ds.images(slice(i, i + batch)))
                             for i in range(0, ds.num_samples, batch)])
    return Teacher(logits, {"bundle": str(bundle_dir), "name": m.name, "version": m.version})
