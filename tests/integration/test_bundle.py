"""Bundles: what training writes loads, verifies and refuses tampering."""

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

from ddnn.bundle import FORMAT_VERSION, load_bundle, read_manifest
from ddnn.errors import BundleError


@pytest.fixture
def bundle_copy(tiny_bundle, tmp_path):
    return shutil.copytree(tiny_bundle, tmp_path / "b")


def _edit_manifest(path, change):
    mf = path / "manifest.json"
    data = json.loads(mf.read_text())
    change(data)
    mf.write_text(json.dumps(data))


def test_manifest_describes_the_model(tiny_bundle):
    m = load_bundle(tiny_bundle).manifest
    assert (m.name, m.version, m.views, m.input_shape) == ("tiny", "1", 3, (3, 16, 16))
    assert m.classes == ("car", "bus", "person")
    assert m.aggregation == {"local": "max", "edge": "avg"} and m.scheme == "MP-AP"
    assert set(m.thresholds) == {"local", "edge"}
    assert m.codec == {"scores": "float16", "device_features": "binary", "edge_features": "binary"}
    assert m.devices[0].output("features").shape == ("batch", 4, 8, 8)
    assert m.training["epochs"] == 4 and "val_accuracy" in m.training
    assert m.calibration["parity"]["disagreement"]["cloud"] <= 0.01
    assert m.format_version == 2 and m.stacking is not None  # fitted at training
    assert (tiny_bundle / "report" / "metrics.json").is_file()
    assert (tiny_bundle / "report" / "accuracy_vs_threshold.png").stat().st_size > 1000


def test_changed_segment_file_is_refused(bundle_copy):
    f = bundle_copy / "edge.onnx"
    data = bytearray(f.read_bytes())
    data[-10] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(BundleError, match="checksum mismatch for edge.onnx"):
        load_bundle(bundle_copy)


def test_missing_segment_file_is_refused(bundle_copy):
    (bundle_copy / "cloud.onnx").unlink()
    with pytest.raises(BundleError, match="cloud file cloud.onnx is missing"):
        load_bundle(bundle_copy)


def test_a_bundle_of_format_1_loads_and_answers_unstacked(bundle_copy):
    """Bundles written before stacked exits: format 1, no ``stacking``; each tier answers on
    its own."""
    _edit_manifest(bundle_copy, lambda d: (d.update(format_version=1), d.pop("stacking", None)))
    m = load_bundle(bundle_copy).manifest
    assert m.format_version == 1 and m.stacking is None
    assert "stacking" not in m.to_dict() and m.to_dict()["format_version"] == 1


def test_newer_format_version_is_refused(bundle_copy):
    _edit_manifest(bundle_copy, lambda d: d.update(format_version=FORMAT_VERSION + 1))
    with pytest.raises(BundleError, match="newer than this ddnn supports"):
        load_bundle(bundle_copy)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.pop("segments"), "malformed manifest"),
        (lambda d: d.update(format="other"), "not a ddnn bundle"),
        (lambda d: d["model"].update(name="Bad Name!"), "invalid model name"),
        (lambda d: d["segments"]["cloud"].update(file="../etc/passwd"), "unsafe file"),
        (lambda d: d["exits"]["local"].update(threshold=3), "invalid exit thresholds"),
        (lambda d: d["codec"].update(scores="gzip"), "codec for scores"),
        (lambda d: d.update(views=5), "device segments for 5 views"),
        (lambda d: d.update(classes="car"), "classes must be a list"),
        (lambda d: d.update(classes=["car", "car", "bus"]), "classes must be distinct"),
        (lambda d: d["segments"]["edge"]["inputs"][0].update(shape=[4, 8, 8]),
         "expected \\[\"batch\""),
        (lambda d: d["segments"]["edge"]["inputs"][0].update(shape=["batch", 4, 0, 8]),
         "positive sizes"),
        (lambda d: d["segments"]["cloud"]["outputs"][0].update(dtype="complex64"), "dtype"),
        (lambda d: d["segments"]["cloud"]["inputs"][0].update(shape=["batch", 3, 8, 8]),
         "cloud edge_features has per-sample shape"),
        (lambda d: d["segments"]["device"][1]["outputs"][1].update(shape=["batch", 2, 8, 8]),
         "device-1 features"),
        (lambda d: d["input"].update(shape=[3, 32, 32]), "device-0 image"),
        (lambda d: d["aggregation"].update(edge="concat"), "edge device_features"),
        (lambda d: [s["outputs"][1].update(shape=["batch"]) for s in d["segments"]["device"]],
         "device-0 features need a shape"),
        (lambda d: d.update(stacking={"edge": 1.5}), "stacking weight 'edge'"),
        (lambda d: d.update(stacking={"fog": 0.5}), "stacking names unknown tiers"),
        (lambda d: d.update(stacking=0.5), "stacking must be an object"),
        (lambda d: d.update(stacking=[]), "stacking must be an object"),
        (lambda d: d.update(format_version=1), "stacking needs format_version 2"),
        (lambda d: d.update(views=1, stacking={"edge": 0.5},
                            segments={**d["segments"], "device": d["segments"]["device"][:1]}),
         "one-view bundle cannot stack"),
    ],
)
def test_inconsistent_manifest_is_refused(bundle_copy, change, message):
    _edit_manifest(bundle_copy, change)
    with pytest.raises(BundleError, match=message):
        load_bundle(bundle_copy)


def test_not_a_bundle(tmp_path):
    with pytest.raises(BundleError, match="no such bundle directory"):
        load_bundle(tmp_path / "absent")
    with pytest.raises(BundleError, match="no manifest.json"):
        load_bundle(tmp_path)
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(BundleError, match="unreadable manifest"):
        read_manifest(tmp_path)


def test_cli_reports_a_tampered_bundle_in_one_line(bundle_copy, tiny_data):
    (bundle_copy / "device-0.onnx").write_bytes(b"garbage")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ddnn",
            "evaluate",
            "--bundle",
            str(bundle_copy),
            "--data",
            str(tiny_data.test),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert proc.stderr.startswith("ddnn: error:") and "checksum mismatch" in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_bundle_holds_no_pickle(tiny_bundle):
    for f in tiny_bundle.rglob("*"):
        if f.is_file():
            head = f.read_bytes()[:2]
            assert head != b"\x80\x04" and head != b"\x80\x05", f"{f} looks like a pickle"
    assert np.load  # the dataset loader uses allow_pickle=False (see test_dataset)
