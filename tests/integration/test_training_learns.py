"""Training learns: every exit of the default network (escalation on) beats chance by far on
generated data, and the cloud beats the devices' local exit where only fused views can answer.

Small sets and few epochs, so each test takes seconds; accuracy on held-out frames, torch only.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ddnn.dataset import load_dataset  # noqa: E402
from ddnn.models.build import split_data  # noqa: E402
from ddnn.models.config import DDNNConfig  # noqa: E402
from ddnn.models.synth import SceneConfig, save_dataset, synthesize  # noqa: E402
from ddnn.models.train import exit_accuracy, predict, train  # noqa: E402


def _train_and_test(train_path, test_path, **cfg):
    config = DDNNConfig.from_flat(batch_size=32, threads=1, escalate="view", **cfg)
    _, train_ds, stop_ds, _ = split_data(train_path, None, config)
    model = train(train_ds, stop_ds, config, progress=False).model
    test = load_dataset(test_path)
    return exit_accuracy(predict(model, test), test)


def test_every_exit_reaches_twice_chance(tmp_path):
    # Scenes whose class parts show from every side (so one view can tell), 4 classes.
    scene = SceneConfig(views=3, classes=4, size=16, body_blobs=2, parts=4, part_spread=3.0,
                        occlusion_prob=0.0, noise=0.03)
    save_dataset(tmp_path / "train.npz", synthesize(300, scene, seed=1))
    save_dataset(tmp_path / "test.npz", synthesize(200, scene, seed=2))
    acc = _train_and_test(tmp_path / "train.npz", tmp_path / "test.npz", epochs=6)
    assert set(acc) == {"device", "local", "edge", "cloud", "escalated"}
    chance = 1 / scene.classes
    assert min(acc.values()) >= 2 * chance, acc


def _same_or_mixed(path, n, seed, views=3, size=16):
    """Class 0: every camera sees the same colour; class 1: the colours differ. One view alone
    says nothing about the class (each colour is as likely in both), so the devices' product of
    posteriors can at best reject the all-blue frames, while features fused across views can
    tell every frame."""
    rng = np.random.default_rng(seed)
    label = rng.integers(0, 2, n)
    tints = np.where(label[:, None] == 0, rng.integers(0, 2, (n, 1)),
                     rng.integers(0, 2, (n, views)))
    alike = (tints == tints[:, :1]).all(1) & (label == 1)
    tints[alike, -1] = 1 - tints[alike, 0]
    colours = np.array([[0.8, 0.3, 0.2], [0.2, 0.3, 0.8]], np.float32)[tints]
    X = colours[..., None, None] + rng.normal(0, 0.05, (n, views, 3, size, size))
    np.savez(path, X=np.clip(X, 0.01, 1).astype(np.float32),
             y=np.repeat(label[:, None], views, 1), label=label)


def test_the_cloud_beats_the_local_exit_where_views_must_be_fused(tmp_path):
    _same_or_mixed(tmp_path / "train.npz", 300, seed=1)
    _same_or_mixed(tmp_path / "test.npz", 200, seed=2)
    acc = _train_and_test(tmp_path / "train.npz", tmp_path / "test.npz", epochs=6)
    assert acc["device"] <= 0.65, acc  # a single view is near chance (1/2)
    assert acc["local"] <= 0.85, acc  # the product of the views' posteriors: 3/4 at best
    assert acc["cloud"] >= acc["local"] + 0.1, acc
    assert acc["escalated"] >= acc["local"] + 0.1, acc


def test_channels_last_training_is_the_same_arithmetic_and_saves_plain_weights(tmp_path):
    scene = SceneConfig(views=2, classes=3, size=16, occlusion_prob=0.0, noise=0.03)
    save_dataset(tmp_path / "train.npz", synthesize(120, scene, seed=1))
    runs = {}
    for layout in (False, True):
        config = DDNNConfig.from_flat(batch_size=32, threads=1, epochs=2, device_stem=(8,),
                                      device_convs=2, channels_last=layout)
        _, train_ds, stop_ds, _ = split_data(tmp_path / "train.npz", None, config)
        runs[layout] = train(train_ds, stop_ds, config, progress=False)
    plain, cl = runs[False], runs[True]
    assert all(p.is_contiguous() for p in cl.model.parameters())  # exported as before
    for a, b in zip(plain.history, cl.history, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-3)
