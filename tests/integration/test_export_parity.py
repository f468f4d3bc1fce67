"""Every exit computed by ONNX Runtime through the bundle equals torch's."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ddnn.bundle import load_bundle  # noqa: E402
from ddnn.dataset import load_dataset  # noqa: E402
from ddnn.models.build import build_bundle  # noqa: E402
from ddnn.models.config import DDNNConfig  # noqa: E402
from ddnn.models.export import (  # noqa: E402
    build_manifest,
    check_parity,
    export_segments,
    onnx_exits,
    write_manifest,
)
from ddnn.models.network import DDNN  # noqa: E402
from ddnn.models.presets import preset  # noqa: E402
from ddnn.models.train import predict  # noqa: E402
from ddnn.runtime import BundleRuntime  # noqa: E402

VARIANTS = [
    {"scheme": "MP-CC"}, {"scheme": "AP"}, {"scheme": "CC"}, {"scheme": "MP"},
    {"device_codec": "bits2"}, {"device_codec": "bits4", "edge_view_pool": "maxmean"},
    {"early": True}, {"paper": True}, {"paper": True, "scheme": "MP-CC"},
]


def _name(variant: dict) -> str:
    return "-".join(f"{k}={v}" for k, v in variant.items())


@pytest.mark.parametrize("variant", VARIANTS, ids=_name)
def test_every_exit_matches_torch(tiny_data, tmp_path, variant):
    ds = load_dataset(tiny_data.test)
    kw = dict(variant)
    if kw.pop("early", False):
        kw["edge_per_view"] = False
    cfg = (preset("paper") if kw.pop("paper", False) else DDNNConfig()).replace(**kw)
    torch.manual_seed(0)
    model = DDNN(cfg, ds.num_views, len(ds.classes), 16, 16).eval()
    specs = export_segments(model, tmp_path, ds.image_shape)
    write_manifest(
        tmp_path,
        build_manifest(
            model, specs, "p", "1", ds.classes, ds.image_shape, {"local": 0.1, "edge": 0.1}, {}, {}
        ),
    )
    torch_out = predict(model, ds)
    ort_out, = onnx_exits(tmp_path, ds)
    report = check_parity(torch_out, ort_out, ds.present)
    for exit_name in ("device", "local", "edge", "cloud"):
        assert report.disagreement[exit_name] <= 0.01, report
    # Scores cross the wire as float16, the rest is float32 arithmetic: differences stay tiny.
    assert report.max_abs_diff["device"] < 1e-3
    assert report.max_abs_diff["local"] < 0.05
    # Without the wire's rounding (what the build's parity check reads) every exit is float32
    # arithmetic on both sides: the int8 edge features' rounding no longer reaches the cloud.
    exact, = onnx_exits(tmp_path, ds, exact_links=True)
    report = check_parity(torch_out, exact, ds.present)
    assert max(report.max_abs_diff.values()) < 1e-3, report


def test_float_device_variant_exports_and_calibrates(tiny_data, tmp_path):
    cfg = DDNNConfig.from_flat(device_codec="float16", epochs=1, scheme="AP-CC")
    build_bundle(tiny_data.train, tmp_path / "f", cfg, progress=False, log=lambda *_: None)
    m = load_bundle(tmp_path / "f").manifest
    assert m.codec["device_features"] == "float16" and m.aggregation == {
        "local": "avg",
        "edge": "concat",
    }
    ds = load_dataset(tiny_data.test)
    exits = BundleRuntime(load_bundle(tmp_path / "f")).run_dataset(ds.X, ds.present)
    assert exits["cloud"].shape == (ds.num_samples, 3) and np.isfinite(exits["cloud"]).all()
