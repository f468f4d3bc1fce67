"""Training-time augmentation of multi-view batches: shift, brightness, view dropout.

Only present views change; an absent view stays all zeros. View dropout hides a present view
(and its image) with some probability, keeping at least one per sample, so the exits learn to
answer with cameras missing, as the live hierarchy must.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F


def augment(
    x: torch.Tensor, present: torch.Tensor, shift: float, brightness: float, dropout: float,
    gen: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x (B, V, 3, H, W), present (B, V) → augmented copies."""
    b, v = present.shape
    flat = x.reshape(b * v, *x.shape[2:])
    if shift > 0:
        offset = (torch.rand(b * v, 2, generator=gen) * 2 - 1) * (2 * shift)  # grid units
        theta = torch.zeros(b * v, 2, 3)
        theta[:, 0, 0] = theta[:, 1, 1] = 1.0
        theta[:, :, 2] = offset
        grid = F.affine_grid(theta.to(x.device), list(flat.shape), align_corners=False)
        flat = F.grid_sample(flat, grid, mode="bilinear", padding_mode="border",
                             align_corners=False)
    if brightness > 0:
        scale = 1 + (torch.rand(b * v, 1, 1, 1, generator=gen) * 2 - 1) * brightness
        flat = (flat * scale.to(x.device)).clamp(0.0, 1.0)
    if dropout > 0:
        drop = (torch.rand(b, v, generator=gen) < dropout).to(present.device) & present
        keep_one = (present & ~drop).any(dim=1, keepdim=True)
        present = present & (~drop | ~keep_one)  # a sample losing every view keeps them all
    mask = present.reshape(b, v, 1, 1, 1)
    out = flat.reshape(x.shape)
    return torch.where(mask, out, torch.zeros_like(out)), present
