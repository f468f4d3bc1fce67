"""Data and bundles made by the project itself (no downloads), sized for a 2-core machine: 3
views, 3 classes, 16×16 images, a few epochs."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

STREAM = 300  # frames of the stream_data fixture: long enough to restart a tier in the middle


@dataclass(frozen=True)
class TinyData:
    train: Path
    test: Path
    views: int = 3
    classes: int = 3
    size: int = 16


def make_tiny_data(root: Path) -> TinyData:
    """Generate ``tiny_data``'s files under ``root`` (numpy only)."""
    from ddnn.models.synth import SceneConfig, save_dataset, synthesize

    cfg = SceneConfig(views=3, classes=3, size=16)
    data = TinyData(root / "train.npz", root / "test.npz")
    save_dataset(data.train, synthesize(360, cfg, seed=1))
    save_dataset(data.test, synthesize(120, cfg, seed=2))
    return data


def train_tiny_bundle(data: TinyData, out: Path) -> Path:
    """Train ``tiny_bundle`` on ``data`` into ``out`` (torch)."""
    from ddnn.models.build import build_bundle
    from ddnn.models.config import DDNNConfig

    # The paper's network, pinned: the tier tests know its tensor shapes and codecs (device
    # features (4, 8, 8) binary, edge features (16, 4, 4) binary) whatever the model defaults;
    # tests/integration/test_export_parity.py and tests/unit/test_models_network.py cover those.
    cfg = DDNNConfig.paper(epochs=4, batch_size=32, seed=0)
    build_bundle(data.train, out, cfg, name="tiny", version="1", progress=False,
                 log=lambda *_: None)
    return out


def one_epoch_bundle(root: Path, views: int) -> Path:
    """A ``tiny`` bundle of ``views`` views, trained one short epoch (for tests of the tiers,
    not of accuracy)."""
    from ddnn.models.build import build_bundle
    from ddnn.models.config import DDNNConfig
    from ddnn.models.synth import SceneConfig, save_dataset, synthesize

    save_dataset(root / "train.npz", synthesize(60, SceneConfig(views=views, classes=3, size=16),
                                                seed=1))
    build_bundle(root / "train.npz", root / "tiny",
                 DDNNConfig.paper(epochs=1, batch_size=32, seed=0),  # pinned, as tiny_bundle
                 name="tiny", version="1", progress=False, log=lambda *_: None)
    return root / "tiny"


def version_copy(src: Path, dst: Path, version: str, key: Path | None = None) -> Path:
    """A copy of ``src`` at another version, signed with ``key`` (last: signing seals it)."""
    from ddnn.signing import sign_bundle

    shutil.copytree(src, dst)
    mf = dst / "manifest.json"
    d = json.loads(mf.read_text())
    d["model"]["version"] = version
    mf.write_text(json.dumps(d, indent=2))
    if key is not None:
        sign_bundle(dst, key)
    return dst


# --- exit thresholds that send a test set's frames through every tier -----------------------
# A bundle trained for a few epochs may calibrate thresholds that let nearly every frame exit
# locally; the hierarchy tests need frames at all three exits, so they override the thresholds
# (as an operator can) with values placed in wide gaps between the frames' entropies, where
# float rounding cannot move a frame across.

def _threshold_in_gap(values: np.ndarray, low: float, high: float) -> float:
    """A threshold between two sorted values, in the widest gap between quantiles low..high."""
    v = np.sort(values)
    lo, hi = max(int(len(v) * low), 1), max(int(len(v) * high), 2)
    gaps = v[lo:hi] - v[lo - 1 : hi - 1]
    k = lo + int(np.argmax(gaps))
    return float((v[k - 1] + v[k]) / 2)


def mixed_thresholds(bundle: Path, data: Path) -> dict[str, float]:
    """``{"local": T, "edge": T}`` giving roughly 40 % local, 30 % edge, 30 % cloud exits."""
    from ddnn.bundle import load_bundle
    from ddnn.dataset import load_dataset
    from ddnn.exits import entropy_of_logits
    from ddnn.runtime import BundleRuntime

    b = load_bundle(bundle)
    ds = load_dataset(data, num_classes=b.manifest.num_classes)
    exits = BundleRuntime(b, threads=1).run_dataset(ds.X, ds.present)
    local = entropy_of_logits(exits["local"])
    t_local = _threshold_in_gap(local, 0.3, 0.5)
    edge = entropy_of_logits(exits["edge"])[local >= t_local]
    t_edge = _threshold_in_gap(edge, 0.35, 0.65)
    return {"local": t_local, "edge": t_edge}


def mixed(thresholds: dict[str, float]) -> dict[str, float]:
    """``thresholds`` as the edge's settings take them."""
    return {"local_threshold": thresholds["local"], "edge_threshold": thresholds["edge"]}
