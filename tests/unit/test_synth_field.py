"""Field conditions from the generator: a drifted domain and a non-IID split into sites, both
within the dataset contract and reproducible by seed."""

from __future__ import annotations

import numpy as np
import pytest

from ddnn.models.cli import _drifts
from ddnn.models.synth import (
    DRIFTS,
    SENSOR_NOISE,
    SceneConfig,
    apply_drift,
    drifted_config,
    split_sites,
    synthesize,
)

SMALL = SceneConfig(views=3, classes=3, size=16)


def test_drift_keeps_the_contract_and_changes_what_cameras_see():
    plain = synthesize(40, SMALL, seed=3)
    field = apply_drift(synthesize(40, drifted_config(SMALL, DRIFTS), seed=3), DRIFTS)
    present = field["y"] >= 0
    assert field["X"].dtype == np.float32 and field["X"].shape == plain["X"].shape
    assert (field["X"][~present] == 0).all()
    flat = field["X"][present].reshape(present.sum(), -1)
    assert flat.min() >= 1 / 255 - 1e-7 and flat.max() <= 1.0 and (flat > 0).all()
    again = apply_drift(synthesize(40, drifted_config(SMALL, DRIFTS), seed=3), DRIFTS)
    np.testing.assert_array_equal(field["X"], again["X"])


def test_lighting_turns_hues_and_leaves_greys_grey():
    data = synthesize(2, SMALL, seed=1)
    present = data["y"] >= 0
    X = np.zeros_like(data["X"])
    X[present] = np.array([0.8, 0.1, 0.1], np.float32)[:, None, None]  # a red object
    X[present, :, :2] = 0.5  # two grey rows
    lit = apply_drift({**data, "X": X}, ("lighting",))["X"][present]
    red, grey = lit[:, :, 5, 5], lit[:, :, 0, 0]
    assert (red[:, 1] > 0.3).all() and (red[:, 0] < 0.7).all()  # red turned towards yellow
    np.testing.assert_allclose(grey[:, 0], grey[:, 1], atol=1e-5)
    np.testing.assert_allclose(grey[:, 1], grey[:, 2], atol=1e-5)


def test_rotation_turns_every_view_a_quarter():
    data = synthesize(5, SMALL, seed=1)
    turned = apply_drift(data, ("rotation",))
    np.testing.assert_array_equal(turned["X"], np.rot90(data["X"], 1, axes=(-2, -1)))
    with pytest.raises(ValueError, match="unknown drift"):
        apply_drift(data, ("fog",))


def test_sensor_noise_changes_the_pixels_not_the_scene():
    plain = synthesize(20, SMALL, seed=4)
    noisy = apply_drift(synthesize(20, drifted_config(SMALL, ("noise",)), seed=4), ("noise",))
    present = plain["y"] >= 0
    np.testing.assert_array_equal(noisy["label"], plain["label"])
    np.testing.assert_array_equal(noisy["y"], plain["y"])
    assert (noisy["X"][~present] == 0).all() and noisy["X"][present].min() >= 1 / 255 - 1e-7
    # The same draws, only stronger: the difference is noise (clipping at 0 and 1 trims it).
    extra = (noisy["X"] - plain["X"])[present]
    assert abs(float(extra.mean())) < 0.02
    assert 0.5 * SENSOR_NOISE < float(extra.std()) < SENSOR_NOISE
    assert drifted_config(SMALL, ("noise", "remount")).noise > SMALL.noise
    assert "noise" not in _drifts("all") and _drifts("noise,rotation") == ("noise", "rotation")


def test_sites_partition_the_samples_non_iid_and_reproducibly():
    data = synthesize(300, SMALL, seed=2)
    sites = split_sites(data, 3, alpha=0.1, seed=7)
    assert sum(len(s["label"]) for s in sites) == 300
    assert sorted(np.concatenate([s["label"] for s in sites]).tolist()) == sorted(
        data["label"].tolist())
    # Small alpha: each class lives mostly on one site.
    counts = np.array([np.bincount(s["label"], minlength=3) for s in sites])
    assert (counts.max(0) / counts.sum(0)).mean() > 0.7
    again = split_sites(data, 3, alpha=0.1, seed=7)
    assert all(np.array_equal(a["X"], b["X"]) for a, b in zip(sites, again, strict=True))
    even = np.array([np.bincount(s["label"], minlength=3)
                     for s in split_sites(data, 3, alpha=100.0, seed=7)])
    assert (even.max(0) / even.sum(0)).mean() < 0.5
