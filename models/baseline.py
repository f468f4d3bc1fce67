"""The raw-offload reference: a float CNN on the full images of every present view.

This is what the hierarchy is judged against: send every camera's raw image to the cloud and
classify there with an ordinary network, no binarization, no early exit. Each view goes through
one shared float trunk; the trunk outputs are pooled over the present views (max and mean) and
classified. It trains with the same loop, splits and seed as the DDNN (``models.train``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ddnn.dataset import MultiViewDataset, load_dataset
from ddnn.models.build import split_data
from ddnn.models.config import DDNNConfig
from ddnn.models.distributed import Distributed
from ddnn.models.export import _export, staging_dir
from ddnn.models.train import predict, train


def _block(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(),
        nn.MaxPool2d(2),
    )


class RawOffloadCNN(nn.Module):
    """Views (B, V, 3, H, W) and present (B, V) → {"cloud": logits (B, C)}."""

    # width 16 (16-32-64 float filters, ~25k weights, 40x the DDNN's cloud-exit input): small
    # enough to train in minutes on 2 cores, far more than binarized 4-filter devices can see.
    def __init__(self, classes: int, width: int = 16):
        super().__init__()
        self.trunk = nn.Sequential(
            _block(3, width), _block(width, 2 * width), _block(2 * width, 4 * width),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        )
        self.head = nn.Linear(8 * width, classes)

    def forward(self, x: torch.Tensor, present: torch.Tensor) -> dict[str, torch.Tensor]:
        b, v = present.shape
        emb = self.trunk(x.reshape(b * v, *x.shape[2:]) * 2.0 - 1.0).reshape(b, v, -1)
        mask = present[..., None]
        count = present.sum(1, keepdim=True).clamp(min=1)
        mean = torch.where(mask, emb, torch.zeros_like(emb)).sum(1) / count
        top = torch.where(mask, emb, torch.full_like(emb, -1e4)).amax(1)
        return {"cloud": self.head(torch.cat([mean, top], dim=1))}


def _loss(out, y, label):
    return nn.functional.cross_entropy(out["cloud"], label)


def accuracy(model: nn.Module, ds: MultiViewDataset) -> float:
    return float((predict(model, ds)["cloud"].argmax(-1) == ds.label).mean())


def _score(model, ds):
    acc = accuracy(model, ds)
    return acc, {"raw": acc}


def train_baseline(data, cfg: DDNNConfig, val_data=None, progress: bool = False):
    """Train the reference on the DDNN's training split; returns (model, train result, val set)."""
    _, train_ds, stop_ds, val_ds = split_data(data, val_data, cfg)
    model = RawOffloadCNN(len(train_ds.classes))
    result = train(train_ds, stop_ds, cfg, progress=progress, model=model, loss_fn=_loss,
                   score_fn=_score)
    return result, val_ds


def build_baseline(data, out, cfg: DDNNConfig, val_data=None, test_data=None,
                   progress: bool = True) -> dict | None:
    """Train the reference and write ``out``/baseline.onnx and metrics.json (rank 0 only)."""
    out = Path(out)
    result, val_ds = train_baseline(data, cfg, val_data, progress)
    dist = Distributed.from_env(cfg)
    if not dist.main:
        dist.close()
        return None
    model = result.model.cpu().eval()
    metrics = {
        "model": "raw-offload float CNN (shared trunk per view, max+mean over present views)",
        "parameters": sum(p.numel() for p in model.parameters()),
        "epochs": cfg.epochs, "best_epoch": result.best_epoch,
        "seconds": round(result.seconds, 2),
        "val_accuracy": accuracy(model, val_ds),
    }
    if test_data is not None:
        test = load_dataset(test_data, num_classes=len(val_ds.classes))
        metrics["test_accuracy"] = accuracy(model, test)
    staging = staging_dir(out)
    try:
        x = torch.rand(2, val_ds.num_views, *val_ds.image_shape)
        present = torch.from_numpy(np.ones((2, val_ds.num_views), dtype=bool))
        _export(_Scores(model), {"views": x, "present": present}, ["scores"],
                staging / "baseline.onnx")
        (staging / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
        if out.exists():
            if not (out / "metrics.json").is_file():
                raise FileExistsError(f"{out}: exists and is not a baseline; not replacing it")
            shutil.rmtree(out)
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        dist.close()
    return metrics


class _Scores(nn.Module):
    def __init__(self, model: RawOffloadCNN):
        super().__init__()
        self.model = model

    def forward(self, views: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
        return self.model(views, present)["cloud"]
