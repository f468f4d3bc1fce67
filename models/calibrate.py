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
    curve,
    curve_table,
    pick_max_bytes,
    pick_tolerance,
)
from ddnn.operating_curve import sweep as sweep_grid
from ddnn.stacking import Stacking, log_probs, stack

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
                       s.best_tier, len(labels), curve_table(curve(s)), agreement)


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


STACKING_STATS = ("right", "fixed", "broken", "loglik")  # a stacking table's last axis


def _grid_weights(grid: int) -> np.ndarray:
    return np.linspace(1.0, 0.0, grid)  # the weights tried, the tier's own answer first


def _table(below: list[np.ndarray], own: np.ndarray, labels: np.ndarray,
           grid: int) -> np.ndarray:
    """(len(below), grid, 4): ``STACKING_STATS`` of ``own`` stacked on each answer below."""
    rows = np.arange(len(labels))
    lp_own = log_probs(own)
    out = np.zeros((len(below), grid, len(STACKING_STATS)))
    for i, b in enumerate(below):
        right_below = b.argmax(-1) == labels
        lp_below = log_probs(b)
        for j, w in enumerate(_grid_weights(grid)):
            w = float(w)  # float32 arithmetic, as ddnn.stacking.stack computes the answer
            answer = lp_own if w == 1.0 else ((1.0 - w) * lp_below + w * lp_own).astype(
                np.float32)
            right = answer.argmax(-1) == labels
            out[i, j] = (right.sum(), (right & ~right_below).sum(), (~right & right_below).sum(),
                         log_probs(answer)[rows, labels].astype(np.float64).sum())
    return out


def _pick(stats: np.ndarray, z: float) -> int:
    """The index of the weight the rule of :func:`fit_stacking` picks from one row of a table."""
    best = None
    for j, w in enumerate(_grid_weights(len(stats))):
        right, fixed, broken, loglik = stats[j]
        if w > 0 and fixed - broken < z * np.sqrt(fixed + broken):
            continue
        if best is None or (right, loglik) > best[0]:
            best = ((right, loglik), j)
    assert best is not None  # weight 0 always qualifies
    return best[1]


def stacking_tables(exits: dict[str, np.ndarray], labels: np.ndarray,
                    grid: int = STACKING_GRID) -> dict[str, np.ndarray]:
    """What :func:`fit_stacking` decides on, as sums over held-out frames that add up across
    data sets: federated learning refits the weights from its sites' summed tables.

    For each upper tier, an array (rows, ``grid``, 4): for every weight of the tier below
    (rows; the edge has one, the local exit below it has no weight) and every own weight
    (``np.linspace(1, 0, grid)``), the frames the stacked answer gets right, those it rights
    and those it wrongs against the answer below, and the sum of the labels' log
    probabilities (``STACKING_STATS``).
    """
    labels = np.asarray(labels)
    tables = {"edge": _table([exits["local"]], exits["edge"], labels, grid)}
    edges = [stack(exits["local"], exits["edge"], float(w)) for w in _grid_weights(grid)]
    for tier in ("cloud", "escalated"):
        if tier in exits:
            tables[tier] = _table(edges, exits[tier], labels, grid)
    return tables


def stacking_tables_problem(tables: dict[str, np.ndarray], samples: float,
                            tiers: set[str], grid: int = STACKING_GRID) -> str | None:
    """Why ``tables`` cannot be :func:`stacking_tables` of ``samples`` held-out frames for the
    upper ``tiers`` (None where they can): tables from another party are checked before they
    are added up. Counts must be whole numbers within the frames, log likelihoods at most 0,
    and in every row the answer below right as often whatever the own weight (right − fixed +
    broken is its count)."""
    if set(tables) != tiers:
        return f"tables for {sorted(tables)}, expected {sorted(tiers)}"
    for tier in sorted(tiers):
        t = np.asarray(tables[tier])
        shape = (1 if tier == "edge" else grid, grid, len(STACKING_STATS))
        if t.shape != shape:
            return f"{tier}: shape {list(t.shape)}, expected {list(shape)}"
        if t.dtype.kind not in "iuf":
            return f"{tier}: {t.dtype} values, expected numbers"
        t = t.astype(np.float64)
        if not np.isfinite(t).all():
            return f"{tier}: NaN or infinite values"
        counts = t[..., :3]
        if ((counts < 0) | (counts > samples) | (counts != np.round(counts))).any() or (
                counts[..., 1] + counts[..., 2] > samples).any():
            return f"{tier}: counts that are not whole numbers of the {samples:g} frames"
        if (t[..., 3] > 0).any():
            return f"{tier}: a log likelihood above 0"
        below = counts[..., 0] - counts[..., 1] + counts[..., 2]
        if (below != below[:, :1]).any():
            return f"{tier}: rows whose answer below is right a varying number of times"
    return None


def pick_stacking(tables: dict[str, np.ndarray], views: int,
                  z: float = STACKING_Z) -> Stacking:
    """The weights :func:`fit_stacking` fits, from :func:`stacking_tables` (summed over any
    number of data sets)."""
    weights = _grid_weights(tables["edge"].shape[1])
    edge_index = 0 if views == 1 else _pick(tables["edge"][0], z)
    chosen = {"edge": float(weights[edge_index])}
    for tier in ("cloud", "escalated"):
        if tier in tables:
            chosen[tier] = float(weights[_pick(tables[tier][edge_index], z)])
    return Stacking(**{k: round(w, 6) for k, w in chosen.items()})


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
    to the higher held-out likelihood of the labels (summed over the frames), then to the
    larger weight. So a tier rarely answers worse than the one below it on a few hundred
    frames' luck.

    A one-view bundle's edge answers on its own: its device decides the local exit alone and
    sends the edge no scores to stack on. (:func:`pick_stacking` on :func:`stacking_tables`
    decides the same; this computes only the chosen edge weight's row of the tiers above.)
    """
    labels = np.asarray(labels)
    weights = _grid_weights(grid)
    edge_weight = float(weights[0 if views == 1 else _pick(
        _table([exits["local"]], exits["edge"], labels, grid)[0], z)])
    below = stack(exits["local"], exits["edge"], edge_weight)
    chosen = {"edge": edge_weight}
    for tier in ("cloud", "escalated"):
        if tier in exits:
            chosen[tier] = float(weights[_pick(_table([below], exits[tier], labels, grid)[0], z)])
    return Stacking(**{k: round(w, 6) for k, w in chosen.items()})
