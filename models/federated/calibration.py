"""Calibration of the exit thresholds from the sites' held-out data, without the data.

``models.calibrate`` picks a point of the operating curve (``ddnn.operating_curve``) from exact
counts over samples (frames that exit locally, at the edge, answered right, uplink bytes), so
each site computes those counts for every threshold pair of the grid on its own held-out split
(:func:`exit_counts`), the server adds the sites' tables and takes the same decision
(:func:`calibrate_counts`): the point a central calibration on the union of the held-out splits
would choose, while neither samples nor logits leave a site. No site knows which tier is best
over all sites, so each counts, for every tier, the frames answered as that tier answers them
(``agree_local``, ``agree_edge``, ``agree_cloud``); the server keeps the best tier's table for
the agreement rule. A bundle that escalates adds the tables of level 1 (the cloud with the
devices' details: its answers, and the bytes of the details each site's devices would send), so
calibration picks the level as ``ddnn train`` does. Numpy only.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Mapping

import numpy as np

from ddnn.exits import entropy_of_logits
from ddnn.hierarchy import UplinkCost
from ddnn.models.calibrate import Calibration, pick_stacking, stacking_tables_problem
from ddnn.operating_curve import (
    AGREEMENT,
    Sweep,
    best_tier,
    curve,
    curve_table,
    pick_max_bytes,
    pick_tolerance,
)
from ddnn.stacking import Stacking

log = logging.getLogger(__name__)

TIERS = ("local", "edge", "cloud")
COUNT_NAMES = ("samples", "seen", "views", "tier_correct", "local_exits", "edge_exits",
               "past_local_views", "correct")
AGREE_NAMES = tuple(f"agree_{t}" for t in TIERS)  # absent from the tables of older sites
# Level 1, from a site of a bundle that escalates (all or none: older sites send none). The
# escalated exit is a fourth tier the others' answers are compared with, at both levels.
LEVEL1_NAMES = ("escalated_correct", "correct_1", "details_1", "agree_escalated",
                *(f"agree_{t}_1" for t in (*TIERS, "escalated")))


def exit_counts(exits: Mapping[str, np.ndarray], labels: np.ndarray, present: np.ndarray,
                grid: int = 201) -> dict[str, np.ndarray]:
    """One site's sums over its held-out samples for every (T_local, T_edge) of the grid.

    Over the samples some view saw: ``local_exits[i]`` have local entropy < T_i, and their
    views ``past_local_views[i]`` the others; ``edge_exits[i, j]``: of the others, those with
    edge entropy < T_j; ``correct[i, j]``: right answers at (T_i, T_j); ``agree_<t>[i, j]``:
    answers equal to tier t's own at (T_i, T_j); ``tier_correct``: right answers of the local,
    edge and cloud exit alone. Where ``exits`` has ``escalated`` and ``detail_bytes`` (each
    frame's details as its devices send them), the same at level 1 (:data:`LEVEL1_NAMES`, the
    ``_1`` tables), and ``details_1[i, j]``: the detail bytes of the frames past both exits.
    """
    n_present = present.sum(axis=1).astype(np.int64)
    seen = n_present > 0
    n = n_present[seen]
    ts = np.linspace(0.0, 1.0, grid)
    escalates = "escalated" in exits and "detail_bytes" in exits
    tiers = (*TIERS, "escalated") if escalates else TIERS
    preds = {k: exits[k].argmax(-1)[seen] for k in tiers}
    truth = np.asarray(labels)[seen]
    h_local = entropy_of_logits(exits["local"])[seen]
    h_edge = entropy_of_logits(exits["edge"])[seen]
    loc = h_local[None, :] < ts[:, None]  # (T_local, N)
    edge_ok = h_edge[None, :] < ts[:, None]  # (T_edge, N)
    not_loc = (~loc).astype(np.int64)
    to_cloud = ~edge_ok  # (T_edge, N): past the edge exit too, for frames past the local one

    def answered(hit: Mapping[str, np.ndarray], cloud: str = "cloud") -> np.ndarray:
        """(T_local, T_edge): the frames whose answer there has ``hit`` (per exit, per frame),
        the cloud answering as ``cloud``. Integer matrix products: (T_local, N) x (N, T_edge)
        sums over samples exactly."""
        total = (loc & hit["local"]).sum(1)[:, None]
        total = total + not_loc @ (edge_ok & hit["edge"]).T.astype(np.int64)
        total = total + not_loc @ (to_cloud & hit[cloud]).T.astype(np.int64)
        return total.astype(np.int64)

    right = {k: p == truth for k, p in preds.items()}
    same = {t: {k: p == preds[t] for k, p in preds.items()} for t in tiers}
    counts = {
        "samples": np.array([len(labels)], dtype=np.int64),
        "seen": np.array([int(seen.sum())], dtype=np.int64),
        "views": np.array([int(n.sum())], dtype=np.int64),
        "tier_correct": np.array([int(right[k].sum()) for k in TIERS], dtype=np.int64),
        "local_exits": loc.sum(1).astype(np.int64),
        "edge_exits": (not_loc @ edge_ok.T.astype(np.int64)).astype(np.int64),
        "past_local_views": (not_loc @ n).astype(np.int64),
        "correct": answered(right),
        **{f"agree_{t}": answered(same[t]) for t in tiers},
    }
    if escalates:
        details = np.asarray(exits["detail_bytes"], np.int64)[seen]
        counts.update({
            "escalated_correct": np.array([int(right["escalated"].sum())], dtype=np.int64),
            "correct_1": answered(right, "escalated"),
            "details_1": (not_loc @ (to_cloud * details).T).astype(np.int64),
            **{f"agree_{t}_1": answered(same[t], "escalated") for t in tiers},
        })
    return counts


MAX_FRAMES = 2**40  # more held-out frames than any site holds; sums stay far from int64's end


def counts_problem(counts: Mapping[str, np.ndarray], grid: int, views: int,
                   detail: int = 0) -> str | None:
    """Why ``counts`` cannot be :func:`exit_counts` on a grid of ``grid`` thresholds for a
    bundle of ``views`` cameras whose devices' details take at most ``detail`` bytes each (0: a
    bundle that does not escalate), None where they can: tables from a site are checked before
    they are added up. Whole numbers, of the shapes ``exit_counts`` gives, none negative, none
    over the frames (views, detail bytes) counted; the agreement tables and the level-1 tables
    each all or none (an older site sends neither)."""
    shapes = {"samples": (1,), "seen": (1,), "views": (1,), "tier_correct": (3,),
              "local_exits": (grid,), "edge_exits": (grid, grid),
              "past_local_views": (grid,), "correct": (grid, grid),
              **dict.fromkeys(AGREE_NAMES, (grid, grid)),
              **dict.fromkeys(LEVEL1_NAMES, (grid, grid)), "escalated_correct": (1,)}
    missing = set(COUNT_NAMES) - set(counts)
    if missing:
        return f"no {', '.join(sorted(missing))}"
    for group, what in ((AGREE_NAMES, "agreement"), (LEVEL1_NAMES, "level-1")):
        if 0 < len(set(group) & set(counts)) < len(group):
            return f"some {what} tables but not all"
    escalates = LEVEL1_NAMES[0] in counts
    if escalates and detail <= 0:
        return "level-1 tables for a bundle that does not escalate"
    for name, shape in shapes.items():
        if name not in counts:
            continue  # the optional tables: an older site sends none
        a = np.asarray(counts[name])
        if a.shape != shape or a.dtype.kind not in "iu":
            return f"{name}: {a.dtype}{list(a.shape)}, expected whole numbers {list(shape)}"
        if (a < 0).any() or (a > MAX_FRAMES).any():
            return f"{name}: counts out of range"
    frames, seen, seen_views = (int(counts[k][0]) for k in ("samples", "seen", "views"))
    per_frame = [k for k in shapes if k in counts and k not in ("samples", "views",
                                                                 "past_local_views",
                                                                 "details_1")]
    if seen > frames or seen_views > seen * views or any(
            (np.asarray(counts[k]) > seen).any() for k in per_frame):
        return "more frames (views) counted than the site saw"
    # int64 before any arithmetic: a site may send small integer types, which would overflow.
    past_local = np.asarray(counts["past_local_views"], np.int64)
    if (past_local > seen_views).any():
        return "more views counted than the site's frames have"
    if escalates:
        # Each frame past both exits sends at most one detail a view: no more than its views
        # past the local exit have, nor than those frames have cameras.
        past_both = (seen - np.asarray(counts["local_exits"], np.int64)[:, None]
                     - np.asarray(counts["edge_exits"], np.int64))
        most = np.minimum(past_local[:, None], past_both * views) * detail
        if (past_both < 0).any() or (np.asarray(counts["details_1"], np.int64) > most).any():
            return "more detail bytes than the frames past both exits can send"
    return None


def narrow_counts(counts: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The tables in the narrowest unsigned integer type that holds each one's largest count,
    for the wire: a site's held-out split is a few hundred frames, so most of its tables fit
    a byte a count, where :func:`exit_counts` gives eight (the tables were about a fifth of a
    default federation's bytes). The server reads any integer type (:func:`counts_problem`)
    and adds in int64 (:func:`add_counts`)."""
    out: dict[str, np.ndarray] = {}
    for name, table in counts.items():
        a = np.asarray(table)
        if a.dtype.kind not in "iu" or (a.size and int(a.min()) < 0):
            raise ValueError(f"{name}: counts are whole numbers, none negative")
        top = int(a.max()) if a.size else 0
        kind = next(t for t in (np.uint8, np.uint16, np.uint32, np.uint64)
                    if top <= np.iinfo(t).max)
        out[name] = a.astype(kind)
    return out


def add_counts(tables: Iterable[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The sum of several sites' tables (same grid); the agreement and the level-1 tables only
    when every site sent them (an older site's table has neither)."""
    tables = list(tables)
    names = COUNT_NAMES + tuple(k for group in (AGREE_NAMES, LEVEL1_NAMES)
                                if all(k in t for t in tables for k in group) for k in group)
    total: dict[str, np.ndarray] = {}
    for t in tables:
        for k in names:
            # int64 whatever the sites sent (narrowed tables): a sum of uint8 would wrap.
            wide = np.asarray(t[k], dtype=np.int64)
            total[k] = total[k] + wide if k in total else wide
    return total


def calibrate_counts(counts: Mapping[str, np.ndarray], cost: UplinkCost,
                     tolerance: float = 0.0, agreement: float = AGREEMENT,
                     max_bytes: float | None = None) -> Calibration:
    """``models.calibrate.calibrate``'s choice from summed tables, not logits: at levels 0
    and 1 where the tables have level 1, else at level 0 (a site too old to count it); by an
    accuracy ``tolerance``, or (``max_bytes``) the most accurate point within a byte budget.

    The best tier is the one with most right answers (ties: the higher one, as ``sweep``
    has it); without agreement tables (a site too old to count them) accuracy alone decides,
    and the calibration says so with an agreement of 0.
    """
    frames, seen = int(counts["samples"][0]), int(counts["seen"][0])
    if frames < 1:
        raise ValueError("no held-out samples to calibrate on")
    levels = 2 if all(k in counts for k in LEVEL1_NAMES) else 1
    # The tiers from the lowest up, as ``sweep`` ranks them; the escalated exit is the cloud
    # at level 1.
    right = dict(zip(TIERS, counts["tier_correct"].astype(np.int64).tolist(), strict=True))
    if levels == 2:
        right["escalated"] = int(counts["escalated_correct"][0])
    top = best_tier(right)
    agree = None
    if all(k in counts for k in AGREE_NAMES):
        agree = np.stack([counts[f"agree_{top}" + ("_1" if level else "")]
                          for level in range(levels)]).astype(np.int64)
    else:
        log.warning("a site sent no agreement tables: calibrating on accuracy alone")
        agreement = 0.0
    local = counts["local_exits"].astype(np.int64)
    grid = len(local)
    payload = (int(counts["views"][0]) * cost.sent_scores
               + counts["past_local_views"].astype(np.int64)[:, None] * cost.features)
    payload = np.broadcast_to(payload, (grid, grid))
    correct, payloads = [counts["correct"]], [payload]
    if levels == 2:
        correct.append(counts["correct_1"])
        payloads.append(payload + counts["details_1"])
    s = Sweep(grid=np.linspace(0.0, 1.0, grid),
              correct=np.stack(correct).astype(np.int64),
              local=np.broadcast_to(local[:, None], (levels, grid, grid)),
              edge=np.broadcast_to(counts["edge_exits"].astype(np.int64), (levels, grid, grid)),
              payload=np.stack(payloads).astype(np.int64),
              frames=frames, seen=seen,
              best_tier=float(max(right.values())) / max(seen, 1), agree=agree)
    if max_bytes is not None:
        return Calibration(pick_max_bytes(s, max_bytes), None, max_bytes, s.best_tier, frames,
                           curve_table(curve(s)), agreement)
    point = pick_tolerance(s, tolerance, agreement)
    return Calibration(point, tolerance, None, s.best_tier, frames, curve_table(curve(s)),
                       agreement)


def calibration_budget(tolerance: float, agreement: float, max_bytes: float,
                       recorded: Mapping) -> tuple[float, float, float | None]:
    """``(tolerance, agreement, max_bytes)`` a federation calibrates its version by: the ones
    it was given (``max_bytes`` above 0: a byte budget; a ``tolerance`` or ``agreement`` of 0
    or above), else the budget the starting bundle was calibrated by (``recorded``: its
    manifest's ``calibration``), so a version keeps its bundle's objective: a byte budget
    stays one."""
    if max_bytes > 0:
        return 0.0, AGREEMENT, max_bytes
    if tolerance < 0 and recorded.get("max_bytes") is not None:
        return 0.0, AGREEMENT, float(recorded["max_bytes"])
    if tolerance < 0:
        tolerance = float(recorded.get("tolerance") or 0.0)
    if agreement < 0:
        agreement = float(recorded.get("agreement", AGREEMENT))
    return tolerance, agreement, None


def refit_stacking(sites: Iterable[tuple[int, float, Mapping[str, np.ndarray] | None]],
                   views: int, tiers: set[str], current: Stacking | None = None,
                   partial: Collection[int] = ()) -> tuple[Stacking | None, dict]:
    """The stacking ``models.calibrate.fit_stacking`` would fit on the union of the sites'
    held-out splits, from their summed stacking tables, and what the refit stood on.

    ``sites``: each one's node, held-out samples and tables (``tiers``: the upper tiers the
    bundle has). A site that held out experience, not data, cannot run the escalated cloud
    (experience holds no details): the tables of a site in ``partial`` may lack that tier,
    which then keeps its weight in ``current`` (the bundle's stacking; its weight was fitted
    for the bundle's edge weight, which the refit may change). A site whose tables cannot be true
    (``stacking_tables_problem``) is left out with a warning, as a bad update is; the refit is
    refused (``None``: the bundle's stacking stays) where a site that held data out sent no
    tables (a site too old to count them) or no site is left. Tables within bounds still weigh
    as the samples their site claims, as its calibration tables do."""
    used, left_out = [], {}
    for node, samples, tables in sites:
        if not np.isfinite(samples):  # else every bound below would hold
            log.warning("left the stacking tables of site %s out: it claims %s samples", node,
                        samples)
            left_out[str(node)] = f"a held-out sample count of {samples}"
            continue
        if samples <= 0:
            continue
        if tables is None:
            log.warning("site %s sent no stacking tables: the bundle's stacking stays", node)
            return None, {"refit": False, "reason": f"site {node} sent no stacking tables"}
        sent = (set(tables) if node in partial and set(tables) == tiers - {"escalated"}
                else tiers)
        problem = stacking_tables_problem(dict(tables), samples, sent)
        if problem is not None:
            log.warning("left the stacking tables of site %s out: %s", node, problem)
            left_out[str(node)] = problem
            continue
        used.append(tables)
    info: dict = {"sites": len(used), **({"left_out": left_out} if left_out else {})}
    if not used:
        return None, {"refit": False, "reason": "no site's stacking tables to refit on", **info}
    common = set.intersection(*(set(t) for t in used))
    total = {k: sum(np.asarray(t[k], dtype=np.float64) for t in used) for k in common}
    refit = pick_stacking(total, views).to_dict()
    kept = (current or Stacking()).to_dict()
    if tiers - common:
        info["kept"] = sorted(tiers - common)  # the sites' held-out experience cannot run them
    return Stacking(**{t: refit[t] if t in common else kept[t] for t in kept}), {
        "refit": True, **info}
