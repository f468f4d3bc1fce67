"""The trainer a site runs: fit from given weights for N local epochs, and evaluate.

A role of the training extra (torch), called by the ClientApp for each message and usable on
its own: :func:`fit` takes the shared weights, trains the network on the site's labelled data
(the joint loss of ``ddnn train``) and on its recorded experience (the cloud's soft labels
teach the layers above the device stem: online distillation), and returns the new weights.
With ``stop_when`` it checks the model every ``check_steps`` steps and stops as soon as the
check says so (dynamic averaging's divergence test). :func:`evaluate` measures a model on the
site's held-out split and returns the calibration tables (``calibration.exit_counts``) and,
for a bundle with stacked exits, the tables that refit their weights;
:func:`evaluate_experience` does the same on held-out experience, for a site without labelled
data, with the cloud's recorded answers as the labels.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ddnn.codec import FeatureCodec
from ddnn.dataset import MultiViewDataset, load_dataset
from ddnn.errors import DatasetError
from ddnn.experience import Experience, read_experience, stream_sample
from ddnn.hierarchy import detail_sizes, surest_views
from ddnn.models.augment import augment
from ddnn.models.federated.calibration import exit_counts
from ddnn.models.federated.weights import (
    Weights,
    build_model,
    model_weights,
    set_weights,
    stacking_of,
)
from ddnn.models.network import DDNN
from ddnn.models.train import joint_loss, predict, split_holdout


@dataclass(frozen=True)
class LocalTraining:
    """How a site trains in one round (the server sends these with every round)."""

    epochs: float = 2.0  # passes over the site's training data (or its experience) per round
    lr: float = 2e-3  # Adam learning rate of this round
    batch_size: int = 64
    seed: int = 0  # with the round number: the batch order and augmentation of the round
    augment: bool = True
    experience_weight: float = 1.0  # weight of the distillation loss on experience batches
    threads: int = 1  # torch CPU threads on the site
    # FedProx (Li et al., 2020): mu/2 * ||w - w_start||^2 added to the site's loss holds a
    # site whose classes are skewed near the shared model it started from (0: plain FedAvg).
    proximal: float = 0.0
    # Label skew (balanced softmax, Ren et al., 2020; logit adjustment, Menon et al., 2021):
    # each exit's logits get tau * log(the site's class prior) inside the site's loss, so a
    # site holding few classes stops pushing the others' scores down (0: the plain loss).
    balance: float = 0.0


@dataclass(frozen=True)
class SiteData:
    """What one site learns from: labelled samples, recorded experience, a held-out split."""

    train: MultiViewDataset | None
    holdout: MultiViewDataset | None
    experience: Experience | None
    # A site without a labelled held-out split holds out some experience instead: a sample
    # of its stream (ddnn.experience.stream_sample), none where no frame's chance is known.
    experience_holdout: Experience | None = None

    @property
    def examples(self) -> int:
        n = self.train.num_samples if self.train is not None else 0
        return n + (self.experience.num_samples if self.experience is not None else 0)


@dataclass(frozen=True)
class FitResult:
    weights: Weights
    examples: int  # samples the update learned from (FedAvg's weight)
    steps: int
    loss: float
    stopped: bool  # stop_when said so before the epochs were done
    gradient: Weights | None = None  # the mean raw gradient of the round (with a correction)


def load_site(arch: dict, data: str | Path | None, experience: str | Path | None = None, *,
              holdout: float = 0.2, seed: int = 0) -> SiteData:
    """A site's data for the network ``arch``: ``data`` split into training and held-out parts
    (stratified, by ``seed``), and ``experience`` (a directory of chunks), either optional."""
    if data is None and experience is None:
        raise DatasetError("a site needs labelled data, recorded experience, or both")
    classes = tuple(arch["classes"])
    train = held = None
    if data is not None:
        ds = load_dataset(data, num_classes=len(classes))
        if ds.num_views != arch["views"] or list(ds.image_shape) != list(arch["input_shape"]):
            raise DatasetError(f"{data}: {ds.num_views} views of {ds.image_shape}; the model "
                               f"takes {arch['views']} views of {tuple(arch['input_shape'])}")
        if ds.classes != classes:
            raise DatasetError(f"{data}: classes {ds.classes} differ from the model's {classes}")
        if ds.num_samples < 2:
            raise DatasetError(f"{data}: a site needs at least two samples to train on")
        train, held = split_holdout(ds, holdout, seed) if ds.num_samples >= 10 else (ds, None)
    exp = exp_held = None
    if experience is not None:
        model = build_model(arch)
        _, feats = model.devices[0](torch.zeros(1, *arch["input_shape"]))
        exp = read_experience(experience, classes, tuple(feats.shape[1:]), arch["views"])
        if held is None:
            exp, exp_held = split_experience(exp, holdout)
    return SiteData(train, held, exp, exp_held)


MIN_HELD_FRAMES = 10  # fewer frames of the stream held out calibrate nothing


def split_experience(exp: Experience, holdout: float) -> tuple[Experience, Experience | None]:
    """``exp`` as frames to learn from and a held-out sample of the stream: a ``holdout``
    share of :func:`ddnn.experience.stream_sample` (a uniform sample of every frame the edge
    saw, so a share of it is one too) among the frames with their devices' scores (the local
    exit's input); the rest, operators' labels included, is learned from. Each frame's draws
    are its own (``Experience.draw``), so a frame held out in one round is held out in every
    round, however the directory grew in between. None held out where that share would have
    fewer than :data:`MIN_HELD_FRAMES` frames, or where the experience recorded no chances."""
    if exp.chance is None or exp.draw is None or holdout <= 0:
        return exp, None
    chance = np.where(exp.scored, exp.chance, 0.0)
    sample = stream_sample(chance, exp.draw[:, 0])
    held = sample[exp.draw[sample, 1] < holdout]
    if held.size < MIN_HELD_FRAMES:
        return exp, None
    rest = np.ones(exp.num_samples, bool)
    rest[held] = False
    return exp.subset(np.flatnonzero(rest)), exp.subset(held)


def _soft_ce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy against soft labels (the cloud's probabilities)."""
    return -(target * torch.log_softmax(logits, dim=-1)).sum(-1).mean()


def experience_loss(model: DDNN, exp: Experience, idx: np.ndarray) -> torch.Tensor:
    """The cloud's recorded answers teach the local, edge and cloud exits from device features."""
    feats = torch.from_numpy(exp.features[idx])
    present = torch.from_numpy(exp.present[idx])
    target = torch.from_numpy(exp.soft_label[idx])
    edge_scores, edge_feats = model.edge_exit(feats, present)
    loss = _soft_ce(edge_scores, target) + _soft_ce(model.cloud(edge_feats), target)
    scored = np.flatnonzero(exp.scored[idx])  # (an operator's labelled frame has no scores)
    if scored.size:
        local = model.local_exit(torch.from_numpy(exp.device_scores[idx[scored]]),
                                 present[scored])
        loss = loss + _soft_ce(local, target[scored]) * (scored.size / len(idx))
    return loss


def class_prior_shift(ds: MultiViewDataset, tau: float) -> torch.Tensor:
    """``tau * log`` of the site's class prior (add-one smoothed: a class the site lacks gets
    a large negative shift, not minus infinity)."""
    counts = np.bincount(ds.label, minlength=len(ds.classes)).astype(np.float64) + 1.0
    return torch.from_numpy(tau * np.log(counts / counts.sum())).float()


_EXITS = ("device", "local", "edge", "cloud", "escalated")  # the outputs that are class scores


def _labelled_loss(model: DDNN, ds: MultiViewDataset, idx: np.ndarray, s: LocalTraining,
                   gen: torch.Generator, shift: torch.Tensor | None = None) -> torch.Tensor:
    t = model.cfg.training
    idx = np.sort(idx)
    x, present = torch.from_numpy(ds.images(idx)), torch.from_numpy(ds.present[idx])
    if s.augment:
        x, present = augment(x, present, t.shift, t.brightness, t.view_dropout, gen)
    y = torch.from_numpy(ds.y[idx]).masked_fill(~present, -1)
    out = model(x, present)
    if shift is not None:  # (broadcasts over the device exits' views too)
        out = {k: v + shift if k in _EXITS else v for k, v in out.items()}
    return joint_loss(out, y, torch.from_numpy(ds.label[idx]), t.exit_weights, t.distill,
                      t.distill_temperature, t.distill_device)


def fit(arch: dict, weights: Weights, site: SiteData, settings: LocalTraining,
        round_seed: int = 0, stop_when: Callable[[Weights], bool] | None = None,
        check_steps: int = 0, correction: Weights | None = None,
        step_correction: Weights | None = None) -> FitResult:
    """Train from ``weights`` for ``settings.epochs`` local epochs; return the new weights.

    ``correction`` (SCAFFOLD, Karimireddy et al., 2020: the federation's mean gradient less
    this site's, by parameter name; a name it lacks is not corrected, so ``{}`` corrects
    nothing) is added to every raw gradient before the optimizer's step; the result then
    carries the round's mean raw gradient of every trainable parameter, this site's next
    control variate.

    ``step_correction`` (SCAFFOLD's option II, :mod:`ddnn.models.federated.scaffold`: the
    federation's mean step direction less this site's, in the optimizer's own units, by
    parameter name) moves each parameter it names by ``-lr * correction`` after every
    optimizer step. The site's own direction is read off the weights it ends with, so nothing
    more comes back."""
    torch.set_num_threads(settings.threads)
    torch.manual_seed(settings.seed * 1_000_003 + round_seed)
    model = build_model(arch)
    set_weights(model, weights)
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=settings.lr)
    anchor = ([(p, p.detach().clone()) for p in model.parameters() if p.requires_grad]
              if settings.proximal > 0 else [])
    rng = np.random.default_rng([settings.seed, round_seed])
    gen = torch.Generator().manual_seed(settings.seed * 7919 + round_seed)
    n_lab = site.train.num_samples if site.train is not None else 0
    n_exp = site.experience.num_samples if site.experience is not None else 0
    per_epoch = math.ceil(max(n_lab, n_exp) / settings.batch_size)
    total = max(1, round(settings.epochs * per_epoch))
    lab_order = _cycle(rng, n_lab, settings.batch_size)
    exp_order = _cycle(rng, n_exp, settings.batch_size)
    shift = (class_prior_shift(site.train, settings.balance)
             if settings.balance > 0 and n_lab else None)
    named = ([(n, p) for n, p in model.named_parameters() if p.requires_grad]
             if correction is not None else [])
    fix = {n: torch.from_numpy(correction[n]) for n, _ in named if n in (correction or {})}
    after = [(p, torch.from_numpy(step_correction[n])) for n, p in model.named_parameters()
             if p.requires_grad and n in (step_correction or {})]
    summed = {n: torch.zeros_like(p) for n, p in named}
    losses, stopped, step = [], False, 0
    for step in range(1, total + 1):
        loss = torch.zeros(())
        if n_lab:
            loss = loss + _labelled_loss(model, site.train, next(lab_order), settings, gen,
                                        shift)
        if n_exp:
            loss = loss + settings.experience_weight * experience_loss(
                model, site.experience, next(exp_order))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        for name, p in named:
            if p.grad is not None:
                summed[name] += p.grad
                if name in fix:
                    p.grad += fix[name]
        # FedProx's term mu/2 ||w - w0||^2, its gradient added by hand: it keeps this round's
        # steps near the start, and is no part of the site's gradient (its control variate).
        with torch.no_grad():
            for p, p0 in anchor:
                pull = settings.proximal * (p - p0)
                p.grad = pull if p.grad is None else p.grad + pull
        opt.step()
        if after:  # option II's correction, in the optimizer's units: after its step
            with torch.no_grad():
                for p, c in after:
                    p.sub_(c, alpha=settings.lr)
        losses.append(float(loss.item()))
        checking = stop_when is not None and check_steps and step % check_steps == 0
        if checking and step < total and stop_when(model_weights(model)):
            stopped = True
            break
    model.eval()
    gradient = ({n: (g / step).numpy().astype(np.float32) for n, g in summed.items()}
                if correction is not None else None)
    return FitResult(model_weights(model), site.examples, step, float(np.mean(losses)), stopped,
                     gradient)


def _cycle(rng: np.random.Generator, n: int, batch: int):
    """Batches of indices over ``n`` samples, reshuffled at every pass, forever. A last batch
    of one sample is left out of its pass: batch norm cannot train on a single sample."""
    while n:
        order = rng.permutation(n)
        for i in range(0, n, batch):
            if n - i > 1 or i == 0:
                yield order[i : i + batch]
    while True:
        yield np.zeros(0, dtype=np.int64)


@dataclass(frozen=True)
class Evaluation:
    """A model on a site's held-out split: what leaves the site after federated evaluation."""

    correct: dict[str, float]  # right answers per exit, and "samples"
    counts: dict[str, np.ndarray] | None  # the calibration tables (calibration.exit_counts)
    stacking_tables: dict[str, np.ndarray] | None  # where asked for and the bundle stacks


def evaluate(arch: dict, weights: Weights, ds: MultiViewDataset, grid: int = 201,
             threads: int = 1, with_stacking_tables: bool = False,
             with_counts: bool = True) -> Evaluation:
    """Correct answers per exit on ``ds`` and (unless ``with_counts`` is False: a round's
    check of its starting model) the calibration tables of the model, each tier answering with
    the architecture's stacking; with ``with_stacking_tables``, also the tables that refit
    that stacking (``models.calibrate.stacking_tables``, of the tiers' own answers)."""
    from ddnn.models.calibrate import stacking_tables

    torch.set_num_threads(threads)
    model = build_model(arch)
    set_weights(model, weights)
    own = predict(model, ds)
    stacking = stacking_of(arch)
    logits = stacking.apply(own) if stacking is not None else own  # as the bundle answers
    correct = {k: float((logits[k].argmax(-1) == ds.label).sum())
               for k in ("local", "edge", "cloud", "escalated") if k in logits}
    counts = None
    if with_counts:
        if model.escalated is not None:  # level 1 costs the details as the devices send them
            logits["detail_bytes"] = detail_bytes(model, ds, own["device"])
        counts = exit_counts(logits, ds.label, ds.present, grid)
    tables = (stacking_tables(own, ds.label) if with_stacking_tables and stacking is not None
              else None)
    return Evaluation({**correct, "samples": float(ds.num_samples)}, counts, tables)


def experience_exits(model: DDNN, exp: Experience, batch: int = 512) -> dict[str, np.ndarray]:
    """Each segment's own scores on recorded frames: the local exit from the devices' scores,
    the edge and cloud exits from their features (the escalated cloud needs the cameras'
    details, which experience never holds)."""
    if exp.num_samples == 0 or not exp.scored.all():
        raise ValueError("the local exit is evaluated on frames with their devices' scores")
    model.eval()
    parts = []
    with torch.no_grad():
        for i in range(0, exp.num_samples, batch):
            rows = slice(i, i + batch)
            present = torch.from_numpy(exp.present[rows])
            edge, edge_feats = model.edge_exit(torch.from_numpy(exp.features[rows]), present)
            parts.append({"local": model.local_exit(torch.from_numpy(exp.device_scores[rows]),
                                                    present),
                          "edge": edge, "cloud": model.cloud(edge_feats)})
    return {k: torch.cat([p[k] for p in parts]).float().numpy() for k in parts[0]}


def evaluate_experience(arch: dict, weights: Weights, exp: Experience, grid: int = 201,
                        threads: int = 1, with_stacking_tables: bool = False) -> Evaluation:
    """:func:`evaluate` on held-out experience (a sample of the stream, from
    :func:`split_experience`), each frame's label the best one known: the operator's, else the
    cloud's recorded answer (``Experience.teacher_label``). The tiers are those experience can
    run (local, edge, cloud: the calibration tables of level 0 only); the right answers count
    agreement with the teacher, so they measure accuracy only as far as the cloud is right."""
    from ddnn.models.calibrate import stacking_tables

    torch.set_num_threads(threads)
    model = build_model(arch)
    set_weights(model, weights)
    own = experience_exits(model, exp)
    labels = exp.teacher_label
    stacking = stacking_of(arch)
    logits = stacking.apply(own) if stacking is not None else own  # as the bundle answers
    correct = {k: float((logits[k].argmax(-1) == labels).sum()) for k in ("local", "edge",
                                                                          "cloud")}
    counts = exit_counts(logits, labels, exp.present, grid)
    tables = (stacking_tables(own, labels) if with_stacking_tables and stacking is not None
              else None)
    taught = float((~exp.labelled).sum())  # frames whose label is the cloud's answer
    return Evaluation({**correct, "samples": float(exp.num_samples), "teacher-labelled": taught},
                      counts, tables)


def detail_bytes(model: DDNN, ds: MultiViewDataset, device_scores: np.ndarray,
                 batch: int = 512) -> np.ndarray:
    """Each frame's details as its devices would send them if it escalated: every present
    view's (or the bundle's ``k`` surest views'), coded by the bundle's detail codec and
    deflated where shorter, as :meth:`ddnn.runtime.BundleRuntime.all_exits` counts them."""
    codec = FeatureCodec(model.cfg.escalation.codec)
    sizes = np.zeros(ds.present.shape, np.int64)
    with torch.no_grad():
        for i in range(0, ds.num_samples, batch):
            x = torch.from_numpy(ds.images(slice(i, i + batch)))
            present = ds.present[i : i + batch]
            for v, dev in enumerate(model.devices):
                rows = np.flatnonzero(present[:, v])
                if rows.size:
                    detail = dev.outputs(x[rows, v])[2].numpy()
                    sizes[i + rows, v] = detail_sizes(detail, codec)
    if model.detail_slots:
        sizes, _ = surest_views(sizes, device_scores, ds.present, model.detail_slots)
    return sizes.sum(axis=1)


def round_lr(lr: float, rnd: int, rounds: int) -> float:
    """The learning rate of round ``rnd`` (1-based): cosine decay over the rounds."""
    return lr * 0.5 * (1 + math.cos(math.pi * (rnd - 1) / max(rounds, 1)))

