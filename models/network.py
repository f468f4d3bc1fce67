"""The DDNN: one network with four kinds of exits, split into device, edge and cloud segments.

Per view, a device segment (the paper's ConvP block: conv → max-pool → batch norm → sign, with
binarized weights) produces binary features and a device exit. The local exit aggregates the
device scores over the present views; the edge segment aggregates the device features, runs one
more ConvP block and its exit; the cloud segment runs the deep blocks and the final exit.
The same modules are exported one by one to ONNX (``models.export``).
"""

from __future__ import annotations

import torch
from torch import nn

from ddnn.models.config import DDNNConfig


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


class BinaryConv2d(nn.Conv2d):
    """A 3×3 convolution whose weights are binarized to ±1 in the forward pass (eBNN)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        hard = torch.where(w >= 0, torch.ones_like(w), -torch.ones_like(w))
        wb = w + (hard - w).detach() if self.training else hard
        return self._conv_forward(x, wb, self.bias)


class ConvP(nn.Module):
    """The paper's ConvP block: conv 3×3 → max-pool 3×3/2 → batch norm → activation."""

    def __init__(self, c_in: int, c_out: int, binary_weights: bool, binary_act: bool):
        super().__init__()
        conv = BinaryConv2d if binary_weights else nn.Conv2d
        self.conv = conv(c_in, c_out, kernel_size=3, padding=1, bias=False)
        self.pool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.bn = nn.BatchNorm2d(c_out)
        self.act = BinarySign() if binary_act else nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.bn(self.pool(self.conv(x))))


def _pooled(size: int, blocks: int) -> int:
    for _ in range(blocks):
        size = (size - 1) // 2 + 1  # MaxPool2d(3, stride 2, padding 1)
    return size


class ExitHead(nn.Module):
    """An exit: features flattened → linear classifier (logits)."""

    def __init__(self, in_features: int, classes: int):
        super().__init__()
        self.fc = nn.Linear(in_features, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(x, 1))


class DeviceSegment(nn.Module):
    """What one end device runs: image (B, 3, H, W) → (scores (B, C), features (B, F, h, w))."""

    def __init__(self, cfg: DDNNConfig, classes: int, height: int, width: int):
        super().__init__()
        self.block = ConvP(3, cfg.device_filters, cfg.device_binary, cfg.device_binary)
        h, w = _pooled(height, 1), _pooled(width, 1)
        self.exit = ExitHead(cfg.device_filters * h * w, classes)

    def forward(self, image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Centre the [0, 1] pixels: ±1 weights on all-positive inputs mostly measure brightness.
        features = self.block(image * 2.0 - 1.0)
        return self.exit(features), features


class LocalHead(nn.Module):
    """The local exit's layer after concatenating device scores (CC only; MP/AP need none)."""

    def __init__(self, views: int, classes: int):
        super().__init__()
        self.fc = nn.Linear(views * classes, classes)

    def forward(self, scores: torch.Tensor) -> torch.Tensor:
        return self.fc(scores)


class EdgeSegment(nn.Module):
    """Aggregated device features → (edge scores, edge features for the cloud)."""

    def __init__(self, cfg: DDNNConfig, c_in: int, classes: int, h: int, w: int):
        super().__init__()
        binary = cfg.edge_codec == "binary"
        self.block = ConvP(c_in, cfg.edge_filters, binary_weights=False, binary_act=binary)
        self.exit = ExitHead(cfg.edge_filters * _pooled(h, 1) * _pooled(w, 1), classes)

    def forward(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.block(features)
        return self.exit(out), out


class CloudSegment(nn.Module):
    """Edge features → cloud scores, through the deep blocks."""

    def __init__(self, cfg: DDNNConfig, c_in: int, classes: int, h: int, w: int):
        super().__init__()
        blocks, c = [], c_in
        for f in cfg.cloud_filters:
            blocks.append(ConvP(c, f, binary_weights=False, binary_act=False))
            c = f
        self.blocks = nn.Sequential(*blocks)
        n = len(cfg.cloud_filters)
        self.exit = ExitHead(c * _pooled(h, n) * _pooled(w, n), classes)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.exit(self.blocks(features))


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
        if cfg.share_device_weights:
            shared = DeviceSegment(cfg, classes, height, width)
            self.devices = nn.ModuleList([shared] * views)
        else:
            self.devices = nn.ModuleList(
                DeviceSegment(cfg, classes, height, width) for _ in range(views)
            )
        self.local = LocalHead(views, classes) if self.local_op == "concat" else None
        h, w = _pooled(height, 1), _pooled(width, 1)
        c_edge = cfg.device_filters * (views if self.edge_op == "concat" else 1)
        self.edge = EdgeSegment(cfg, c_edge, classes, h, w)
        self.cloud = CloudSegment(cfg, cfg.edge_filters, classes, _pooled(h, 1), _pooled(w, 1))

    def forward(self, x: torch.Tensor, present: torch.Tensor) -> dict[str, torch.Tensor]:
        """x (B, V, 3, H, W), present (B, V) bool → logits of every exit.

        ``device`` is (B, V, C); ``local``, ``edge`` and ``cloud`` are (B, C).
        """
        outs = [dev(x[:, i]) for i, dev in enumerate(self.devices)]
        dev_scores = torch.stack([s for s, _ in outs], dim=1)
        dev_feats = torch.stack([f for _, f in outs], dim=1)
        local = aggregate(dev_scores, present, self.local_op)
        if self.local is not None:
            local = self.local(local)
        edge_scores, edge_feats = self.edge(aggregate(dev_feats, present, self.edge_op))
        return {
            "device": dev_scores,
            "local": local,
            "edge": edge_scores,
            "cloud": self.cloud(edge_feats),
        }
