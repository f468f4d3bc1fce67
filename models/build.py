"""``ddnn train``: dataset → joint training → export → parity check → calibration → bundle."""

from __future__ import annotations

import platform
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ddnn.bundle import load_bundle
from ddnn.dataset import MultiViewDataset, load_dataset
from ddnn.errors import DatasetError
from ddnn.hierarchy import UplinkCost, summarize
from ddnn.models.calibrate import Calibration, calibrate, fit_stacking
from ddnn.models.config import DDNNConfig
from ddnn.models.distributed import Distributed
from ddnn.models.export import (
    build_manifest,
    check_parity,
    export_segments,
    onnx_exits,
    publish,
    staging_dir,
    write_manifest,
)
from ddnn.models.report import threshold_curves, write_config, write_report
from ddnn.models.train import exit_accuracy, predict, split_holdout, train
from ddnn.stacking import BELOW, Stacking


def _check_compatible(train_ds: MultiViewDataset, val_ds: MultiViewDataset, path: Path) -> None:
    if (val_ds.num_views, val_ds.image_shape) != (train_ds.num_views, train_ds.image_shape):
        raise DatasetError(f"{path}: views or image size differ from the training file")
    if val_ds.classes != train_ds.classes:
        raise DatasetError(f"{path}: class names differ from the training file")


def seen(ds: MultiViewDataset) -> MultiViewDataset:
    """The samples at least one view sees: one that no camera sees (label -1) has nothing to
    learn from or to calibrate on."""
    keep = ds.label >= 0
    return ds if keep.all() else ds.subset(keep)


def split_data(data: str | Path, val_data: str | Path | None, cfg: DDNNConfig):
    """The whole training file and three disjoint parts: training, early stopping, calibration.

    The calibration split selects the thresholds and nothing else; the early-stopping split
    picks the epoch. A directory dataset stays memory-mapped; the held-out parts are read in.
    """
    full = seen(load_dataset(data, mmap=True))
    if val_data is None:
        rest, val_ds = split_holdout(full, cfg.calibration.val_fraction, cfg.training.seed)
    else:
        rest, val_ds = full, seen(load_dataset(val_data, num_classes=len(full.classes)))
        _check_compatible(full, val_ds, Path(val_data))
    share = cfg.training.stop_fraction / (1 - (0 if val_data else cfg.calibration.val_fraction))
    train_ds, stop_ds = split_holdout(rest, share, cfg.training.seed + 1)
    return full, train_ds, stop_ds.in_memory(), val_ds.in_memory()


def _training_summary(data, val_data, cfg: DDNNConfig, train_ds: MultiViewDataset,
                      val_ds: MultiViewDataset, result, torch_val, stop_samples: int,
                      dist: Distributed) -> dict:
    """The manifest's training section: data, epochs, time, per-exit validation accuracy."""
    return {
        "data": str(data),
        "validation": (str(val_data) if val_data
                       else f"{cfg.calibration.val_fraction:.0%} of the data"),
        "train_samples": train_ds.num_samples,
        "val_samples": val_ds.num_samples,
        "stop_samples": stop_samples,
        "processes": dist.world,
        "device": str(dist.device),  # where it ran (--device auto: CUDA when present)
        "precision": dist.precision,
        "epochs": cfg.training.epochs,
        "epochs_run": len(result.history),
        "best_epoch": result.best_epoch,
        "seconds": round(result.seconds, 2),
        "val_accuracy": exit_accuracy(torch_val, val_ds),
        "config": cfg.to_dict(),
        "teacher": result.teacher,  # the raw-view reference it learned from (--teacher), if any
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
    checkpoint: str | Path | None = None,
    resume: bool = False,
    teacher: str | Path | None = None,
) -> dict | None:
    """Train on ``data`` and write a calibrated bundle to ``out``; returns the training metrics.

    Under torchrun every process trains and rank 0 alone exports; the others return None.
    """
    cfg = cfg or DDNNConfig()
    out = Path(out)
    dist = Distributed.from_env(cfg)
    full, train_ds, stop_ds, val_ds = split_data(data, val_data, cfg)
    if dist.main:
        log(
            f"training on {train_ds.num_samples} samples x {train_ds.num_views} views "
            f"{train_ds.image_shape}, {len(full.classes)} classes, early stopping on "
            f"{stop_ds.num_samples}, calibrating on {val_ds.num_samples}; scheme "
            f"{cfg.edge.scheme}, {cfg.training.epochs} epochs, {dist.world} process(es) on "
            f"{dist.device}"
        )
    taught_by = None
    if teacher is not None:
        from ddnn.models.teacher import load_teacher

        taught_by = load_teacher(teacher, train_ds, cfg.training.threads)
    result = train(train_ds, stop_ds, cfg, progress=progress, checkpoint=checkpoint,
                   resume=resume, teacher=taught_by)
    if not dist.main:
        dist.close()
        return None
    try:
        return _export_bundle(result, full, train_ds, val_ds, stop_ds, out, cfg,
                              data, val_data, name, version, dist)
    finally:
        dist.close()


def scores_record(device_scores: np.ndarray, present: np.ndarray) -> dict:
    """What the devices send, for the edge's bounds (ddnn.edge.score_bounds): logits, and the
    largest magnitude of any on the calibration data (``device_scores`` (N, V, C))."""
    seen = device_scores[np.asarray(present, bool)]
    return {"kind": "logits", "max_abs": float(np.abs(seen).max()) if seen.size else 0.0}


@dataclass(frozen=True)
class HeldOut:
    """What the held-out splits decide for an exported bundle: its stacking and thresholds."""

    exits: dict[str, np.ndarray]  # the calibration split's, each segment's own scores
    answers: dict[str, np.ndarray]  # ... as the tiers answer them (stacked)
    stacking: Stacking | None
    calibration: Calibration


def fit_held_out(staging: Path, val_ds: MultiViewDataset, stop_ds: MultiViewDataset,
                 cfg: DDNNConfig) -> HeldOut:
    """Stack the exits (``cfg.calibration.stack_exits``) and calibrate the thresholds of the
    bundle in ``staging``, whose manifest neither stacks nor has thresholds yet, as ONNX Runtime
    runs it.

    The stacking weights are fitted on both held-out splits (the early-stopping split too:
    neither trained the weights, and the more frames, the less a weight chases a few of them);
    the thresholds on the calibration split, from the stacked answers.
    """
    bundle = load_bundle(staging, verify=False)
    exits, *stop = onnx_exits(staging, val_ds, *([stop_ds] if cfg.calibration.stack_exits else []))
    stacking = None
    if stop:  # (stacking on)
        both = {k: np.concatenate([stop[0][k], exits[k]]) for k in ("local", *BELOW)
                if k in exits}
        stacking = fit_stacking(both, np.concatenate([stop_ds.label, val_ds.label]),
                                bundle.manifest.views)
    answers = stacking.apply(exits) if stacking is not None else exits
    c = cfg.calibration
    cal = calibrate(answers, val_ds.label, val_ds.present, UplinkCost.of(bundle.manifest),
                    c.tolerance, c.max_bytes, c.threshold_grid, c.agreement)
    return HeldOut(exits, answers, stacking, cal)


def _export_bundle(result, full, train_ds, val_ds, stop_ds, out, cfg, data, val_data,
                   name, version, dist) -> dict:
    model = result.model.cpu()
    staging = staging_dir(out)
    try:
        specs = export_segments(model, staging, train_ds.image_shape)
        # After the export: it rounds the device weights to the float16 their files store.
        torch_val = predict(model, val_ds)
        training = _training_summary(data, val_data, cfg, train_ds, val_ds, result, torch_val,
                                     stop_ds.num_samples, dist)

        def manifest(thresholds: dict[str, float], calibration: dict, level: int = 0,
                     stacking: Stacking | None = None):
            return build_manifest(model, specs, name, version, full.classes,
                                  train_ds.image_shape, thresholds, training, calibration, level,
                                  stacking)

        # A provisional manifest lets ONNX Runtime run the bundle exactly as the tiers will,
        # each segment on its own.
        write_manifest(staging, manifest({"local": 0.0, "edge": 0.0}, {}))
        held = fit_held_out(staging, val_ds, stop_ds, cfg)
        exact, = onnx_exits(staging, val_ds, exact_links=True)
        parity = check_parity(torch_val, exact, val_ds.present)
        cal, ort_val = held.calibration, held.answers
        calibration = {**cal.to_dict(), "parity": parity.to_dict(),
                       "scores": scores_record(ort_val["device"], val_ds.present)}
        final = manifest(cal.point.thresholds, calibration, cal.level, held.stacking)
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
        write_config(staging / "report", cfg)
        publish(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    load_bundle(out)
    return metrics
