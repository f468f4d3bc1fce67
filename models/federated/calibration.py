"""Calibration of the exit thresholds from the sites' held-out data, without the data.

``models.calibrate`` picks a point of the operating curve (``ddnn.operating_curve``) from exact
counts over samples (frames that exit locally, at the edge, answered right, uplink bytes), so
each site computes those counts for every threshold pair of the grid on its own held-out split
(:func:`exit_counts`), the server adds the sites' tables and takes the same decision
(:func:`calibrate_counts`): the point a central calibration on the union of the held-out splits
would choose, while neither samples nor logits leave a site. Escalation level 0 only (the cloud
on the edge features): a federated bundle answers at level 0. Numpy only.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from ddnn.exits import entropy_of_logits
from ddnn.hierarchy import UplinkCost
from ddnn.models.calibrate import Calibration
from ddnn.operating_curve import Sweep, curve_table, frontier, pick_tolerance

COUNT_NAMES = ("samples", "seen", "views", "tier_correct", "local_exits", "edge_exits",
               "past_local_views", "correct")


def exit_counts(exits: Mapping[str, np.ndarray], labels: np.ndarray, present: np.ndarray,
                grid: int = 201) -> dict[str, np.ndarray]:
    """One site's sums over its held-out samples for every (T_local, T_edge) of the grid.

    Over the samples some view saw: ``local_exits[i]`` have local entropy < T_i, and their
    views ``past_local_views[i]`` the others; ``edge_exits[i, j]``: of the others, those with
    edge entropy < T_j; ``correct[i, j]``: right answers at (T_i, T_j); ``tier_correct``: right
    answers of the local, edge and cloud exit alone.
    """
    n_present = present.sum(axis=1).astype(np.int64)
    seen = n_present > 0
    n = n_present[seen]
    ts = np.linspace(0.0, 1.0, grid)
    correct = {k: (exits[k].argmax(-1) == labels)[seen] for k in ("local", "edge", "cloud")}
    h_local = entropy_of_logits(exits["local"])[seen]
    h_edge = entropy_of_logits(exits["edge"])[seen]
    loc = h_local[None, :] < ts[:, None]  # (T_local, N)
    edge_ok = h_edge[None, :] < ts[:, None]  # (T_edge, N)
    # Integer matrix products: (T_local, N) x (N, T_edge) sums over samples exactly.
    not_loc = (~loc).astype(np.int64)
    right = (loc & correct["local"]).sum(1)[:, None]
    right = right + not_loc @ (edge_ok & correct["edge"]).T.astype(np.int64)
    right = right + not_loc @ (~edge_ok & correct["cloud"]).T.astype(np.int64)
    return {
        "samples": np.array([len(labels)], dtype=np.int64),
        "seen": np.array([int(seen.sum())], dtype=np.int64),
        "views": np.array([int(n.sum())], dtype=np.int64),
        "tier_correct": np.array([int(correct[k].sum()) for k in ("local", "edge", "cloud")],
                                 dtype=np.int64),
        "local_exits": loc.sum(1).astype(np.int64),
        "edge_exits": (not_loc @ edge_ok.T.astype(np.int64)).astype(np.int64),
        "past_local_views": (not_loc @ n).astype(np.int64),
        "correct": right.astype(np.int64),
    }


def add_counts(tables: Iterable[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The sum of several sites' tables (same grid)."""
    total: dict[str, np.ndarray] = {}
    for t in tables:
        for k in COUNT_NAMES:
            total[k] = total[k] + t[k] if k in total else np.asarray(t[k], dtype=np.int64)
    return total


def calibrate_counts(counts: Mapping[str, np.ndarray], cost: UplinkCost,
                     tolerance: float = 0.0) -> Calibration:
    """``models.calibrate.calibrate``'s choice at level 0, from summed tables, not logits."""
    frames, seen = int(counts["samples"][0]), int(counts["seen"][0])
    if frames < 1:
        raise ValueError("no held-out samples to calibrate on")
    local = counts["local_exits"].astype(np.int64)
    edge = counts["edge_exits"].astype(np.int64)
    grid = len(local)
    payload = (int(counts["views"][0]) * cost.sent_scores
               + counts["past_local_views"].astype(np.int64)[:, None] * cost.features)
    s = Sweep(grid=np.linspace(0.0, 1.0, grid),
              correct=counts["correct"].astype(np.int64)[None],
              local=np.broadcast_to(local[:, None], (grid, grid))[None],
              edge=edge[None],
              payload=np.broadcast_to(payload, (grid, grid))[None],
              frames=frames, seen=seen,
              best_tier=float(counts["tier_correct"].max()) / max(seen, 1))
    point = pick_tolerance(s, tolerance)
    return Calibration(point, tolerance, None, s.best_tier, frames, curve_table(frontier(s)))
