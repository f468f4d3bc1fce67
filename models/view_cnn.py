"""A float CNN on camera views: the raw-offload reference's trunk and the escalated cloud's.

Each present view goes through the same trunk of double-conv blocks (two 3x3 conv, batch norm,
ReLU, then a 2x2 max-pool) and global average pooling; the views' embeddings are fused by their
maximum over the present views, as the edge fuses the device features.
"""

from __future__ import annotations

import torch
from torch import nn


def double_conv(c_in: int, c_out: int) -> nn.Sequential:
    """Two 3x3 conv-BN-ReLU layers, then a 2x2 max-pool (a 1-pixel map stays 1 pixel)."""
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(),
        nn.Conv2d(c_out, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(),
        nn.MaxPool2d(2, ceil_mode=True),
    )


class ViewTrunk(nn.Module):
    """One view's CNN: double-conv blocks of ``widths`` filters, then global average pooling.

    In training it runs on the present views only (gathered): absent all-zero images cost
    nothing and do not skew batch norm. In evaluation (and in ONNX) it runs on every slot, as
    batch norm then treats each image alone; an absent view's embedding is ignored by the
    fusion either way.
    """

    def __init__(self, widths: tuple[int, ...] = (32, 64, 128), in_channels: int = 3,
                 centre: bool = True):
        super().__init__()
        self.centre = centre  # inputs are [0, 1] pixels, to be centred (else already centred)
        blocks, c = [], in_channels
        for w in widths:
            blocks.append(double_conv(c, w))
            c = w
        self.body = nn.Sequential(*blocks, nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.dim, self.widths = c, tuple(widths)

    def forward(self, x: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
        """x (B, V, c, H, W), present (B, V) → embeddings (B, V, dim)."""
        b, v = present.shape
        flat = x.reshape(b * v, *x.shape[2:])
        if self.centre:
            flat = flat * 2.0 - 1.0
        if not self.training:
            return self.body(flat).reshape(b, v, self.dim)
        rows = torch.nonzero(present.reshape(-1)).reshape(-1)
        emb = self.body(flat.index_select(0, rows))
        out = torch.zeros(b * v, self.dim, dtype=emb.dtype, device=emb.device)
        return out.index_copy(0, rows, emb).reshape(b, v, self.dim)


def max_over_views(emb: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
    """(B, V, D) → (B, D): the maximum over the present views (zeros where none is)."""
    top = torch.where(present[..., None], emb, torch.full_like(emb, -1e4)).amax(1)
    return torch.where(present.any(1, keepdim=True), top, torch.zeros_like(top))
