"""The operating curve: accuracy, uplink bytes and exit shares over the exit thresholds and
escalation levels (``ddnn.hierarchy``), and the point a budget picks from it.

Every pair (T_local, T_edge) of a grid over [0, 1], at every escalation level the bundle has,
is one operating point. Its accuracy counts the frames some view saw; its bytes are the mean
device uplink payload per frame, exactly as :class:`ddnn.hierarchy.UplinkCost` counts them.
The *curve* is the Pareto frontier: the points that no cheaper point matches in accuracy.
A budget picks one point: an accuracy tolerance against the best single tier (the cheapest point
within it), or a byte budget per frame (the most accurate point within it).

Held-out data is a few hundred frames, and many points tie with the best tier there by a frame
or two of luck: the cheapest of them then falls short of it on new data (1.1 points on the
3-class set, docs/training.md). So a point within the tolerance must also give the best tier's
own answers on nearly every held-out frame (:data:`AGREEMENT`, less the tolerance): a point that
answers as the best tier does cannot be much less accurate, whatever the labels of new frames.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ddnn.errors import ConfigError
from ddnn.exits import entropy_of_logits
from ddnn.hierarchy import UplinkCost, cloud_exit

AGREEMENT = 0.995  # the share of held-out frames a tolerance-0 point answers as the best tier
CURVE_KEYS = ("level", "local_threshold", "edge_threshold", "accuracy", "bytes_per_frame",
              "local_fraction", "edge_fraction", "cloud_fraction")


@dataclass(frozen=True)
class OperatingPoint:
    """Thresholds and an escalation level, and what they achieve on some data."""

    level: int
    local: float  # T_local
    edge: float  # T_edge
    accuracy: float
    bytes_per_frame: float
    exit_fraction: dict[str, float]

    @property
    def thresholds(self) -> dict[str, float]:
        return {"local": self.local, "edge": self.edge}

    def to_dict(self) -> dict:
        return {"level": self.level, "thresholds": self.thresholds, "accuracy": self.accuracy,
                "bytes_per_frame": self.bytes_per_frame, "exit_fraction": self.exit_fraction}


@dataclass(frozen=True)
class Sweep:
    """Every grid point's outcome, as exact counts: arrays of shape (levels, T, T) indexed by
    (level, T_local index, T_edge index)."""

    grid: np.ndarray  # the thresholds tried, for both exits
    correct: np.ndarray  # frames answered right
    local: np.ndarray  # frames that leave at the local exit
    edge: np.ndarray  # ... at the edge exit
    payload: np.ndarray  # uplink bytes of all frames together
    frames: int  # frames in the data (bytes are per frame of these)
    seen: int  # frames some view saw (accuracy and exit shares are of these)
    best_tier: float  # accuracy of the best single tier answering every seen frame
    agree: np.ndarray | None = None  # frames answered as the best tier answers them (None:
    # not counted, as in federated calibration, which then compares accuracy alone)

    def point(self, level: int, i: int, j: int) -> OperatingPoint:
        seen = max(self.seen, 1)
        loc, edg = int(self.local[level, i, j]), int(self.edge[level, i, j])
        return OperatingPoint(
            level=level, local=float(self.grid[i]), edge=float(self.grid[j]),
            accuracy=int(self.correct[level, i, j]) / seen,
            bytes_per_frame=int(self.payload[level, i, j]) / max(self.frames, 1),
            exit_fraction={"local": loc / seen, "edge": edg / seen,
                           "cloud": (self.seen - loc - edg) / seen},
        )


def best_tier(right: dict[str, int]) -> str:
    """The tier with the most right answers, ``right`` listing the tiers from the lowest up;
    ties go to the higher tier (whose answers a calibrated point should then give)."""
    return max(reversed(right), key=lambda k: right[k])


def sweep(exits: dict[str, np.ndarray], labels: np.ndarray, present: np.ndarray,
          cost: UplinkCost, grid: int = 201) -> Sweep:
    """Count every grid point's outcome on labelled per-exit scores; ``present`` (N, V)."""
    n_present = present.sum(axis=1).astype(np.int64)
    seen = n_present > 0
    levels = 2 if "escalated" in exits else 1
    ts = np.linspace(0.0, 1.0, grid)
    h_local = entropy_of_logits(exits["local"])[seen]
    h_edge = entropy_of_logits(exits["edge"])[seen]
    preds = {k: np.argmax(exits[k], axis=-1)[seen] for k in ("local", "edge")}
    preds.update({f"cloud{level}": np.argmax(cloud_exit(exits, level), axis=-1)[seen]
                  for level in range(levels)})
    truth = np.asarray(labels)[seen]
    right = {k: p == truth for k, p in preds.items()}
    top = best_tier({k: int(r.sum()) for k, r in right.items()}) if truth.size else "local"
    same = {k: p == preds[top] for k, p in preds.items()}
    n = n_present[seen]
    details = cost.details(exits, n_present)[seen]  # bytes of a frame's details, escalated
    shape = (levels, grid, grid)
    correct, local, edge, payload, agree = (np.zeros(shape, np.int64) for _ in range(5))
    edge_exits = h_edge[None, :] < ts[:, None]  # (T_edge, N)
    def share(x: np.ndarray) -> float:
        return float(x.mean()) if x.size else 0.0

    best = max(share(r) for r in right.values())
    for level in range(levels):
        right_cloud, same_cloud = right[f"cloud{level}"], same[f"cloud{level}"]
        for i, t in enumerate(ts):
            loc = h_local < t
            edg = ~loc[None, :] & edge_exits
            cld = ~loc[None, :] & ~edg
            correct[level, i] = ((loc & right["local"]).sum() + (edg & right["edge"]).sum(1)
                                 + (cld & right_cloud).sum(1))
            agree[level, i] = ((loc & same["local"]).sum() + (edg & same["edge"]).sum(1)
                               + (cld & same_cloud).sum(1))
            local[level, i] = loc.sum()
            edge[level, i] = edg.sum(1)
            payload[level, i] = (n.sum() * cost.sent_scores + ((edg | cld) @ n) * cost.features
                                 + ((cld @ details) if level else 0))
    return Sweep(ts, correct, local, edge, payload, len(labels), int(seen.sum()), float(best),
                 agree)


def _order(s: Sweep, keys) -> np.ndarray:
    """Flat indices of every point, sorted by ``keys`` (arrays of shape (L, T, T)), first key
    first, each ascending."""
    return np.lexsort([np.ravel(k) for k in reversed(keys)])


def _point(s: Sweep, flat: int) -> OperatingPoint:
    return s.point(*(int(x) for x in np.unravel_index(flat, s.correct.shape)))


def _levels(s: Sweep) -> np.ndarray:
    return np.broadcast_to(np.arange(s.correct.shape[0])[:, None, None], s.correct.shape)


def pick_tolerance(s: Sweep, tolerance: float, agreement: float = AGREEMENT) -> OperatingPoint:
    """The cheapest point whose accuracy is within ``tolerance`` of the best single tier's
    and whose answers are the best tier's on at least ``agreement - tolerance`` of the frames
    (where counted); ties: more local exits, then more edge exits, then more accurate, then
    the lower level. Answering every frame at the best tier qualifies, so there always is one."""
    floor = (s.best_tier - tolerance) * s.seen - 1e-9
    ok = s.correct >= floor
    if s.agree is not None:
        ok &= s.agree >= (agreement - tolerance) * s.seen - 1e-9
    keys = [~ok, s.payload, -s.local, -s.edge, -s.correct, _levels(s)]
    return _point(s, int(_order(s, keys)[0]))


def pick_max_bytes(s: Sweep, max_bytes: float) -> OperatingPoint:
    """The most accurate point that puts at most ``max_bytes`` per frame on the uplink; ties:
    fewer bytes, more local exits, more edge exits, the lower level."""
    ok = s.payload <= max_bytes * s.frames + 1e-9
    if not ok.any():
        least = s.payload.min() / max(s.frames, 1)
        raise ConfigError(f"no operating point sends at most {max_bytes:g} bytes per frame; "
                          f"the least is {least:.1f} (every frame answered by the local exit)")
    keys = [~ok, -s.correct, s.payload, -s.local, -s.edge, _levels(s)]
    return _point(s, int(_order(s, keys)[0]))


def _climb(s: Sweep, keys) -> list[int]:
    """Flat indices of the points no point before them in ``keys`` order matches in accuracy,
    in that order."""
    flats, best = [], -1
    for flat in _order(s, keys):
        c = int(s.correct.flat[flat])
        if c > best:
            flats.append(int(flat))
            best = c
    return flats


def frontier(s: Sweep) -> list[OperatingPoint]:
    """The operating curve: the points no cheaper point matches in accuracy, cheapest first."""
    return [_point(s, f) for f in _climb(s, [s.payload, -s.correct, -s.local, -s.edge,
                                             _levels(s)])]


def curve(s: Sweep) -> list[OperatingPoint]:
    """What a bundle stores as its operating curve, cheapest first: the bytes frontier
    (:func:`frontier`) and the points the latency planner (``ddnn edge --latency-slo``) needs
    besides, those no point sending fewer frames to the cloud (then past the local exit)
    matches in accuracy, and those no point pulling fewer features (then sending fewer to the
    cloud) does. A slow cloud or a slow pull costs by frames, not bytes: the frontier alone
    would leave out, say, the edge exit answering every frame the local exit leaves."""
    up = s.seen - s.local  # frames past the local exit (pulled)
    cloud = up - s.edge  # ... and on to the cloud
    bytes_first = [s.payload, -s.correct, -s.local, -s.edge, _levels(s)]
    flats = {*_climb(s, bytes_first),
             *_climb(s, [cloud, up, -s.correct, s.payload, _levels(s)]),
             *_climb(s, [up, cloud, -s.correct, s.payload, _levels(s)])}
    # (in the frontier's order, as :func:`_order` would sort them: no second sort of them all)
    return [_point(s, f) for f in sorted(flats, key=lambda f: (*(k.flat[f] for k in bytes_first),
                                                                f))]


def curve_table(points: list[OperatingPoint], digits: int = 5) -> dict[str, list]:
    """Points as parallel lists (:data:`CURVE_KEYS`), compact enough for a manifest."""
    def r(x: float) -> float:
        return round(float(x), digits)

    return {
        "level": [p.level for p in points],
        "local_threshold": [r(p.local) for p in points],
        "edge_threshold": [r(p.edge) for p in points],
        "accuracy": [r(p.accuracy) for p in points],
        "bytes_per_frame": [r(p.bytes_per_frame) for p in points],
        **{f"{t}_fraction": [r(p.exit_fraction[t]) for p in points]
           for t in ("local", "edge", "cloud")},
    }


def table_points(table: dict[str, list]) -> list[OperatingPoint]:
    """The points of a stored curve (:func:`curve_table`), in its order."""
    try:
        rows = [dict(zip(CURVE_KEYS, values, strict=True))
                for values in zip(*(table[k] for k in CURVE_KEYS), strict=True)]
        return [OperatingPoint(
            level=int(r["level"]), local=float(r["local_threshold"]),
            edge=float(r["edge_threshold"]), accuracy=float(r["accuracy"]),
            bytes_per_frame=float(r["bytes_per_frame"]),
            exit_fraction={t: float(r[f"{t}_fraction"]) for t in ("local", "edge", "cloud")})
            for r in rows]
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"the bundle's operating curve is malformed ({e})") from None


def pick_from_table(table: dict[str, list], max_bytes: float) -> OperatingPoint:
    """The most accurate point of a stored curve within ``max_bytes`` per frame (ties: fewer
    bytes): how ``ddnn evaluate --max-bytes`` re-picks a bundle's point from its held-out curve."""
    points = table_points(table)
    within = [p for p in points if p.bytes_per_frame <= max_bytes + 1e-9]
    if not within:
        least = min((p.bytes_per_frame for p in points), default=float("nan"))
        raise ConfigError(f"no operating point sends at most {max_bytes:g} bytes per frame; "
                          f"the least is {least:.1f}")
    return max(within, key=lambda p: (p.accuracy, -p.bytes_per_frame))
