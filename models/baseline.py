"""The raw-offload reference: a float CNN on the full images of every present view.

This is what the hierarchy is judged against: send every camera's raw image to the cloud and
classify there with an ordinary network, no binarization, no early exit. Each view goes through
one shared float trunk (``models.view_cnn``); the trunk outputs are fused by their maximum over
the present views and classified. It trains with the same loop, epochs, augmentation, splits
and seed as the DDNN (``models.train``), and is written as a bundle of its own kind (``raw``).
"""

from __future__ import annotations

import datetime as dt
import json
import shutil
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ddnn.bundle import check_name, load_bundle, write_manifest
from ddnn.dataset import MultiViewDataset, load_dataset
from ddnn.errors import BundleError
from ddnn.models.build import split_data
from ddnn.models.config import DDNNConfig
from ddnn.models.distributed import Distributed
from ddnn.models.export import PARITY_MAX_DISAGREE, _export, publish, staging_dir
from ddnn.models.report import write_config
from ddnn.models.train import predict, train
from ddnn.models.view_cnn import ViewTrunk, max_over_views
from ddnn.raw_manifest import RawManifest
from ddnn.segment import BATCH, SegmentSpec, TensorSpec, sha256_file


class RawOffloadCNN(nn.Module):
    """Views (B, V, 3, H, W) and present (B, V) → {"cloud": logits (B, C)}.

    What a user would deploy if bandwidth were free: a per-view trunk of three double-conv
    blocks (32, 64, 128 filters, batch norm; 290 k weights), the maximum over the present
    views, a linear head.
    """

    def __init__(self, classes: int, widths: tuple[int, ...] = (32, 64, 128)):
        super().__init__()
        self.trunk = ViewTrunk(widths)
        self.head = nn.Linear(self.trunk.dim, classes)

    def forward(self, x: torch.Tensor, present: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"cloud": self.head(max_over_views(self.trunk(x, present), present))}


def _loss(out, y, label):
    return nn.functional.cross_entropy(out["cloud"], label)


def accuracy(model: nn.Module, ds: MultiViewDataset) -> float:
    return float((predict(model, ds)["cloud"].argmax(-1) == ds.label).mean())


def _score(model, ds):
    acc = accuracy(model, ds)
    return acc, {"raw": acc}


def train_baseline(data, cfg: DDNNConfig, val_data=None, progress: bool = False):
    """Train the reference on the DDNN's training split; returns (train result, training
    samples, held-out set)."""
    _, train_ds, stop_ds, val_ds = split_data(data, val_data, cfg)
    torch.manual_seed(cfg.training.seed)  # the initial weights too: same seed, same reference
    model = RawOffloadCNN(len(train_ds.classes))
    result = train(train_ds, stop_ds, cfg, progress=progress, model=model, loss_fn=_loss,
                   score_fn=_score)
    return result, train_ds.num_samples, val_ds


def build_baseline(data, out, cfg: DDNNConfig, val_data=None, test_data=None,
                   progress: bool = True, name: str = "ddnn", version: str = "1") -> dict | None:
    """Train the reference and write it to ``out`` as a raw-offload bundle (rank 0 only).

    The bundle (``ddnn.bundle.RawManifest``, ``"kind": "raw"``) holds ``raw.onnx`` (every
    view's image, zeros for an absent one → scores), its checksum, and ``report/metrics.json``;
    ONNX Runtime must agree with torch on the held-out split before it is published.
    """
    out = Path(out)
    result, train_samples, val_ds = train_baseline(data, cfg, val_data, progress)
    dist = Distributed.from_env(cfg)
    if not dist.main:
        dist.close()
        return None
    model = result.model.cpu().eval()
    training = {
        "model": "raw-offload float CNN: per-view trunk of double-conv blocks "
                 f"{list(model.trunk.widths)}, max over the present views, linear head",
        "data": str(data),
        "parameters": sum(p.numel() for p in model.parameters()),
        "train_samples": train_samples,
        "val_samples": val_ds.num_samples,
        "epochs": cfg.training.epochs, "best_epoch": result.best_epoch,
        "seconds": round(result.seconds, 2),
        "val_accuracy": accuracy(model, val_ds),
        "config": cfg.to_dict(),
        "torch": torch.__version__,
    }
    if test_data is not None:
        test = load_dataset(test_data, num_classes=len(val_ds.classes))
        training["test_accuracy"] = accuracy(model, test)
    staging = staging_dir(out)
    try:
        path = staging / "raw.onnx"
        x = torch.rand(2, val_ds.num_views, *val_ds.image_shape)
        scores = _Scores(model)
        _export(scores, {"views": x}, ["scores"], path)
        spec = SegmentSpec(path.name, sha256_file(path),
                           (TensorSpec("views", (BATCH, *x.shape[1:])),),
                           (TensorSpec("scores", (BATCH, len(val_ds.classes))),),
                           path.stat().st_size)
        manifest = RawManifest(
            name=check_name("model name", name), version=check_name("model version", version),
            classes=val_ds.classes, views=val_ds.num_views, input_shape=val_ds.image_shape,
            raw=spec, training=training,
            created=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"))
        write_manifest(staging, manifest)  # type: ignore[arg-type]
        training["parity"] = _parity(model, staging, val_ds)
        write_manifest(staging, manifest)  # type: ignore[arg-type]  # now with the parity
        (staging / "report").mkdir()
        (staging / "report" / "metrics.json").write_text(json.dumps(training, indent=2) + "\n")
        write_config(staging / "report", cfg)
        publish(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        dist.close()
    load_bundle(out, kind="raw")
    return training


def _parity(model: RawOffloadCNN, bundle: Path, ds: MultiViewDataset) -> dict:
    """Torch and ONNX Runtime on the held-out split; refuses an export that disagrees."""
    from ddnn.runtime import SegmentRunner

    spec = load_bundle(bundle, kind="raw").manifest.raw
    runner = SegmentRunner(bundle / spec.file, spec)
    onnx = np.concatenate([runner(views=ds.X[i:i + 256])["scores"]
                           for i in range(0, ds.num_samples, 256)])
    torch_scores = predict(model, ds)["cloud"]
    report = {"max_abs_diff": float(np.abs(onnx - torch_scores).max()),
              "disagreement": float((onnx.argmax(-1) != torch_scores.argmax(-1)).mean())}
    if report["disagreement"] > PARITY_MAX_DISAGREE:
        raise BundleError(f"ONNX export of the reference disagrees with torch: {report}")
    return report


class _Scores(nn.Module):
    """The reference as served: views (B, V, 3, H, W), an absent view all zeros → scores."""

    def __init__(self, model: RawOffloadCNN):
        super().__init__()
        self.model = model

    def forward(self, views: torch.Tensor) -> torch.Tensor:
        present = views.flatten(2).abs().amax(2) > 0
        return self.model(views, present)["cloud"]
