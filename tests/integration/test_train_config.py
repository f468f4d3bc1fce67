"""A bundle's report holds the configuration it was trained with, and ``ddnn train --config``
on that file asks for the same configuration again."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from ddnn.bundle import load_bundle
from ddnn.cli import build_parser, main
from ddnn.models.cli import _config
from ddnn.models.config import DDNNConfig
from ddnn.models.presets import preset
from ddnn.models.synth import SceneConfig, save_dataset, synthesize


def test_config_from_a_bundles_report_reproduces_its_training_configuration(tmp_path, capsys):
    data, bundle, path = tmp_path / "d.npz", tmp_path / "b", tmp_path / "b" / "report"
    save_dataset(data, synthesize(60, SceneConfig(views=2, classes=3, size=16), seed=1))
    given = ["--preset", "paper", "--epochs", "1", "--batch-size", "32", "--lr", "0.003",
             "--tolerance", "0.01", "--device", "cpu", "--threads", "1"]
    assert main(["train", "--data", str(data), "--out", str(bundle), *given, "--json",
                 "--no-progress"]) == 0
    trained = DDNNConfig.from_saved(load_bundle(bundle).manifest.training["config"])
    assert trained == preset("paper").replace(epochs=1, batch_size=32, lr=0.003,
                                              tolerance=0.01, device="cpu", threads=1)
    metrics = json.loads((path / "metrics.json").read_text())
    assert DDNNConfig.from_saved(metrics["training"]["config"]) == trained

    again = build_parser().parse_args(["train", "--data", str(data), "--out", "b2",
                                       "--config", str(path / "config.toml")])
    assert _config(again) == trained  # no preset or flag needed: the file says it all
    capsys.readouterr()
    assert main(["train", "--config", str(path / "config.toml"), "--print-config"]) == 0
    assert capsys.readouterr().out.split("\n", 1)[1] == (
        (path / "config.toml").read_text().split("\n", 1)[1])  # the same file, but the comment


def test_train_with_a_byte_budget_calibrates_within_it(tmp_path):
    # `ddnn train --max-bytes B`: the thresholds are the most accurate point that puts at most
    # B payload bytes a frame on the uplink, on held-out data; the manifest records the budget
    # (which `ddnn federate` keeps), and `ddnn evaluate` reports the bundle within it.
    from ddnn.tools.evaluate import evaluate

    data, test, bundle = tmp_path / "d.npz", tmp_path / "t.npz", tmp_path / "b"
    scene = SceneConfig(views=3, classes=3, size=16)
    save_dataset(data, synthesize(150, scene, seed=1))
    save_dataset(test, synthesize(60, scene, seed=2))
    budget = 20.0  # every view's scores (6 B each, float16) and a share of frames' features
    assert main(["train", "--data", str(data), "--out", str(bundle), "--preset", "paper",
                 "--epochs", "3", "--batch-size", "32", "--max-bytes", str(budget),
                 "--device", "cpu", "--threads", "1", "--no-progress"]) == 0
    cal = load_bundle(bundle).manifest.calibration
    assert cal["max_bytes"] == budget and "tolerance" not in cal
    assert cal["objective"].startswith("highest accuracy within max_bytes")
    assert cal["bytes_per_frame"] <= budget
    curve = cal["curve"]
    cheaper = [a for a, b in zip(curve["accuracy"], curve["bytes_per_frame"], strict=True)
               if b <= budget]
    # The most accurate point within the budget (the curve is rounded to 5 places).
    assert cal["accuracy"] == pytest.approx(max(cheaper), abs=1e-5)
    assert evaluate(bundle, test)["thresholds"] == cal["thresholds"]
