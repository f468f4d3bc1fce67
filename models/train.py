"""Joint training of all exits (DDNN §III-D): one optimizer, a weighted sum of the exits' losses.

Extras, each a field of :class:`TrainingConfig` measured on/off in ``docs/training.md``: online
distillation (the cloud exit teaches the earlier ones), augmentation, a learning-rate schedule
and early stopping on a split of its own. The same loop trains on one process or many under
``torchrun`` (``models.distributed``), on the CPU or CUDA with mixed precision, and saves a
checkpoint every epoch that ``resume`` continues from.
"""

from __future__ import annotations

import copy
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from ddnn.dataset import MultiViewDataset
from ddnn.errors import ConfigError
from ddnn.models.augment import augment
from ddnn.models.checkpoint import load_checkpoint, save_checkpoint
from ddnn.models.config import DDNNConfig
from ddnn.models.distributed import Distributed
from ddnn.models.network import DDNN

if TYPE_CHECKING:
    from ddnn.models.teacher import Teacher


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

    model: nn.Module
    history: list[dict] = field(default_factory=list)  # per epoch: loss and validation accuracy
    best_epoch: int = 0
    seconds: float = 0.0
    stopped_early: bool = False
    teacher: dict | None = None  # the raw-view reference it learned from (models.teacher)


def _distill(student: torch.Tensor, teacher: torch.Tensor, t: float) -> torch.Tensor:
    """KL(teacher ‖ student) on predictions softened by ``t``, scaled by t² (Hinton et al.)."""
    log_s = nn.functional.log_softmax(student / t, dim=-1)
    log_t = nn.functional.log_softmax(teacher / t, dim=-1)
    return nn.functional.kl_div(log_s, log_t, log_target=True, reduction="batchmean") * t * t


def joint_loss(
    out: dict[str, torch.Tensor], y: torch.Tensor, label: torch.Tensor, weights,
    distill: float = 0.0, temperature: float = 2.0, distill_device: bool = True,
    soft: torch.Tensor | None = None, teacher_weight: float = 0.0,
) -> torch.Tensor:
    """Weighted sum of the exits' cross-entropies; device exits learn each present view's label.

    The escalated cloud exit, when the network has one, weighs as the cloud exit does. With
    ``distill`` > 0 the top exit (detached: the escalated one, else the cloud) also teaches
    the exits below it, the device exits too unless ``distill_device`` is False. ``soft``:
    a raw-view teacher's logits for these samples (``models.teacher``), which teach every exit
    above the devices with ``teacher_weight``.
    """
    ce = nn.functional.cross_entropy
    present = y >= 0
    zero = out["device"].sum() * 0
    device = ce(out["device"][present], y[present]) if present.any() else zero
    w_dev, w_loc, w_edge, w_cloud = weights
    loss = (
        w_dev * device
        + w_loc * ce(out["local"], label)
        + w_edge * ce(out["edge"], label)
        + w_cloud * ce(out["cloud"], label)
    )
    top = "escalated" if "escalated" in out else "cloud"
    if top == "escalated":
        loss = loss + w_cloud * ce(out["escalated"], label)
    if distill > 0:
        teacher = out[top].detach().float()
        students = ["local", "edge"] + (["cloud"] if top == "escalated" else [])
        kd = sum(_distill(out[k].float(), teacher, temperature) for k in students)
        if distill_device and present.any():
            per_view = teacher[:, None].expand(-1, y.shape[1], -1)[present]
            kd = kd + _distill(out["device"][present].float(), per_view, temperature)
        loss = loss + distill * kd
    if soft is not None and teacher_weight > 0:  # a raw-view teacher (models.teacher)
        exits = [k for k in ("local", "edge", "cloud", "escalated") if k in out]
        loss = loss + teacher_weight * sum(_distill(out[k].float(), soft.float(), temperature)
                                           for k in exits)
    return loss


@torch.no_grad()
def predict(model: nn.Module, ds: MultiViewDataset, batch: int = 512) -> dict[str, np.ndarray]:
    """Logits of every exit for a dataset, in evaluation mode (batches read one at a time)."""
    model.eval()
    dev = next(model.parameters()).device
    parts = []
    for i in range(0, ds.num_samples, batch):
        x = torch.from_numpy(ds.images(slice(i, i + batch))).to(dev)
        present = torch.from_numpy(ds.present[i : i + batch]).to(dev)
        parts.append({k: v.float().cpu() for k, v in model(x, present).items()})
    return {k: torch.cat([p[k] for p in parts]).numpy() for k in parts[0]}


def exit_accuracy(logits: dict[str, np.ndarray], ds: MultiViewDataset) -> dict[str, float]:
    present = ds.present
    acc = {k: float((v.argmax(-1) == ds.label).mean()) for k, v in logits.items() if k != "device"}
    acc["device"] = float((logits["device"].argmax(-1) == ds.y)[present].mean())
    return acc


def _ddnn_score(model: nn.Module, ds: MultiViewDataset) -> tuple[float, dict[str, float]]:
    acc = exit_accuracy(predict(model, ds), ds)
    # Rank by the top exit (it bounds the hierarchy), then by the mean of the exits below it
    # (an epoch whose top exit ties keeps the better lower tiers).
    top = "escalated" if "escalated" in acc else "cloud"
    below = [v for k, v in acc.items() if k not in (top, "device")]
    return acc[top] + 1e-3 * sum(below) / len(below), acc


def _ddnn_loss(cfg: DDNNConfig):
    def loss(out, y, label, soft=None):
        t = cfg.training
        return joint_loss(out, y, label, t.exit_weights, t.distill, t.distill_temperature,
                          t.distill_device, soft, t.teacher_weight)

    return loss


def _schedule(opt, cfg: DDNNConfig, steps_per_epoch: int):
    total = max(1, cfg.training.epochs * steps_per_epoch)
    warm = max(1, total // 10) if cfg.training.schedule == "onecycle" else 0

    def factor(step: int) -> float:
        if cfg.training.schedule == "constant":
            return 1.0
        if step < warm:
            return (step + 1) / warm
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warm) / max(1, total - warm))))

    return torch.optim.lr_scheduler.LambdaLR(opt, factor)


@dataclass
class _Run:
    """What a checkpoint holds besides the model and the optimizer."""

    epoch: int = 0
    best_key: float = -1.0
    best_epoch: int = 0
    best_state: dict | None = None
    bad_epochs: int = 0
    history: list[dict] = field(default_factory=list)
    teacher: dict | None = None  # the raw-view teacher's identity: a resume must keep it


def half_resolution(x: torch.Tensor) -> torch.Tensor:
    """Views (B, V, 3, H, W) at half resolution, at their own size: each 2 x 2 block averaged
    (odd sizes keep their last row and column as they are)."""
    b, v, c, h, w = x.shape
    flat = x.reshape(b * v, c, h, w)
    low = nn.functional.interpolate(nn.functional.avg_pool2d(flat, 2), scale_factor=2,
                                    mode="nearest")
    out = flat.clone()
    out[..., : low.shape[-2], : low.shape[-1]] = low
    return out.reshape(x.shape)


def _batch(ds: MultiViewDataset, idx: np.ndarray, cfg: DDNNConfig, gen, dev, low: bool = False):
    idx = np.sort(idx)  # sorted rows read a memory-mapped file sequentially
    x = torch.from_numpy(ds.images(idx))
    present = torch.from_numpy(ds.present[idx])
    if low:  # incremental low-to-high resolution training (cfg.training.lowres_epochs)
        x = half_resolution(x)
    if cfg.training.augment:
        t = cfg.training
        x, present = augment(x, present, t.shift, t.brightness, t.view_dropout, gen)
    y = torch.from_numpy(ds.y[idx]).masked_fill(~present, -1)
    label = torch.from_numpy(ds.label[idx])
    return x.to(dev), present.to(dev), y.to(dev), label.to(dev)


def _epoch(model, opt, sched, ds, cfg, dist: Distributed, epoch: int, loss_fn,
           teacher_logits: torch.Tensor | None = None) -> float:
    model.train()
    gen = torch.Generator().manual_seed(cfg.training.seed * 100_003 + epoch * 7919 + dist.rank)
    total, steps = 0.0, 0
    for idx in dist.batches(ds.num_samples, cfg.training.batch_size, cfg.training.seed, epoch):
        x, present, y, label = _batch(ds, idx, cfg, gen, dist.device,
                                      low=epoch <= cfg.training.lowres_epochs)
        with dist.autocast():
            out = model(x, present)
        out = {k: v.float() for k, v in out.items()}
        if teacher_logits is None:
            loss = loss_fn(out, y, label)
        else:  # the teacher's logits of these samples (sorted, as _batch reads them)
            rows = torch.from_numpy(np.sort(idx)).to(teacher_logits.device)
            loss = loss_fn(out, y, label, teacher_logits[rows])
        opt.zero_grad(set_to_none=True)
        dist.backward(loss, opt)
        sched.step()
        total, steps = total + loss.item(), steps + 1
    return total / max(steps, 1)


def train(
    train_ds: MultiViewDataset,
    stop_ds: MultiViewDataset,
    cfg: DDNNConfig,
    progress: bool = True,
    model: nn.Module | None = None,
    loss_fn: Callable | None = None,
    score_fn: Callable = _ddnn_score,
    checkpoint: str | Path | None = None,
    resume: bool = False,
    teacher: Teacher | None = None,
) -> TrainResult:
    """Train on ``train_ds``; keep the epoch with the best score on ``stop_ds``.

    ``stop_ds`` chooses the epoch and stops early (``cfg.training.patience``); keep it apart from
    the calibration data. Runs distributed when started by torchrun (``models.distributed``).
    """
    torch.manual_seed(cfg.training.seed)
    torch.set_num_threads(cfg.training.threads)
    dist = Distributed.from_env(cfg)
    if model is None:
        _, h, w = train_ds.image_shape
        model = DDNN(cfg, train_ds.num_views, len(train_ds.classes), h, w)
    model = model.to(dist.device)
    if cfg.training.channels_last:  # oneDNN's faster conv kernels; undone before returning
        model = model.to(memory_format=torch.channels_last)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.training.lr,
                           weight_decay=cfg.training.weight_decay)
    sched = _schedule(opt, cfg, dist.steps_per_epoch(train_ds.num_samples, cfg.training.batch_size))
    run = _Run()
    taught_by = teacher.identity if teacher is not None else None
    if resume and checkpoint and Path(checkpoint).is_file():
        run = _Run(**load_checkpoint(checkpoint, model, opt, sched))
        if run.teacher != taught_by:
            raise ConfigError(f"{checkpoint} was trained with teacher {run.teacher}, not "
                              f"{taught_by}: resume with the same --teacher, or start afresh")
    run.teacher = taught_by
    wrapped = dist.wrap(model)
    soft = (None if teacher is None  # on the device once, its rows picked per batch
            else torch.from_numpy(np.asarray(teacher.logits, np.float32)).to(dist.device))
    start = time.perf_counter()
    bar = tqdm(range(run.epoch + 1, cfg.training.epochs + 1), desc="training", unit="epoch",
               disable=not progress or not dist.main, file=sys.stderr)
    for epoch in bar:
        loss = _epoch(wrapped, opt, sched, train_ds, cfg, dist, epoch,
                      loss_fn or _ddnn_loss(cfg), soft)
        stop, run.epoch = False, epoch
        if dist.main:
            key, acc = score_fn(model, stop_ds)
            run.history.append({"epoch": epoch, "loss": loss, "val_accuracy": acc})
            run.bad_epochs += 1
            if key > run.best_key:
                run.best_key, run.best_epoch, run.bad_epochs = key, epoch, 0
                run.best_state = copy.deepcopy(model.state_dict())
            stop = cfg.training.patience > 0 and run.bad_epochs >= cfg.training.patience
            bar.set_postfix(loss=f"{loss:.3f}", **{k: f"{v:.3f}" for k, v in acc.items()})
            if checkpoint:
                save_checkpoint(checkpoint, model, opt, sched, run.__dict__)
        if dist.agree(stop):
            break
    result = TrainResult(model, run.history, run.best_epoch,
                         stopped_early=run.epoch < cfg.training.epochs, teacher=taught_by)
    model = model.to(memory_format=torch.contiguous_format)  # export and save as always
    if run.best_state is not None:
        model.load_state_dict(run.best_state)
    model.eval()
    result.seconds = time.perf_counter() - start
    return result
