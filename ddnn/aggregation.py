"""Aggregation of per-view tensors over the views that are present (DDNN §III-B).

A tensor of shape ``(B, V, ...)`` with a presence mask ``(B, V)`` becomes one tensor per sample:

* ``max`` (MP): element-wise maximum over the present views;
* ``avg`` (AP): element-wise mean over the present views;
* ``concat`` (CC): the views stacked along the first feature axis, absent views zero-filled, so the
  layer after it sees every view in a fixed slot: ``(B, V, C, ...)`` → ``(B, V·C, ...)``.

A sample with no view present aggregates to zeros (MP, AP) — the caller decides what that means.
The torch implementation in ``models.network`` mirrors this one; a test holds them equal.
"""

from __future__ import annotations

import numpy as np

from ddnn.errors import ConfigError

AGGREGATIONS = ("max", "avg", "concat")

# The paper's names for the schemes: local aggregator - edge aggregator.
SCHEMES = {
    "MP": ("max", "max"),
    "AP": ("avg", "avg"),
    "CC": ("concat", "concat"),
    "MP-CC": ("max", "concat"),
    "AP-CC": ("avg", "concat"),
    "MP-AP": ("max", "avg"),
    "AP-MP": ("avg", "max"),
    "CC-MP": ("concat", "max"),
    "CC-AP": ("concat", "avg"),
}


def parse_scheme(scheme: str) -> tuple[str, str]:
    """Map a scheme name such as ``MP-CC`` to its (local, edge) aggregations."""
    key = scheme.upper()
    if key not in SCHEMES:
        raise ConfigError(f"unknown aggregation scheme {scheme!r}; choose from {sorted(SCHEMES)}")
    return SCHEMES[key]


def aggregated_channels(op: str, views: int, channels: int) -> int:
    """Channel count after aggregating ``views`` tensors of ``channels`` channels."""
    return views * channels if op == "concat" else channels


def aggregate(x: np.ndarray, present: np.ndarray, op: str) -> np.ndarray:
    """Aggregate ``x`` of shape ``(B, V, ...)`` over its present views (mask ``(B, V)``)."""
    if op not in AGGREGATIONS:
        raise ConfigError(f"unknown aggregation {op!r}; choose from {AGGREGATIONS}")
    x = np.asarray(x, dtype=np.float32)
    present = np.asarray(present, dtype=bool)
    if x.ndim < 3 or present.shape != x.shape[:2]:
        raise ConfigError(
            f"aggregate expects x (B, V, C, ...) and present (B, V); got {x.shape} and "
            f"{present.shape}"
        )
    mask = present.reshape(present.shape + (1,) * (x.ndim - 2))
    if op == "concat":
        filled = np.where(mask, x, 0.0).astype(np.float32)
        return filled.reshape((x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:]))
    if op == "max":
        out = np.where(mask, x, -np.inf).max(axis=1)
        return np.where(np.isfinite(out), out, 0.0).astype(np.float32)
    count = np.maximum(present.sum(axis=1), 1).reshape((-1,) + (1,) * (x.ndim - 2))
    return (np.where(mask, x, 0.0).sum(axis=1) / count).astype(np.float32)
