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
    from ddnn.models.presets import preset

    # The paper's network, pinned: the tier tests know its tensor shapes and codecs (device
    # features (4, 8, 8) binary, edge features (16, 4, 4) binary) whatever the model defaults;
    # tests/integration/test_export_parity.py and tests/unit/test_models_network.py cover those.
    cfg = preset("paper").replace(epochs=4, batch_size=32, seed=0)
    build_bundle(data.train, out, cfg, name="tiny", version="1", progress=False,
                 log=lambda *_: None)
    return out


def kinds_repository(data: TinyData, tiny: Path, root: Path) -> Path:
    """A model repository with a bundle of every kind the cloud serves (torch): ``tiny`` (a
    copy of ``tiny_bundle``, the paper's network), ``esc`` (the defaults' network trained to
    escalate, ``--escalate view``) and ``tiny-raw`` (a raw-offload reference of the name
    ``tiny``), each trained one short epoch (for tests of serving, not of accuracy)."""
    import shutil

    from ddnn.models.baseline import build_baseline
    from ddnn.models.build import build_bundle
    from ddnn.models.config import DDNNConfig

    shutil.copytree(tiny, root / "tiny")
    cfg = DDNNConfig.from_flat(epochs=1, batch_size=32, seed=0, escalate="view")
    build_bundle(data.train, root / "esc", cfg, name="esc", version="1", progress=False,
                 log=lambda *_: None)
    build_baseline(data.train, root / "tiny-raw", cfg, progress=False, name="tiny", version="1")
    return root


def one_epoch_bundle(root: Path, views: int) -> Path:
    """A ``tiny`` bundle of ``views`` views, trained one short epoch (for tests of the tiers,
    not of accuracy)."""
    from ddnn.models.build import build_bundle
    from ddnn.models.presets import preset
    from ddnn.models.synth import SceneConfig, save_dataset, synthesize

    save_dataset(root / "train.npz", synthesize(60, SceneConfig(views=views, classes=3, size=16),
                                                seed=1))
    build_bundle(root / "train.npz", root / "tiny",
                 preset("paper").replace(epochs=1, batch_size=32, seed=0),  # as tiny_bundle
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


@dataclass(frozen=True)
class SixViews:
    """A six-view bundle (the paper's MVMC layout), its test replay and a replay of other
    scenes (the "wrong images" a hostile device sends)."""

    bundle: Path
    test: Path
    wrong: Path
    frames: int


def six_view_bundle(root: Path, frames: int = 200) -> SixViews:
    """Six views, 3 classes, 16×16, the default network trained 3 short epochs: about 0.94
    accurate at the local exit (its answers mean something), in about 15 s on one core."""
    from ddnn.models.build import build_bundle
    from ddnn.models.config import DDNNConfig
    from ddnn.models.synth import SceneConfig, save_dataset, synthesize

    # Easy scenes (little noise, no occlusion): few epochs give a model whose fused answer
    # is right, so a device that changes answers is seen in the accuracy.
    cfg = SceneConfig(views=6, classes=3, size=16, noise=0.02, occlusion_prob=0.0,
                      camera_jitter=0.1, colour_jitter=0.05, background=0.05, body_blobs=2)
    save_dataset(root / "train.npz", synthesize(240, cfg, seed=1))
    save_dataset(root / "test.npz", synthesize(frames, cfg, seed=2))
    save_dataset(root / "wrong.npz", synthesize(frames, cfg, seed=7))
    build_bundle(root / "train.npz", root / "six",
                 DDNNConfig.from_flat(epochs=3, batch_size=32, seed=0),
                 name="six", version="1", progress=False, log=lambda *_: None)
    return SixViews(root / "six", root / "test.npz", root / "wrong.npz", frames)


# --- a domain change: a bundle whose exits are confident on its own domain -------------------
# tiny_bundle is barely better than chance, so its early exits disagree with the cloud
# everywhere; drift needs a bundle that fits its domain (about 0.99 on it, 0.5 on the drifted
# one, where its local exit still answers most frames but disagrees with the cloud on some
# 12 %): an easier scene, more samples, the default network (about a minute on 2 cores).
DRIFT_SCENE = {"views": 3, "classes": 3, "size": 16, "body_blobs": 3, "parts": 3,
               "absent_prob": 0.05, "occlusion_prob": 0.1, "noise": 0.03}


def drift_bundle(root: Path) -> Path:
    """A bundle trained on :data:`DRIFT_SCENE` (torch)."""
    from ddnn.models.build import build_bundle
    from ddnn.models.config import DDNNConfig
    from ddnn.models.synth import SceneConfig, save_dataset, synthesize

    save_dataset(root / "train.npz", synthesize(800, SceneConfig(**DRIFT_SCENE), seed=1))
    build_bundle(root / "train.npz", root / "bundle",
                 DDNNConfig.from_flat(epochs=8, batch_size=32, seed=0),
                 name="field", version="1", progress=False, log=lambda *_: None)
    return root / "bundle"


def domain_change(path: Path, before: int, after: int, drifts=("lighting", "rotation",
                                                                "remount")) -> Path:
    """A replay of ``before`` frames of :data:`DRIFT_SCENE`'s domain, then ``after`` frames of
    its drifted domain (``ddnn data synth --drift``), in one file."""
    from ddnn.models.synth import (
        SceneConfig,
        apply_drift,
        drifted_config,
        save_dataset,
        synthesize,
    )

    cfg = SceneConfig(**DRIFT_SCENE)
    parts = [synthesize(before, cfg, seed=2),
             apply_drift(synthesize(after, drifted_config(cfg, drifts), seed=3), drifts)]
    save_dataset(path, {k: (np.concatenate([p[k] for p in parts]) if k != "classes"
                            else parts[0][k]) for k in parts[0]})
    return path


def at_level(src: Path, dst: Path, level: int, views: int = 0,
             stacking: dict | None = None) -> Path:
    """A copy of an escalating bundle whose calibration chose ``level`` (and ``views``, and
    ``stacking``: these weights instead of the fitted ones)."""
    shutil.copytree(src, dst)
    mf = dst / "manifest.json"
    d = json.loads(mf.read_text())
    d["escalation"] = {"level": level, "views": views}
    if stacking is not None:
        d["stacking"] = stacking
    mf.write_text(json.dumps(d, indent=2))
    return dst
