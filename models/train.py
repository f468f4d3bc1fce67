"""Joint training of all exits (DDNN §III-D): one optimizer, a weighted sum of the exits' losses."""

from __future__ import annotations

import copy
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from ddnn.dataset import MultiViewDataset
from ddnn.models.config import DDNNConfig
from ddnn.models.network import DDNN


def split_holdout(
    ds: MultiViewDataset, fraction: float, seed: int
) -> tuple[MultiViewDataset, MultiViewDataset]:
    """A stratified random split: (train, held-out), the same for the same seed."""
    rng = np.random.default_rng(seed)
    held = np.zeros(ds.num_samples, dtype=bool)
    for c in np.unique(ds.label):
        idx = rng.permutation(np.flatnonzero(ds.label == c))
        held[idx[: max(1, round(fraction * len(idx)))]] = True
    return ds.subset(~held), ds.subset(held)


@dataclass
class TrainResult:
    """The trained network and how training went."""

    model: DDNN
    history: list[dict] = field(default_factory=list)  # per epoch: loss and validation accuracy
    best_epoch: int = 0
    seconds: float = 0.0


def _tensors(ds: MultiViewDataset) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.from_numpy(ds.X), torch.from_numpy(ds.y), torch.from_numpy(ds.label)


def joint_loss(
    out: dict[str, torch.Tensor], y: torch.Tensor, label: torch.Tensor, weights
) -> torch.Tensor:
    """Weighted sum of the exits' cross-entropies; device exits learn each present view's label."""
    ce = nn.functional.cross_entropy
    present = y >= 0
    device = ce(out["device"][present], y[present]) if present.any() else out["device"].sum() * 0
    w_dev, w_loc, w_edge, w_cloud = weights
    return (
        w_dev * device
        + w_loc * ce(out["local"], label)
        + w_edge * ce(out["edge"], label)
        + w_cloud * ce(out["cloud"], label)
    )


@torch.no_grad()
def predict(model: DDNN, ds: MultiViewDataset, batch: int = 512) -> dict[str, np.ndarray]:
    """Logits of every exit for a dataset, in evaluation mode."""
    model.eval()
    X, y, _ = _tensors(ds)
    parts = [model(X[i : i + batch], y[i : i + batch] >= 0) for i in range(0, len(X), batch)]
    return {k: torch.cat([p[k] for p in parts]).numpy() for k in parts[0]}


def exit_accuracy(logits: dict[str, np.ndarray], ds: MultiViewDataset) -> dict[str, float]:
    present = ds.present
    acc = {k: float((logits[k].argmax(-1) == ds.label).mean()) for k in ("local", "edge", "cloud")}
    acc["device"] = float((logits["device"].argmax(-1) == ds.y)[present].mean())
    return acc


def train(
    train_ds: MultiViewDataset,
    val_ds: MultiViewDataset,
    cfg: DDNNConfig,
    progress: bool = True,
) -> TrainResult:
    """Train a DDNN on ``train_ds``; keep the epoch with the best validation cloud accuracy."""
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads)
    _, h, w = train_ds.image_shape
    model = DDNN(cfg, train_ds.num_views, len(train_ds.classes), h, w)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cfg.epochs)
    X, y, label = _tensors(train_ds)
    gen = torch.Generator().manual_seed(cfg.seed)
    result = TrainResult(model)
    best_key, best_state = -1.0, None
    start = time.perf_counter()
    bar = tqdm(
        range(1, cfg.epochs + 1),
        desc="training",
        unit="epoch",
        disable=not progress,
        file=sys.stderr,
    )
    for epoch in bar:
        model.train()
        order = torch.randperm(len(X), generator=gen)
        total, steps = 0.0, 0
        for i in range(0, len(X), cfg.batch_size):
            idx = order[i : i + cfg.batch_size]
            out = model(X[idx], y[idx] >= 0)
            loss = joint_loss(out, y[idx], label[idx], cfg.exit_weights)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total, steps = total + loss.item(), steps + 1
        sched.step()
        acc = exit_accuracy(predict(model, val_ds), val_ds)
        result.history.append({"epoch": epoch, "loss": total / steps, "val_accuracy": acc})
        # Rank by the cloud exit, then the local one: the last exit bounds the hierarchy.
        key = acc["cloud"] + 1e-3 * acc["local"]
        if key > best_key:
            best_key, best_state, result.best_epoch = key, copy.deepcopy(model.state_dict()), epoch
        bar.set_postfix(
            loss=f"{total / steps:.3f}", local=f"{acc['local']:.3f}", cloud=f"{acc['cloud']:.3f}"
        )
    if best_state is not None:
        model.load_state_dict(best_state)
    model.eval()
    result.seconds = time.perf_counter() - start
    return result
