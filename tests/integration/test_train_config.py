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
