"""The federation's result as an ordinary bundle, written by the existing export.

The same path as ``ddnn train`` (``models.export``): every segment exported to ONNX, the
device weights stored as float16, torch checked against ONNX Runtime before anything is
published, the manifest written last and the directory renamed into place. The thresholds come
from the sites' held-out data (``calibration.calibrate_counts``); the version is the next one
in the project's one version order; the training section keeps the starting bundle's and adds
what the federation did.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from ddnn.bundle import Bundle, load_bundle
from ddnn.models.calibrate import Calibration
from ddnn.models.export import (
    build_manifest,
    export_segments,
    publish,
    staging_dir,
    write_manifest,
)
from ddnn.models.federated.weights import (
    Weights,
    build_model,
    check_against_onnx,
    set_weights,
)
from ddnn.stacking import Stacking


def write_federated_bundle(start: Bundle, arch: dict, weights: Weights, out: str | Path,
                           version: str, calibration: Calibration | None,
                           federation: dict, stacking: Stacking | None = None) -> Bundle:
    """Export ``weights`` as bundle ``version`` at ``out`` (replacing what is there), its
    exits stacked by ``stacking`` (refitted by the sites) or else as the starting bundle's."""
    out = Path(out)
    m = start.manifest
    model = build_model(arch)
    set_weights(model, weights)
    staging = staging_dir(out)
    try:
        specs = export_segments(model, staging, m.input_shape)
        training = {**m.training, "federation": federation,
                    "started_from": {"name": m.name, "version": m.version}}
        stacked = stacking if stacking is not None else m.stacking
        if calibration is None:  # no site had held-out data: keep the thresholds it had
            thresholds, cal = dict(m.thresholds), {"federated": False,
                                                   "kept_from": m.version}
            level, stacked = m.escalation_level, m.stacking
        else:
            thresholds = {"local": calibration.local, "edge": calibration.edge}
            level = calibration.point.level  # 1 only where every site counted level 1
            cal = {**calibration.to_dict(), "federated": True,
                   "data": "the sites' held-out splits (summed exit tables)"}

        def manifest(ts: dict[str, float], calibration_section: dict):
            # The sites calibrated with this stacking (server_app.evaluate_everywhere).
            return build_manifest(model, specs, m.name, version, m.classes, m.input_shape, ts,
                                  training, calibration_section, escalation_level=level,
                                  stacking=stacked)

        write_manifest(staging, manifest({"local": 0.0, "edge": 0.0}, {}))
        check_against_onnx(model, load_bundle(staging))
        write_manifest(staging, manifest(thresholds, cal))
        publish(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return load_bundle(out)
