"""The operating curve: every point agrees with the hierarchy's own accounting, the frontier
only climbs, and a budget picks the point it promises."""

from itertools import pairwise

import numpy as np
import pytest

from ddnn.errors import ConfigError
from ddnn.exits import ExitPolicy
from ddnn.hierarchy import UplinkCost, hierarchy_predictions
from ddnn.operating_curve import (
    curve,
    curve_table,
    frontier,
    pick_from_table,
    pick_max_bytes,
    pick_tolerance,
    sweep,
)

COST = UplinkCost(scores=6, features=32, single_view=False, detail=772)


def _exits(n=400, classes=3, views=4, seed=0):
    """Scores whose exits get better going up, with the confident frames the right ones."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, classes, n)
    present = rng.random((n, views)) > 0.3
    present[:, 0] |= np.arange(n) >= 5
    present[:5] = False  # frames no view saw: no answer, no byte
    exits = {}
    for k, skill in (("local", 0.5), ("edge", 0.6), ("cloud", 0.65), ("escalated", 0.9)):
        right = rng.random(n) < skill
        guess = np.where(right, labels, rng.integers(0, classes, n))
        sure = rng.uniform(0.5, 4.0, n) * np.where(right, 2.0, 0.7)
        exits[k] = rng.normal(0, 0.3, (n, classes)) + sure[:, None] * np.eye(classes)[guess]
    exits["device"] = rng.normal(0, 1, (n, views, classes))
    return exits, labels, present


def _outcome(exits, labels, present, local, edge, level):
    """What ddnn.hierarchy says of one operating point: accuracy and bytes per frame."""
    pred, tier = hierarchy_predictions(exits, ExitPolicy({"local": local, "edge": edge}), level)
    n = present.sum(1)
    seen = n > 0
    return (float((pred == labels)[seen].mean()),
            float(COST.per_frame(n, tier, level).mean()))


def test_every_point_is_what_the_hierarchy_computes():
    exits, labels, present = _exits()
    s = sweep(exits, labels, present, COST, grid=21)
    assert s.correct.shape == (2, 21, 21) and s.seen == 395 and s.frames == 400
    rng = np.random.default_rng(1)
    for level, i, j in zip(rng.integers(0, 2, 25), rng.integers(0, 21, 25),
                           rng.integers(0, 21, 25), strict=True):
        p = s.point(int(level), int(i), int(j))
        acc, bytes_pf = _outcome(exits, labels, present, p.local, p.edge, p.level)
        assert p.accuracy == pytest.approx(acc) and p.bytes_per_frame == pytest.approx(bytes_pf)
        assert sum(p.exit_fraction.values()) == pytest.approx(1.0)


def test_a_bundle_without_escalation_has_level_0_only():
    exits, labels, present = _exits()
    del exits["escalated"]
    s = sweep(exits, labels, present, UplinkCost(6, 32, False), grid=11)
    assert s.correct.shape == (1, 11, 11)
    assert {p.level for p in frontier(s)} == {0}


def test_frontier_climbs_and_starts_at_the_cheapest_point():
    exits, labels, present = _exits()
    s = sweep(exits, labels, present, COST, grid=51)
    points = frontier(s)
    costs = [p.bytes_per_frame for p in points]
    accs = [p.accuracy for p in points]
    assert costs == sorted(costs) and all(b > a for a, b in pairwise(accs))
    assert costs[0] == pytest.approx(s.payload.min() / s.frames)
    assert accs[-1] == pytest.approx(s.correct.max() / s.seen)
    # The escalated cloud is this data's best tier: the most accurate points escalate.
    assert points[-1].level == 1 and points[0].exit_fraction["local"] == 1.0


def test_tolerance_picks_the_cheapest_point_within_it():
    exits, labels, present = _exits()
    s = sweep(exits, labels, present, COST, grid=51)
    assert s.best_tier == pytest.approx(((exits["escalated"].argmax(1) == labels)[5:]).mean())
    for tol in (0.0, 0.02, 0.1):
        for agreement in (0.0, 0.995):
            p = pick_tolerance(s, tol, agreement)
            assert p.accuracy >= s.best_tier - tol - 1e-9
            within = ((s.correct >= (s.best_tier - tol) * s.seen - 1e-9)
                      & (s.agree >= (agreement - tol) * s.seen - 1e-9))
            assert p.bytes_per_frame * s.frames == pytest.approx(s.payload[within].min())
    # A looser budget never costs more bytes.
    assert pick_tolerance(s, 0.1).bytes_per_frame <= pick_tolerance(s, 0.0).bytes_per_frame
    assert pick_tolerance(s, 0.0, 0.0).bytes_per_frame <= pick_tolerance(s, 0.0).bytes_per_frame


def test_agreement_counts_the_frames_answered_as_the_best_tier_answers_them():
    exits, labels, present = _exits()
    s = sweep(exits, labels, present, COST, grid=21)
    seen = present.any(1)
    best = exits["escalated"].argmax(1)  # this data's best tier
    rng = np.random.default_rng(2)
    for level, i, j in zip(rng.integers(0, 2, 25), rng.integers(0, 21, 25),
                           rng.integers(0, 21, 25), strict=True):
        p = s.point(int(level), int(i), int(j))
        pred, _ = hierarchy_predictions(exits, ExitPolicy(p.thresholds), p.level)
        assert s.agree[level, i, j] == (pred == best)[seen].sum()


def test_a_point_that_ties_with_the_best_tier_by_luck_is_not_picked():
    """A sure local exit as accurate as the best tier (80%), but wrong on other frames: it
    answers 40% of the frames differently, so new frames would not find it as accurate."""
    n = 200
    labels = np.zeros(n, int)
    onehot = 9.0 * np.eye(2)
    local = onehot[(np.arange(n) < 40).astype(int)]  # wrong on the first 40 frames
    escalated = onehot[(np.arange(n) >= 160).astype(int)]  # wrong on the last 40
    unsure = np.tile([0.0, 1e-3], (n, 1))  # the edge and the plain cloud: unsure and wrong
    exits = {"local": local, "edge": unsure, "cloud": unsure, "escalated": escalated,
             "device": np.zeros((n, 1, 2))}
    s = sweep(exits, labels, np.ones((n, 1), bool), COST, grid=11)
    assert s.best_tier == pytest.approx(0.8)
    lucky = pick_tolerance(s, 0.0, agreement=0.0)
    assert lucky.exit_fraction["local"] == 1.0 and lucky.accuracy == pytest.approx(0.8)
    careful = pick_tolerance(s, 0.0)
    assert careful.level == 1 and careful.exit_fraction["cloud"] == 1.0


def test_a_byte_budget_picks_the_most_accurate_point_within_it():
    exits, labels, present = _exits()
    s = sweep(exits, labels, present, COST, grid=51)
    table = curve_table(frontier(s))
    for budget in (50, 300, 1000, 5000):
        p = pick_max_bytes(s, budget)
        assert p.bytes_per_frame <= budget
        assert p.accuracy * s.seen == s.correct[s.payload <= budget * s.frames].max()
        # Re-picked from the stored curve (what ddnn evaluate --max-bytes does): the same.
        q = pick_from_table(table, budget)
        assert q.accuracy == pytest.approx(p.accuracy, abs=1e-5)
        assert q.bytes_per_frame == pytest.approx(p.bytes_per_frame, abs=1e-4)
    with pytest.raises(ConfigError, match="no operating point sends at most 1 bytes"):
        pick_max_bytes(s, 1)
    with pytest.raises(ConfigError, match="no operating point"):
        pick_from_table(table, 1)


def test_a_malformed_stored_curve_is_refused():
    with pytest.raises(ConfigError, match="malformed"):
        pick_from_table({"level": [0]}, 100)


def test_the_stored_curve_adds_the_points_that_send_fewest_frames_up_for_their_accuracy():
    exits, labels, present = _exits()
    s = sweep(exits, labels, present, COST, grid=51)
    stored, bytes_first = curve(s), frontier(s)
    assert set(map(_key, bytes_first)) < set(map(_key, stored))
    assert [p.bytes_per_frame for p in stored] == sorted(p.bytes_per_frame for p in stored)
    everything = [s.point(*ix) for ix in np.ndindex(s.correct.shape)]
    # The most accurate point sending no frame to the cloud (the edge exit answers what the
    # local exit leaves), and the local exit alone, are among its points, whatever they cost.
    for fewest in (lambda p: p.exit_fraction["cloud"] == 0,
                   lambda p: p.exit_fraction["local"] == 1):
        best = max(p.accuracy for p in everything if fewest(p))
        assert any(fewest(p) and p.accuracy == best for p in stored)
    no_cloud = max(p.accuracy for p in everything if p.exit_fraction["cloud"] == 0)
    assert not any(p.exit_fraction["cloud"] == 0 and p.accuracy == no_cloud
                   for p in bytes_first)  # (what the bytes frontier alone leaves out)


def _key(p):
    return (p.level, p.local, p.edge)
