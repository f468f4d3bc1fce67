"""``ddnn train``: dataset → joint training → export → parity check → calibration → bundle."""

from __future__ import annotations

import platform
import shutil
from pathlib import Path

import torch

from ddnn.bundle import load_bundle
from ddnn.dataset import MultiViewDataset, load_dataset
from ddnn.errors import DatasetError
from ddnn.hierarchy import summarize
from ddnn.models.calibrate import calibrate
from ddnn.models.config import DDNNConfig
from ddnn.models.export import (
    build_manifest,
    check_parity,
    export_segments,
    onnx_exits,
    publish,
    staging_dir,
    write_manifest,
)
from ddnn.models.report import threshold_curves, write_report
from ddnn.models.train import exit_accuracy, predict, split_holdout, train


def _check_compatible(train_ds: MultiViewDataset, val_ds: MultiViewDataset, path: Path) -> None:
    if (val_ds.num_views, val_ds.image_shape) != (train_ds.num_views, train_ds.image_shape):
        raise DatasetError(f"{path}: views or image size differ from the training file")
    if val_ds.classes != train_ds.classes:
        raise DatasetError(f"{path}: class names differ from the training file")


def _splits(data: str | Path, val_data: str | Path | None, cfg: DDNNConfig
            ) -> tuple[MultiViewDataset, MultiViewDataset, MultiViewDataset]:
    """The whole training file, and its training and validation splits."""
    full = load_dataset(data)
    if val_data is None:
        return (full, *split_holdout(full, cfg.val_fraction, cfg.seed))
    val_ds = load_dataset(val_data, num_classes=len(full.classes))
    _check_compatible(full, val_ds, Path(val_data))
    return full, full, val_ds


def _training_summary(data, val_data, cfg: DDNNConfig, train_ds: MultiViewDataset,
                      val_ds: MultiViewDataset, result, torch_val) -> dict:
    """The manifest's training section: data, epochs, time, per-exit validation accuracy."""
    return {
        "data": str(data),
        "validation": str(val_data) if val_data else f"{cfg.val_fraction:.0%} of the data",
        "train_samples": train_ds.num_samples,
        "val_samples": val_ds.num_samples,
        "epochs": cfg.epochs,
        "best_epoch": result.best_epoch,
        "seconds": round(result.seconds, 2),
        "val_accuracy": exit_accuracy(torch_val, val_ds),
        "config": cfg.to_dict(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def build_bundle(
    data: str | Path,
    out: str | Path,
    cfg: DDNNConfig | None = None,
    val_data: str | Path | None = None,
    name: str = "ddnn",
    version: str = "1",
    progress: bool = True,
    log=print,
) -> dict:
    """Train on ``data`` and write a calibrated bundle to ``out``; returns the training metrics."""
    cfg = cfg or DDNNConfig()
    out = Path(out)
    full, train_ds, val_ds = _splits(data, val_data, cfg)
    log(
        f"training on {train_ds.num_samples} samples x {train_ds.num_views} views "
        f"{train_ds.image_shape}, {len(full.classes)} classes, held out {val_ds.num_samples}; "
        f"scheme {cfg.scheme}, {cfg.epochs} epochs"
    )
    result = train(train_ds, val_ds, cfg, progress=progress)
    model = result.model
    torch_val = predict(model, val_ds)

    staging = staging_dir(out)
    try:
        specs = export_segments(model, staging, train_ds.image_shape)
        training = _training_summary(data, val_data, cfg, train_ds, val_ds, result, torch_val)

        def manifest(thresholds: dict[str, float], calibration: dict):
            return build_manifest(
                model,
                specs,
                name,
                version,
                full.classes,
                train_ds.image_shape,
                thresholds,
                training,
                calibration,
            )

        # A provisional manifest lets ONNX Runtime run the bundle exactly as the tiers will.
        write_manifest(staging, manifest({"local": 0.0, "edge": 0.0}, {}))
        ort_val = onnx_exits(staging, val_ds)
        parity = check_parity(torch_val, ort_val, val_ds.present)
        cal = calibrate(ort_val, val_ds.label, cfg.tolerance, cfg.threshold_grid)
        calibration = {**cal.to_dict(), "parity": parity.to_dict()}
        final = manifest({"local": cal.local, "edge": cal.edge}, calibration)
        write_manifest(staging, final)
        metrics = {
            "training": training,
            "calibration": calibration,
            "validation": summarize(ort_val, val_ds.label, val_ds.y, final, final.policy),
            "history": result.history,
        }
        write_report(
            staging / "report",
            metrics,
            threshold_curves(ort_val, val_ds.label, val_ds.present, final),
            final,
        )
        publish(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    load_bundle(out)
    return metrics
