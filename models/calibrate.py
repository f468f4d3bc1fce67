"""Calibration: the exit thresholds and escalation level, picked on held-out data from the
operating curve (``ddnn.operating_curve``) by the user's budget.

* an accuracy ``tolerance`` (the default, 0): the cheapest point (fewest uplink bytes per frame;
  then the most local exits, the most edge exits, the highest accuracy) whose accuracy is at least
  the best single tier's minus the tolerance, and whose answers are the best tier's on at least
  ``agreement`` minus the tolerance of the frames (so that it does not merely tie with the best
  tier by luck on a few hundred frames). Sending every frame to the best tier always qualifies,
  so calibration never fails;
* a byte budget ``max_bytes`` per frame: the most accurate point within it.

The chosen point and the held-out curve both go into the manifest; ``ddnn evaluate --max-bytes``
re-picks from that curve, never from the data it reports on.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ddnn.exits import entropy_of_logits
from ddnn.hierarchy import UplinkCost, cloud_exit
from ddnn.operating_curve import (
    AGREEMENT,
    OperatingPoint,
    curve_table,
    frontier,
    pick_max_bytes,
    pick_tolerance,
)
from ddnn.operating_curve import sweep as sweep_grid
from ddnn.stacking import BELOW, Stacking, log_probs, stack

STACKING_GRID = 21  # weights tried per stacked exit, evenly spaced in [0, 1]
# How sure a stacked exit must be that it beats the answer below it, in standard deviations of
# a sign test's normal approximation. Chosen by fitting on one held-out split and checking on
# the other, both ways, for the tiers benchmark's 12 bundles: it cut the upper exits that came
# out under the one below from 8 of 24 fits to 4, for 0.05 points of the edge's mean gain
# (docs/training.md, "Stacked exits").
STACKING_Z = 1.645


@dataclass(frozen=True)
class Calibration:
    """The chosen operating point, the budget that chose it and the held-out curve."""

    point: OperatingPoint
    tolerance: float | None  # the budget: an accuracy tolerance ...
    max_bytes: float | None  # ... or bytes per frame
    best_tier_accuracy: float
    samples: int
    curve: dict[str, list]
    agreement: float = AGREEMENT  # with the tolerance: the share answered as the best tier

    @property
    def local(self) -> float:
        return self.point.local

    @property
    def edge(self) -> float:
        return self.point.edge

    @property
    def level(self) -> int:
        return self.point.level

    def to_dict(self) -> dict:
        if self.max_bytes is None:
            objective = ("fewest uplink bytes per frame (then most local, then most edge exits) "
                         "with accuracy >= the best tier's - tolerance and the best tier's "
                         "answers on >= agreement - tolerance of the frames, on held-out data")
            budget = {"tolerance": self.tolerance, "agreement": self.agreement}
        else:
            objective = "highest accuracy within max_bytes uplink bytes per frame, on held-out data"
            budget = {"max_bytes": self.max_bytes}
        return {
            "objective": objective,
            **budget,
            "thresholds": self.point.thresholds,
            "escalation_level": self.point.level,
            "samples": self.samples,
            "accuracy": self.point.accuracy,
            "best_tier_accuracy": self.best_tier_accuracy,
            "bytes_per_frame": self.point.bytes_per_frame,
            "exit_fraction": self.point.exit_fraction,
            "curve": self.curve,
        }


def calibrate(
    exits: dict[str, np.ndarray], labels: np.ndarray, present: np.ndarray, cost: UplinkCost,
    tolerance: float = 0.0, max_bytes: float | None = None, grid: int = 201,
    agreement: float = AGREEMENT,
) -> Calibration:
    """Pick thresholds and escalation level from held-out per-exit scores (module docstring)."""
    s = sweep_grid(exits, labels, present, cost, grid)
    point = (pick_tolerance(s, tolerance, agreement) if max_bytes is None
             else pick_max_bytes(s, max_bytes))
    return Calibration(point, None if max_bytes is not None else tolerance, max_bytes,
                       s.best_tier, len(labels), curve_table(frontier(s)), agreement)


def sweep(exits: dict[str, np.ndarray], labels: np.ndarray, grid: np.ndarray, edge_t: float,
          level: int = 0):
    """Accuracy and exit fractions over local thresholds ``grid``, the edge threshold and the
    escalation level fixed: the training report's and the paper tables' threshold plots."""
    correct = {k: exits[k].argmax(-1) == labels for k in ("local", "edge")}
    correct["cloud"] = cloud_exit(exits, level).argmax(-1) == labels
    h_local, h_edge = entropy_of_logits(exits["local"]), entropy_of_logits(exits["edge"])
    loc = h_local[None, :] < grid[:, None]  # (T, N)
    edg = ~loc & (h_edge < edge_t)[None, :]
    cld = ~loc & ~edg
    acc = (loc * correct["local"] + edg * correct["edge"] + cld * correct["cloud"]).mean(1)
    return {"accuracy": acc, "local": loc.mean(1), "edge": edg.mean(1), "cloud": cld.mean(1)}


def fit_stacking(exits: dict[str, np.ndarray], labels: np.ndarray, views: int,
                 grid: int = STACKING_GRID, z: float = STACKING_Z) -> Stacking:
    """Each upper exit's stacking weight (``ddnn.stacking``) from held-out per-exit scores,
    tier by tier up the hierarchy.

    A tier passes the answer below it up unchanged (weight 0) unless a weight's answer is
    better on the held-out frames by more than chance: of the frames on which the two answers
    differ in being right, it must right at least ``z`` standard deviations more than it
    wrongs (a one-sided sign test in its normal approximation, without continuity correction:
    on very few such frames it is looser than its nominal level, 3 righted and none wronged
    pass). A weight whose answers are right exactly where the answer below is right passes
    too: it changes no accuracy. Of the weights that pass, the one right most often wins, ties
    to the lower held-out log loss, then to the larger weight. So a tier rarely answers worse
    than the one below it on a few hundred frames' luck.

    A one-view bundle's edge answers on its own: its device decides the local exit alone and
    sends the edge no scores to stack on.
    """
    rows = np.arange(len(labels))
    stacked = {"local": exits["local"]}
    weights = {}
    for tier, below in BELOW.items():
        if tier not in exits:
            continue
        if tier == "edge" and views == 1:
            weights[tier], stacked[tier] = 1.0, log_probs(exits[tier])
            continue
        right_below = stacked[below].argmax(-1) == labels
        best = None
        for w in np.linspace(1.0, 0.0, grid):
            answer = stack(stacked[below], exits[tier], float(w))
            right = answer.argmax(-1) == labels
            fixed, broken = int((right & ~right_below).sum()), int((~right & right_below).sum())
            if w > 0 and fixed - broken < z * np.sqrt(fixed + broken):
                continue
            key = (int(right.sum()), float(log_probs(answer)[rows, labels].mean()))
            if best is None or key > best[0]:
                best = (key, round(float(w), 6), answer)
        assert best is not None  # weight 0 always qualifies
        _, weights[tier], stacked[tier] = best
    return Stacking(**weights)
