"""``ddnn data inspect``: counts and a contact sheet of a few samples per class.

The sheet is one row per sample (a few per class, the class name at the left) and one column
per view; an absent view is a dark tile with a cross. Pillow only: no torch, no matplotlib.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ddnn.dataset import MultiViewDataset

_LABEL_WIDTH = 80
_GAP = 2


def pick_samples(ds: MultiViewDataset, per_class: int, seed: int = 0) -> list[int]:
    """Up to ``per_class`` sample indices of each class, in class order, the same for a seed."""
    rng = np.random.default_rng(seed)
    rows: list[int] = []
    for c in range(len(ds.classes)):
        idx = np.flatnonzero(ds.label == c)
        rows.extend(int(i) for i in sorted(rng.permutation(idx)[:per_class]))
    return rows


def contact_sheet(ds: MultiViewDataset, per_class: int = 4, tile: int = 64, seed: int = 0):
    """A PIL image: rows of samples (``per_class`` per class), one column per view."""
    from PIL import Image, ImageDraw

    rows = pick_samples(ds, per_class, seed)
    v = ds.num_views
    width = _LABEL_WIDTH + v * (tile + _GAP)
    sheet = Image.new("RGB", (width, max(1, len(rows)) * (tile + _GAP)), (255, 255, 255))
    draw = ImageDraw.Draw(sheet)
    for r, i in enumerate(rows):
        top = r * (tile + _GAP)
        draw.text((4, top + tile // 2 - 6), f"{ds.classes[ds.label[i]]}"[:12], fill=(0, 0, 0))
        images = ds.images(slice(i, i + 1))[0]  # (V, 3, H, W) float in [0, 1]
        for j in range(v):
            left = _LABEL_WIDTH + j * (tile + _GAP)
            if not ds.present[i, j]:
                draw.rectangle([left, top, left + tile - 1, top + tile - 1], fill=(60, 60, 60))
                draw.line([left, top, left + tile - 1, top + tile - 1], fill=(150, 150, 150))
                draw.line([left, top + tile - 1, left + tile - 1, top], fill=(150, 150, 150))
                continue
            pixels = np.round(images[j].transpose(1, 2, 0) * 255).astype(np.uint8)
            img = Image.fromarray(pixels).resize((tile, tile), Image.Resampling.NEAREST)
            sheet.paste(img, (left, top))
    return sheet


def summary(ds: MultiViewDataset) -> list[str]:
    """Lines of counts: samples, views, classes with their sizes, present views."""
    present = ds.present
    counts = np.bincount(ds.label, minlength=len(ds.classes))
    per_view = " ".join(f"{p:.2f}" for p in present.mean(0))
    return [
        f"{ds.num_samples} samples, {ds.num_views} views of {ds.image_shape}"
        + (" (uint8, memory-mapped)" if ds.lazy else ""),
        "classes: " + ", ".join(f"{c} ({n})" for c, n in zip(ds.classes, counts, strict=True)),
        f"present views per sample: mean {present.sum(1).mean():.2f}, min {present.sum(1).min()}"
        f"; per view: {per_view}",
    ]


def write_sheet(ds: MultiViewDataset, out: str | Path, per_class: int = 4) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    contact_sheet(ds, per_class).save(out)
    return out
