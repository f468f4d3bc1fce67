"""Calibration of the exit thresholds from the sites' held-out data, without the data.

``models.calibrate`` picks (T_local, T_edge) from per-sample logits. Its objective is built
from sums over samples only (how many exit locally, how many at the edge, how many are right),
so each site computes those sums for every threshold pair of the grid on its own held-out
split (:func:`exit_counts`), the server adds the sites' tables and takes the same decision
(:func:`calibrate_counts`): the thresholds a central calibration on the union of the held-out
splits would choose, while neither samples nor logits leave a site. Numpy only.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from ddnn.exits import entropy_of_logits
from ddnn.models.calibrate import Calibration

COUNT_NAMES = ("samples", "cloud_correct", "local_exits", "edge_exits", "correct")


def exit_counts(exits: Mapping[str, np.ndarray], labels: np.ndarray,
                grid: int = 201) -> dict[str, np.ndarray]:
    """One site's sums over its held-out samples for every (T_local, T_edge) of the grid.

    ``local_exits[i]``: samples with local entropy < T_i; ``edge_exits[i, j]``: of the others,
    those with edge entropy < T_j; ``correct[i, j]``: right answers of the hierarchy at (T_i, T_j).
    """
    ts = np.linspace(0.0, 1.0, grid)
    correct = {k: exits[k].argmax(-1) == labels for k in ("local", "edge", "cloud")}
    h_local, h_edge = entropy_of_logits(exits["local"]), entropy_of_logits(exits["edge"])
    loc = h_local[None, :] < ts[:, None]  # (T_local, N)
    edge_ok = h_edge[None, :] < ts[:, None]  # (T_edge, N)
    n_loc = loc.sum(1)
    # Integer matrix products: (T_local, N) x (N, T_edge) sums over samples exactly.
    not_loc = (~loc).astype(np.int64)
    n_edge = not_loc @ edge_ok.T.astype(np.int64)
    right = (loc & correct["local"]).sum(1)[:, None]
    right = right + not_loc @ (edge_ok & correct["edge"]).T.astype(np.int64)
    right = right + not_loc @ (~edge_ok & correct["cloud"]).T.astype(np.int64)
    return {
        "samples": np.array([len(labels)], dtype=np.int64),
        "cloud_correct": np.array([int(correct["cloud"].sum())], dtype=np.int64),
        "local_exits": n_loc.astype(np.int64),
        "edge_exits": n_edge.astype(np.int64),
        "correct": right.astype(np.int64),
    }


def add_counts(tables: Iterable[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The sum of several sites' tables (same grid)."""
    total: dict[str, np.ndarray] = {}
    for t in tables:
        for k in COUNT_NAMES:
            total[k] = total[k] + t[k] if k in total else np.asarray(t[k], dtype=np.int64)
    return total


def calibrate_counts(counts: Mapping[str, np.ndarray], tolerance: float = 0.0) -> Calibration:
    """``models.calibrate.calibrate``'s choice, from summed tables instead of logits."""
    n = int(counts["samples"][0])
    if n < 1:
        raise ValueError("no held-out samples to calibrate on")
    n_loc = counts["local_exits"].astype(np.int64)
    n_edge, right = counts["edge_exits"].astype(np.int64), counts["correct"].astype(np.int64)
    grid = len(n_loc)
    ts = np.linspace(0.0, 1.0, grid)
    cloud_acc = float(counts["cloud_correct"][0]) / n
    floor = cloud_acc - tolerance - 1e-12
    base = n + 1  # one more exit outweighs any number of the next key, as in calibrate()
    key = (n_loc[:, None] * base + n_edge) * base + right
    score = np.where(right / n >= floor, key, -1)
    i, j = np.unravel_index(int(np.argmax(score)), score.shape)
    f_loc, f_edge = float(n_loc[i]) / n, float(n_edge[i, j]) / n
    return Calibration(
        local=float(ts[i]),
        edge=float(ts[j]),
        accuracy=float(right[i, j]) / n,
        cloud_accuracy=cloud_acc,
        exit_fraction={"local": f_loc, "edge": f_edge, "cloud": 1.0 - f_loc - f_edge},
        tolerance=tolerance,
        samples=n,
    )
