"""The DDNN: one network with four kinds of exits, split into device, edge and cloud segments.

Per view, a device segment (ConvP blocks: conv → max-pool → batch norm → activation; the last
one's sign, or few-bit levels, is what travels) produces compact features and a device exit. The
local exit aggregates the device scores over the present views; the edge segment aggregates the
device features, runs one more ConvP block (on each view, then pooled over views, by default)
and its exit; the cloud segment runs the deep blocks and the final exit. The ``paper`` preset
(``ddnn.models.presets``) gives the paper's network: one binarized ConvP block with sign
activations per device. The same modules are exported one by one to ONNX (``models.export``).
"""

from __future__ import annotations

import torch
from torch import nn

from ddnn.models.config import DDNNConfig
from ddnn.models.view_cnn import ViewTrunk, max_over_views


class BinarySign(nn.Module):
    """Sign activation with values in {−1, +1}.

    Training uses the straight-through estimator with the hard-tanh window (the gradient passes
    where |x| ≤ 1); evaluation and export use an exact comparison so ONNX gets a plain ``Where``.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hard = torch.where(x >= 0, torch.ones_like(x), -torch.ones_like(x))
        if not self.training:
            return hard
        soft = torch.clamp(x, -1.0, 1.0)
        return soft + (hard - soft).detach()


class Quantize(nn.Module):
    """Activation on ``2**bits`` levels evenly spaced over [−1, 1]; ``bits`` 1 is the sign.

    The levels never include 0 (1 bit: ±1; 2 bits: ±1/3, ±1), so a present view's features are
    never all zeros and a zero-filled slot of a concatenation always means an absent view. The
    wire codec of the same name (``ddnn.codec``) carries them exactly. Training passes the
    gradient straight through where |x| ≤ 1.
    """

    def __init__(self, bits: int):
        super().__init__()
        self.bits = bits
        self.sign = BinarySign() if bits == 1 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sign is not None:
            return self.sign(x)
        steps = float(2**self.bits - 1)
        soft = torch.clamp(x, -1.0, 1.0)
        hard = torch.round((soft + 1.0) * (steps / 2)) * (2 / steps) - 1.0
        if not self.training:
            return hard
        return soft + (hard - soft).detach()


class BinaryConv2d(nn.Conv2d):
    """A 3×3 convolution whose weights are binarized to ±1 in the forward pass (eBNN)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        hard = torch.where(w >= 0, torch.ones_like(w), -torch.ones_like(w))
        wb = w + (hard - w).detach() if self.training else hard
        return self._conv_forward(x, wb, self.bias)


def folded_pairs(module: nn.Module) -> list[tuple[str, nn.Conv2d, str, nn.BatchNorm2d]]:
    """Each batch norm that directly follows a float convolution in ``module``'s layer order,
    with that convolution, as (conv name, conv, batch-norm name, batch norm): the pairs the ONNX
    export folds into one ``Conv`` (a double-conv block's inner layers, the escalated cloud's
    view trunk). A binarized convolution's ±1 weights are computed, so its batch norm is kept;
    a layer between them (a pool) keeps it too. The export (``models.export``) and the rebuild
    of a network from its ONNX files (``models.federated.weights``) both read this one list."""
    pairs, conv = [], None
    for name, mod in module.named_modules():
        if type(mod) is nn.Conv2d:
            conv = (name, mod)
        elif isinstance(mod, nn.BatchNorm2d) and conv is not None:
            pairs.append((*conv, name, mod))
            conv = None
        elif not any(True for _ in mod.children()):
            conv = None  # any other layer between them
    return pairs


class ConvP(nn.Module):
    """The paper's ConvP block: conv 3×3 → max-pool 3×3/2 → batch norm → activation.

    ``convs`` > 1 puts that many 3×3 convolutions before the pool, each but the last followed
    by batch norm and ReLU (a VGG-style block: twice the depth at the same resolution).
    """

    def __init__(self, c_in: int, c_out: int, binary_weights: bool, binary_act: bool,
                 convs: int = 1):
        super().__init__()
        conv = BinaryConv2d if binary_weights else nn.Conv2d
        layers: list[nn.Module] = []
        for _ in range(convs - 1):
            layers += [conv(c_in, c_out, kernel_size=3, padding=1, bias=False),
                       nn.BatchNorm2d(c_out), nn.ReLU()]
            c_in = c_out
        last = conv(c_in, c_out, kernel_size=3, padding=1, bias=False)
        self.conv = nn.Sequential(*layers, last) if layers else last
        self.pool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.bn = nn.BatchNorm2d(c_out)
        self.act = BinarySign() if binary_act else nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.bn(self.pool(self.conv(x))))


def _pooled(size: int, blocks: int) -> int:
    for _ in range(blocks):
        size = (size - 1) // 2 + 1  # MaxPool2d(3, stride 2, padding 1)
    return size


def _cells(k: int, h: int, w: int) -> tuple[nn.Module, int, int]:
    """Average pooling of an (h, w) map to at most k x k cells (windows overlap where k does not
    divide the side, so every pixel counts; a plain AveragePool in ONNX), and the cells."""
    if not k or (h <= k and w <= k):
        return nn.Identity(), h, w
    kh, kw = min(k, h), min(k, w)
    sh, sw = h // kh, w // kw
    size = (h - (kh - 1) * sh, w - (kw - 1) * sw)
    return nn.AvgPool2d(size, stride=(sh, sw)), kh, kw


class ExitHead(nn.Module):
    """An exit: features flattened → linear classifier (logits)."""

    def __init__(self, in_features: int, classes: int):
        super().__init__()
        self.fc = nn.Linear(in_features, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(x, 1))


class DeviceSegment(nn.Module):
    """What one end device runs: image (B, 3, H, W) → (scores (B, C), features (B, F, h, w)).

    Optional float stem blocks (``cfg.device.stem``) come first; the last block's activation is
    what travels: the sign (binary), a few-bit quantizer, or ReLU (float16), per
    ``cfg.device.codec``. The device exit reads the last block before that activation through
    a ReLU (``cfg.device.exit_float``) or the features themselves, average-pooled to
    ``cfg.device.exit_pool`` squared cells first when that is set (a small head: the device
    segment must stay under 16 KB).
    """

    def __init__(self, cfg: DDNNConfig, classes: int, height: int, width: int):
        super().__init__()
        stem, c = [], 3
        for f in cfg.device.stem:
            stem.append(ConvP(c, f, cfg.device.binary, binary_act=False, convs=cfg.device.convs))
            c = f
        self.stem = nn.Sequential(*stem)
        self.block = ConvP(c, cfg.device.filters, cfg.device.binary, binary_act=False)
        self.block.act = nn.Identity()
        self.act = Quantize(cfg.device.bits) if cfg.device.bits else nn.ReLU()
        self.exit_float = cfg.device.exit_float
        n = len(stem) + 1
        h, w = _pooled(height, n), _pooled(width, n)
        self.pool, h, w = _cells(cfg.device.exit_pool, h, w)
        self.exit = ExitHead(cfg.device.filters * h * w, classes)
        self.log_probs = cfg.device.scores == "logprobs"
        # The detail a device keeps for an escalated frame (cfg.escalation.detail): its view at
        # reduced resolution, or its last stem block before the ReLU; few-bit levels where
        # cfg.escalation.bits < 8 (int8 otherwise, see int8_roundtrip).
        self.escalate = cfg.escalation.detail
        self.reduce = nn.AvgPool2d(cfg.escalation.pool) if cfg.escalation.detail == "view" else None
        self.detail_act = (Quantize(cfg.escalation.bits)
                           if cfg.escalation.detail != "none" and cfg.escalation.bits < 8 else None)

    def outputs(self, image: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(scores, features, detail): detail is None where the network does not escalate."""
        # Centre the [0, 1] pixels: ±1 weights on all-positive inputs mostly measure brightness.
        x = image * 2.0 - 1.0
        detail = self.reduce(x) if self.reduce is not None else None
        if self.escalate == "stem":
            last = self.stem[-1]
            detail = last.bn(last.pool(last.conv(self.stem[:-1](x))))
            h = last.act(detail)
        else:
            h = self.stem(x)
        z = self.block(h)
        features = self.act(z)
        scores = self.exit(self.pool(torch.relu(z) if self.exit_float else features))
        if self.log_probs:
            scores = torch.log_softmax(scores, dim=-1)
        if detail is not None and self.detail_act is not None:
            detail = self.detail_act(detail)
        return scores, features, detail

    def forward(self, image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores, features, _ = self.outputs(image)
        return scores, features


class LocalHead(nn.Module):
    """The local exit's layer after concatenating device scores (CC only; MP/AP need none)."""

    def __init__(self, views: int, classes: int):
        super().__init__()
        self.fc = nn.Linear(views * classes, classes)

    def forward(self, scores: torch.Tensor) -> torch.Tensor:
        return self.fc(scores)


class EdgeSegment(nn.Module):
    """Aggregated device features → (edge scores, edge features for the cloud).

    ``per_view`` (concatenated device features only): the edge block runs on each view's slot
    with shared weights and the results are pooled over the present views by their maximum
    (with ``edge_view_pool`` maxmean, their mean beside it); a slot of zeros is an absent view,
    since the device codecs never send all zeros. Views are so fused after a layer of their
    own, not pixel by pixel across unaligned viewpoints.
    """

    def __init__(self, cfg: DDNNConfig, c_in: int, classes: int, h: int, w: int,
                 views: int = 1, per_view: bool = False):
        super().__init__()
        binary = cfg.edge.codec == "binary"
        self.views = views if per_view else 0
        c_block = c_in // views if per_view else c_in
        self.block = ConvP(c_block, cfg.edge.filters, binary_weights=False, binary_act=binary)
        self.mean = per_view and cfg.edge.view_pool == "maxmean"
        self.out_channels = cfg.edge.filters * (2 if self.mean else 1)  # the cloud's input
        self.exit = ExitHead(self.out_channels * _pooled(h, 1) * _pooled(w, 1), classes)

    def forward(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.views:
            out = self.block(features)
            return self.exit(out), out
        b, _, h, w = features.shape
        x = features.reshape(b * self.views, -1, h, w)
        present = x.abs().flatten(1).amax(dim=1).reshape(b, self.views) > 0
        y = self.block(x)
        y = y.reshape(b, self.views, *y.shape[1:])
        mask = present.reshape(b, self.views, 1, 1, 1)
        out = torch.where(mask, y, torch.full_like(y, -1e4)).amax(dim=1)
        out = torch.where(present.any(dim=1).reshape(b, 1, 1, 1), out, torch.zeros_like(out))
        if self.mean:
            count = present.sum(dim=1).clamp(min=1).reshape(b, 1, 1, 1)
            mean = torch.where(mask, y, torch.zeros_like(y)).sum(dim=1) / count
            out = torch.cat([out, mean], dim=1)
        return self.exit(out), out


class CloudSegment(nn.Module):
    """Edge features → cloud scores, through the deep blocks."""

    def __init__(self, cfg: DDNNConfig, c_in: int, classes: int, h: int, w: int):
        super().__init__()
        blocks, c = [], c_in
        for f in cfg.cloud.filters:
            blocks.append(ConvP(c, f, binary_weights=False, binary_act=False))
            c = f
        self.blocks = nn.Sequential(*blocks)
        n = len(cfg.cloud.filters)
        self.exit = ExitHead(c * _pooled(h, n) * _pooled(w, n), classes)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.exit(self.blocks(features))


def int8_roundtrip(x: torch.Tensor) -> torch.Tensor:
    """What ``ddnn.codec``'s int8 delivers of each sample of ``x``: one scale per sample (its
    peak / 127), values rounded to the nearest of 255 levels; the gradient passes straight."""
    peak = x.detach().abs().flatten(1).amax(1).float()
    scale = (peak / 127.0).clamp(min=torch.finfo(torch.float32).tiny)
    scale = scale.reshape(-1, *([1] * (x.dim() - 1)))
    hard = torch.clamp(torch.round(x.detach() / scale), -127, 127) * scale
    return x + (hard - x).detach()


def surest_views(detail: torch.Tensor, scores: torch.Tensor, present: torch.Tensor, k: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The details of the ``k`` present views whose devices are surest (lowest entropy of
    their scores; ties to the lower view index), in that order, and which of the ``k`` slots
    hold one: torch twin of :func:`ddnn.hierarchy.surest_views`."""
    logp = torch.log_softmax(scores.detach().float(), dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    entropy = torch.where(present, entropy, torch.full_like(entropy, float("inf")))
    order = torch.sort(entropy, dim=1, stable=True).indices[:, :k]
    picked = detail.gather(1, order.reshape(*order.shape, *([1] * (detail.dim() - 2)))
                           .expand(-1, -1, *detail.shape[2:]))
    return picked, present.gather(1, order)


def detail_shape(cfg: DDNNConfig, height: int, width: int) -> tuple[int, int, int]:
    """The per-view shape of what a device sends for an escalated frame."""
    if cfg.escalation.detail == "view":
        return 3, height // cfg.escalation.pool, width // cfg.escalation.pool
    n = len(cfg.device.stem)
    return cfg.device.stem[-1], _pooled(height, n), _pooled(width, n)


class EscalatedCloud(nn.Module):
    """The cloud exit of an escalated frame: edge features and every present camera's detail
    (its view at reduced resolution, or its stem's activations) → scores.

    The edge features go through the cloud's own blocks (shared with :class:`CloudSegment`);
    the details through a float CNN (``cfg.escalation.widths``) fused by their maximum over the
    present views (a slot of zeros is an absent view); one linear layer reads both.
    """

    def __init__(self, cfg: DDNNConfig, cloud: CloudSegment, views: int, classes: int,
                 detail: tuple[int, int, int]):
        super().__init__()
        self.views, self.detail = views, detail
        self.blocks = cloud.blocks
        self.trunk = ViewTrunk(cfg.escalation.widths, in_channels=detail[0], centre=False)
        self.head = nn.Linear(self.trunk.dim + cloud.exit.fc.in_features, classes)

    def forward(self, edge_features: torch.Tensor, device_detail: torch.Tensor) -> torch.Tensor:
        """edge_features (B, F, h, w), device_detail (B, V * c, r, r) → scores (B, C)."""
        b = device_detail.shape[0]
        detail = device_detail.reshape(b, self.views, *self.detail)
        present = detail.flatten(2).abs().amax(2) > 0
        seen = max_over_views(self.trunk(detail, present), present)
        return self.head(torch.cat([seen, torch.flatten(self.blocks(edge_features), 1)], 1))


def aggregate(x: torch.Tensor, present: torch.Tensor, op: str) -> torch.Tensor:
    """Torch twin of :func:`ddnn.aggregation.aggregate`, differentiable; a test keeps them equal."""
    mask = present.reshape(present.shape + (1,) * (x.dim() - 2))
    if op == "concat":
        filled = torch.where(mask, x, torch.zeros_like(x))
        return filled.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])
    if op == "max":
        out = torch.where(mask, x, torch.full_like(x, float("-inf"))).amax(dim=1)
        return torch.where(torch.isfinite(out), out, torch.zeros_like(out))
    count = present.sum(dim=1).clamp(min=1).reshape((-1,) + (1,) * (x.dim() - 2))
    return torch.where(mask, x, torch.zeros_like(x)).sum(dim=1) / count


class DDNN(nn.Module):
    """The whole distributed network, trained jointly; see the module docstring."""

    def __init__(self, cfg: DDNNConfig, views: int, classes: int, height: int, width: int):
        super().__init__()
        self.cfg = cfg
        self.views, self.classes = views, classes
        self.local_op, self.edge_op = cfg.aggregation
        if cfg.device.shared:
            shared = DeviceSegment(cfg, classes, height, width)
            self.devices = nn.ModuleList([shared] * views)
        else:
            self.devices = nn.ModuleList(
                DeviceSegment(cfg, classes, height, width) for _ in range(views)
            )
        self.local = LocalHead(views, classes) if self.local_op == "concat" else None
        blocks = len(cfg.device.stem) + 1
        h, w = _pooled(height, blocks), _pooled(width, blocks)
        c_edge = cfg.device.filters * (views if self.edge_op == "concat" else 1)
        per_view = cfg.edge.per_view and self.edge_op == "concat"
        self.edge = EdgeSegment(cfg, c_edge, classes, h, w, views, per_view)
        self.cloud = CloudSegment(cfg, self.edge.out_channels, classes, _pooled(h, 1),
                                  _pooled(w, 1))
        self.escalated = None
        # Details come from the k surest present views (0: from every one).
        self.detail_slots = min(cfg.escalation.views, views)
        if cfg.escalation.detail != "none":
            detail = detail_shape(cfg, height, width)
            self.escalated = EscalatedCloud(cfg, self.cloud, self.detail_slots or views, classes,
                                            detail)

    @staticmethod
    def _present_outputs(dev: DeviceSegment, images: torch.Tensor, present: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """One view's device outputs (scores, features, detail) for the batch, zeros in an
        absent row's slots, as the live tiers leave them (``ddnn.runtime``). ``present`` is the
        view's column on the CPU. Only the present rows go through the device: an absent camera
        runs nothing, so it costs a training step no work (about a third of the views with view
        dropout) and its blank image stays out of the device's batch-norm statistics."""
        rows = present.nonzero().squeeze(1)
        if len(rows) == len(images):
            return dev.outputs(images)
        if len(rows) < 2:
            # The whole batch, its absent rows zeroed: batch norm cannot train on one image
            # (a 1x1 map of a small view), and every weight keeps a gradient, zero or not,
            # which DistributedDataParallel requires of each process.
            keep = present.to(images.device)
            return tuple(None if t is None else
                         t * keep.reshape(-1, *[1] * (t.dim() - 1)).to(t.dtype)
                         for t in dev.outputs(images))  # type: ignore[return-value]
        rows = rows.to(images.device)
        return tuple(None if t is None else t.new_zeros(len(images), *t.shape[1:])
                     .index_copy(0, rows, t)
                     for t in dev.outputs(images[rows]))  # type: ignore[return-value]

    def local_exit(self, dev_scores: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
        """The local exit's scores (B, C) from the devices' (B, V, C) of the present views."""
        local = aggregate(dev_scores, present, self.local_op)
        return self.local(local) if self.local is not None else local

    def edge_exit(self, dev_feats: torch.Tensor, present: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """The edge exit's scores (B, C) and the features it sends the cloud, from the devices'
        features (B, V, F, h, w) of the present views."""
        return self.edge(aggregate(dev_feats, present, self.edge_op))

    def forward(self, x: torch.Tensor, present: torch.Tensor) -> dict[str, torch.Tensor]:
        """x (B, V, 3, H, W), present (B, V) bool → logits of every exit.

        ``device`` is (B, V, C), zeros in an absent view's slot; ``local``, ``edge``,
        ``cloud`` and, when the network escalates, ``escalated`` (the cloud's answer with the
        reduced views) are (B, C).
        """
        on_cpu = present.cpu()  # one copy, not a device sync a view
        outs = [self._present_outputs(dev, x[:, i], on_cpu[:, i])
                for i, dev in enumerate(self.devices)]
        dev_scores = torch.stack([o[0] for o in outs], dim=1)
        dev_feats = torch.stack([o[1] for o in outs], dim=1)
        local = self.local_exit(dev_scores, present)
        edge_scores, edge_feats = self.edge_exit(dev_feats, present)
        out = {"device": dev_scores, "local": local, "edge": edge_scores,
               "cloud": self.cloud(edge_feats)}
        if self.escalated is not None:
            b, v = present.shape
            detail = torch.stack([o[2] for o in outs], 1).flatten(0, 1)
            if self.cfg.escalation.bits == 8:  # few-bit details are exact levels already
                detail = int8_roundtrip(detail)
            detail = detail.reshape(b, v, *detail.shape[1:])
            if self.detail_slots:
                detail, present = surest_views(detail, dev_scores, present, self.detail_slots)
            out["escalated"] = self.escalated(edge_feats, aggregate(detail, present, "concat"))
        return out
