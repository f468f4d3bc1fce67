"""Exit thresholds that send a test set's frames through every tier.

A bundle trained for a few epochs may calibrate thresholds that let nearly every frame exit
locally; the hierarchy tests need frames at all three exits, so they override the thresholds
(as an operator can) with values placed in wide gaps between the frames' entropies, where
float rounding cannot move a frame across.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ddnn.bundle import load_bundle
from ddnn.dataset import load_dataset
from ddnn.exits import entropy_of_logits
from ddnn.runtime import BundleRuntime


def _threshold_in_gap(values: np.ndarray, low: float, high: float) -> float:
    """A threshold between two sorted values, in the widest gap between quantiles low..high."""
    v = np.sort(values)
    lo, hi = max(int(len(v) * low), 1), max(int(len(v) * high), 2)
    gaps = v[lo:hi] - v[lo - 1 : hi - 1]
    k = lo + int(np.argmax(gaps))
    return float((v[k - 1] + v[k]) / 2)


def mixed_thresholds(bundle: Path, data: Path) -> dict[str, float]:
    """``{"local": T, "edge": T}`` giving roughly 40 % local, 30 % edge, 30 % cloud exits."""
    b = load_bundle(bundle)
    ds = load_dataset(data, num_classes=b.manifest.num_classes)
    exits = BundleRuntime(b, threads=1).run_dataset(ds.X, ds.present)
    local = entropy_of_logits(exits["local"])
    t_local = _threshold_in_gap(local, 0.3, 0.5)
    edge = entropy_of_logits(exits["edge"])[local >= t_local]
    t_edge = _threshold_in_gap(edge, 0.35, 0.65)
    return {"local": t_local, "edge": t_edge}
