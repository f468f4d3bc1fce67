"""A bundle that escalates (its escalated segment, the devices' detail, the level calibration
chose) and a raw-offload reference bundle (kind "raw"): both load, verify and refuse tampering;
the tiers' default load refuses a reference with a clear error."""

import json
import shutil

import pytest

torch = pytest.importorskip("torch")

from ddnn.bundle import load_bundle, read_manifest  # noqa: E402
from ddnn.errors import BundleError, ConfigError  # noqa: E402
from ddnn.models.baseline import build_baseline  # noqa: E402
from ddnn.models.build import build_bundle  # noqa: E402
from ddnn.models.config import DDNNConfig  # noqa: E402
from ddnn.tools.evaluate import evaluate  # noqa: E402


@pytest.fixture(scope="module")
def escalating(tiny_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("escalating") / "b"
    cfg = DDNNConfig.from_flat(epochs=1, batch_size=32, escalate="view")
    build_bundle(tiny_data.train, out, cfg, name="tiny", progress=False, log=lambda *_: None)
    return out


@pytest.fixture(scope="module")
def reference(tiny_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("reference") / "raw"
    build_baseline(tiny_data.train, out, DDNNConfig.from_flat(epochs=1, batch_size=32),
                   progress=False, name="tiny")
    return out


def _edited(src, tmp_path, change):
    path = shutil.copytree(src, tmp_path / "b")
    data = json.loads((path / "manifest.json").read_text())
    change(data)
    (path / "manifest.json").write_text(json.dumps(data))
    return path


def test_an_escalating_bundle_describes_its_detail_and_level(escalating, tiny_data):
    m = load_bundle(escalating).manifest
    assert m.kind == "ddnn" and m.escalated is not None and m.escalation_level in (0, 1)
    assert "escalated" in m.segments() and m.codec["device_detail"] == "bits4"
    detail = m.devices[0].output("detail").sample_shape
    assert m.escalated.input("device_detail").sample_shape == (m.views * detail[0], *detail[1:])
    cal = m.calibration
    assert cal["escalation_level"] == m.escalation_level and cal["tolerance"] == 0.0
    assert set(cal["curve"]) >= {"level", "local_threshold", "accuracy", "bytes_per_frame"}
    assert (escalating / "report" / "operating_curve.png").stat().st_size > 1000
    result = evaluate(escalating, tiny_data.test)
    assert result["escalation"]["level"] == m.escalation_level
    assert len(result["escalation"]["cloud_accuracy"]) == 2
    assert result["curve"]["bytes_per_frame"] == sorted(result["curve"]["bytes_per_frame"])


def test_evaluate_counts_each_detail_deflated_as_its_device_sends_it(escalating, tiny_data):
    """The details' bytes are those of the devices' own DETAIL messages, counted apart."""
    from ddnn import envelope as env
    from ddnn.dataset import load_dataset
    from ddnn.envelope import MessageType
    from ddnn.runtime import BundleRuntime

    bundle = load_bundle(escalating)
    m, runtime = bundle.manifest, BundleRuntime(bundle, threads=1)
    ds = load_dataset(tiny_data.test)
    sent, views = 0, 0
    for frame, (images, present) in enumerate(zip(ds.X, ds.present, strict=True)):
        for view in map(int, present.nonzero()[0]):
            detail = runtime.device_outputs(view, images[view][None])["detail"]
            data = env.encode(env.pack(MessageType.DETAIL, version=m.version, frame=frame,
                                       tensor=detail, codec="bits4", deflate=True))
            sent += len(data) - env.payload_offset(data)
            views += 1
    exits = runtime.run_dataset(ds.X, ds.present)
    assert exits["detail_bytes"].sum() == sent
    escalation = evaluate(escalating, tiny_data.test, level=1)["escalation"]
    assert escalation["detail_bytes_per_view_sent"] == pytest.approx(sent / views)
    assert escalation["detail_bytes_per_view_sent"] < escalation["detail_bytes_per_view"]


def test_evaluate_repicks_the_point_for_a_byte_budget(escalating, tiny_data):
    m = load_bundle(escalating).manifest
    least = min(m.calibration["curve"]["bytes_per_frame"])
    tight = evaluate(escalating, tiny_data.test, max_bytes=least)
    held_out = tight["budget"]["held_out"]
    assert held_out["bytes_per_frame"] <= least
    assert tight["thresholds"] == held_out["thresholds"]  # picked on held-out data, not here
    assert tight.get("escalation", {}).get("level", 0) == held_out["level"]
    everything = evaluate(escalating, tiny_data.test, max_bytes=1e9)
    assert everything["thresholds"] == everything["budget"]["held_out"]["thresholds"]
    with pytest.raises(ConfigError, match="no operating point sends at most 0.5 bytes"):
        evaluate(escalating, tiny_data.test, max_bytes=0.5)
    level0 = evaluate(escalating, tiny_data.test, level=0, local_threshold=0, edge_threshold=0)
    assert level0["accuracy"]["cloud"] == level0["escalation"]["cloud_accuracy"][0]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d["segments"].pop("escalated"), "escalation level 1 needs an escalated"),
        (lambda d: d["escalation"].update(level=2), "escalation level must be 0 or 1"),
        (lambda d: d["codec"].update(device_detail="gzip"), "codec for device_detail"),
        (lambda d: d["segments"]["escalated"]["inputs"][1].update(shape=["batch", 1, 2, 2]),
         "escalated device_detail has per-sample shape"),
        (lambda d: d["segments"]["device"][1]["outputs"][2].update(shape=["batch", 1, 2, 2]),
         "device-1 detail"),
    ],
)
def test_an_inconsistent_escalation_is_refused(escalating, tmp_path, change, message):
    def edit(d):
        d["escalation"]["level"] = 1
        change(d)

    with pytest.raises(BundleError, match=message):
        load_bundle(_edited(escalating, tmp_path, edit))


def test_a_changed_escalated_segment_is_refused(escalating, tmp_path):
    path = shutil.copytree(escalating, tmp_path / "b")
    (path / "escalated.onnx").write_bytes(b"garbage")
    with pytest.raises(BundleError, match="checksum mismatch for escalated.onnx"):
        load_bundle(path)


def test_a_reference_is_a_bundle_of_its_own_kind(reference, escalating, tiny_data):
    m = load_bundle(reference, kind="raw").manifest
    assert (m.kind, m.name, m.views, m.input_shape) == ("raw", "tiny", 3, (3, 16, 16))
    assert set(m.segments()) == {"raw"} and m.raw.input("views").sample_shape == (3, 3, 16, 16)
    assert m.training["parity"]["disagreement"] <= 0.01
    assert "test_accuracy" not in m.training and m.training["epochs"] == 1
    assert load_bundle(reference, kind=None).manifest.kind == "raw"
    assert load_bundle(escalating, kind=None).manifest.kind == "ddnn"
    # What the tiers load by default is a hierarchy: a reference is refused by name.
    with pytest.raises(BundleError, match="raw-offload reference bundle, not a hierarchy"):
        load_bundle(reference)
    with pytest.raises(BundleError, match="raw-offload reference bundle, not a hierarchy"):
        read_manifest(reference)
    with pytest.raises(BundleError, match="hierarchy bundle, not a raw-offload reference"):
        load_bundle(escalating, kind="raw")
    result = evaluate(reference, tiny_data.test)
    assert result["kind"] == "raw" and 0.0 <= result["accuracy"]["overall"] <= 1.0
    assert result["bytes_per_frame"]["raw_offload"] == pytest.approx(  # same data, same bytes
        evaluate(escalating, tiny_data.test)["bytes_per_frame"]["raw_offload"])


def test_a_changed_reference_is_refused(reference, tmp_path):
    path = shutil.copytree(reference, tmp_path / "raw")
    data = bytearray((path / "raw.onnx").read_bytes())
    data[-10] ^= 0xFF
    (path / "raw.onnx").write_bytes(bytes(data))
    with pytest.raises(BundleError, match="checksum mismatch for raw.onnx"):
        load_bundle(path, kind="raw")
    edited = _edited(reference, tmp_path / "e", lambda d: d["segments"]["raw"]["inputs"][0]
                     .update(shape=["batch", 2, 3, 16, 16]))
    with pytest.raises(BundleError, match="raw views has per-sample shape"):
        load_bundle(edited, kind="raw")



def test_a_reference_teaches_a_hierarchy(reference, escalating, tiny_data, tmp_path):
    cfg = DDNNConfig.from_flat(epochs=1, batch_size=32, escalate="view")  # as `escalating`
    out = tmp_path / "taught"
    build_bundle(tiny_data.train, out, cfg, name="tiny", progress=False, log=lambda *_: None,
                 teacher=reference)
    taught, plain = (load_bundle(b).manifest for b in (out, escalating))
    assert taught.training["teacher"] == {"bundle": str(reference), "name": "tiny",
                                          "version": "1"}
    assert plain.training["teacher"] is None
    # The teacher's answers reached training: the same seed learned other weights.
    assert taught.escalated.sha256 != plain.escalated.sha256
    with pytest.raises(BundleError, match="hierarchy bundle, not a raw-offload reference"):
        build_bundle(tiny_data.train, tmp_path / "x", cfg, progress=False, log=lambda *_: None,
                     teacher=escalating)
    other = _edited(reference, tmp_path / "o", lambda d: d.update(classes=["p", "q", "r"]))
    with pytest.raises(ConfigError, match="the teacher was made for"):
        build_bundle(tiny_data.train, tmp_path / "y", cfg, progress=False, log=lambda *_: None,
                     teacher=other)
