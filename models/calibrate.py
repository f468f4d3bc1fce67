"""Calibration of the exit thresholds on held-out data.

Objective (documented in docs/training.md): among all (T_local, T_edge) on a grid over [0, 1],
keep those whose overall accuracy on the held-out split is at least the cloud exit's accuracy
minus ``tolerance``; of these, take the one with the most local exits, then the most edge exits,
then the highest accuracy. T = 0 for both is always admissible (everything goes to the cloud), so
calibration never fails; it only finds how much can safely leave early.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ddnn.exits import entropy_of_logits


@dataclass(frozen=True)
class Calibration:
    """Chosen thresholds and what they achieve on the held-out split."""

    local: float
    edge: float
    accuracy: float
    cloud_accuracy: float
    exit_fraction: dict[str, float]
    tolerance: float
    samples: int

    def to_dict(self) -> dict:
        return {
            "objective": "most local then edge exits with overall accuracy >= cloud accuracy - "
            "tolerance on held-out data",
            "thresholds": {"local": self.local, "edge": self.edge},
            "tolerance": self.tolerance,
            "samples": self.samples,
            "accuracy": self.accuracy,
            "cloud_accuracy": self.cloud_accuracy,
            "exit_fraction": self.exit_fraction,
        }


def sweep(exits: dict[str, np.ndarray], labels: np.ndarray, grid: np.ndarray, edge_t: float):
    """Accuracy and exit fractions over local thresholds ``grid``, the edge threshold fixed."""
    correct = {k: exits[k].argmax(-1) == labels for k in ("local", "edge", "cloud")}
    h_local, h_edge = entropy_of_logits(exits["local"]), entropy_of_logits(exits["edge"])
    loc = h_local[None, :] < grid[:, None]  # (T, N)
    edg = ~loc & (h_edge < edge_t)[None, :]
    cld = ~loc & ~edg
    acc = (loc * correct["local"] + edg * correct["edge"] + cld * correct["cloud"]).mean(1)
    return {"accuracy": acc, "local": loc.mean(1), "edge": edg.mean(1), "cloud": cld.mean(1)}


def calibrate(
    exits: dict[str, np.ndarray], labels: np.ndarray, tolerance: float = 0.0, grid: int = 201
) -> Calibration:
    """Choose (T_local, T_edge) per the module's objective from held-out logits."""
    correct = {k: exits[k].argmax(-1) == labels for k in ("local", "edge", "cloud")}
    h_local, h_edge = entropy_of_logits(exits["local"]), entropy_of_logits(exits["edge"])
    ts = np.linspace(0.0, 1.0, grid)
    cloud_acc = float(correct["cloud"].mean())
    floor = cloud_acc - tolerance - 1e-12
    n = len(labels)
    best = (-1, 0, 0, 0.0, 0.0, 0.0)  # (score, i, j, accuracy, local, edge); -1: none yet
    edg_all = h_edge[None, :] < ts[:, None]  # (T_edge, N)
    for i, t in enumerate(ts):
        loc = h_local < t  # (N,)
        edg = ~loc[None, :] & edg_all
        cld = ~loc[None, :] & ~edg
        acc = (loc & correct["local"]).mean() + (edg & correct["edge"]).mean(1)
        acc = acc + (cld & correct["cloud"]).mean(1)
        f_edg = edg.mean(1)
        # Lexicographic on exact counts: local exits first, then edge exits, then correct answers
        # (base n + 1 keeps one more exit worth more than any number of the next key).
        base = n + 1
        key = (int(loc.sum()) * base + edg.sum(1)) * base + np.rint(acc * n).astype(np.int64)
        score = np.where(acc >= floor, key, -1)  # int64: exact however large the set
        j = int(np.argmax(score))
        if score[j] > best[0]:
            best = (score[j], i, j, float(acc[j]), float(loc.mean()), float(f_edg[j]))
    _, i, j, accuracy, f_loc, f_edg = best
    return Calibration(
        local=float(ts[i]),
        edge=float(ts[j]),
        accuracy=accuracy,
        cloud_accuracy=cloud_acc,
        exit_fraction={
            "local": f_loc,
            "edge": f_edg,
            "cloud": 1.0 - f_loc - f_edg,
        },
        tolerance=tolerance,
        samples=len(labels),
    )
